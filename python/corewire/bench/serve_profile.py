"""The serve benchmark's sampling profile of the API server: py-spy, and samples by layer.

Each sample (a collapsed py-spy stack) goes to the layer of its innermost frame that
matches :data:`LAYERS`. A collection of CPython's cyclic garbage collector runs inside
whichever allocation crossed the threshold, and scans the whole young heap of the server;
sampled that way it is charged to the code that triggered it (a decode that allocates
~257 lists in a burst is often that code). With py-spy's ``--native`` the collector's own
frames (``gc_collect_main`` and kin) are visible: those samples can also be counted apart,
in :data:`COLLECTOR`. Without ``--native`` they cannot be told apart, and only the
as-sampled classification exists.

py-spy's ``--native`` mode pauses the process, and then counts threads blocked in some
waits as active (a worker thread waiting on its queue, the collector probe's thread in
``accept``): in native profiles, samples whose stack is in such a wait are left out
(:attr:`Profile.idle`), as a non-blocking profile leaves idle threads out.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CLIENT_LAYER",
    "COLLECTOR",
    "FAST_PATH_LAYER",
    "LAYERS",
    "NATIVE_OUTPUT_LAYER",
    "NATIVE_RATE",
    "OTHER",
    "RATE",
    "Profile",
    "classify",
    "in_collection",
    "is_waiting",
    "profiled",
    "read_profile",
]

#: The layer of corewire's native output processing (``corewire/vllm/output/``), apart
#: from vLLM's "output processing".
NATIVE_OUTPUT_LAYER = "output processing (corewire)"

#: The layer of the fast path's Python (``corewire/vllm/fast_path/``).
FAST_PATH_LAYER = "fast path (corewire)"

#: Layers of the API server's CPU, and the file-path fragments of each. A sample belongs to
#: the layer of its innermost frame that matches (generic modules such as asyncio match
#: nothing, so their time goes to the code that called them).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "receive + decode",
        (
            "vllm/v1/engine/core_client.py",
            "vllm/v1/serial_utils.py",
            "corewire/client/",
            "corewire/codec.py",
            "corewire/vllm/adapters/client.py",
            "corewire/vllm/adapters/dp_client.py",
            "corewire/vllm/adapters/v0_33_0.py",
            "corewire/releases/",
            "zmq/",
            "msgspec/",
        ),
    ),
    ("logprobs", ("vllm/v1/engine/logprobs.py", "vllm/logprobs.py")),
    # vLLM's logprobs processing decodes each candidate token through its tokenizer pool
    # (vllm/tokenizers/, transformers/): with logprobs, most of this layer is logprob work.
    (
        "detokenization",
        ("vllm/v1/engine/detokenizer.py", "vllm/tokenizers/", "tokenizers/", "transformers/"),
    ),
    ("stats", ("vllm/v1/metrics/", "prometheus_client/")),
    (
        "output processing",
        ("vllm/v1/engine/output_processor.py", "vllm/v1/engine/async_llm.py", "vllm/outputs.py"),
    ),
    # corewire's native output processing (COREWIRE_VLLM_OUTPUT=1): its Rust code has no
    # Python frame of its own, so its samples land on the module that called it. What it
    # hands to vLLM's own classes (RequestOutput, stats) stays in vLLM's layers above.
    (
        NATIVE_OUTPUT_LAYER,
        ("corewire/vllm/output/",),
    ),
    # corewire's fast path of vllm serve: its Python, once per request (the first and
    # last chunks); the frames it writes per token are native, inside the layer above.
    (FAST_PATH_LAYER, ("corewire/vllm/fast_path/",)),
    ("OpenAI serving", ("vllm/entrypoints/", "pydantic/", "pydantic_core/")),
    ("HTTP", ("uvicorn/", "starlette/", "fastapi/", "h11/", "httptools/", "anyio/")),
)
OTHER = "other"
CLIENT_LAYER = "receive + decode"
#: The layer of samples taken inside a collection (native profiles only).
COLLECTOR = "garbage collector"

#: py-spy's samples per second.
RATE = 200
#: py-spy's samples per second with ``--native``. Each native sample stops the API server
#: while py-spy unwinds every thread's stack: at 200 a second py-spy took 70% of a core
#: here and left the server a quarter of one, so a 256-stream run crawled for many
#: minutes. At 50 the server runs most of the time.
NATIVE_RATE = 50

# CPython's collector entry points as py-spy names them: gc_collect_main (3.8-3.11, 3.13),
# gc_collect_generations (3.12), gc_collect_region / _young / _full / _increment (3.13+),
# gc_collect (an explicit gc.collect()). py-spy keeps libpython frames whose name starts
# with "gc", so these show; the collector's helpers (visit_decref, ...) do not.
_COLLECTOR_PREFIX = "gc_collect"


# Native functions in which a thread waits without running (libc's, and CPython's lock
# wait, which is how threading locks and queue.SimpleQueue block).
_WAITS = frozenset(
    {
        "accept",
        "accept4",
        "epoll_wait",
        "epoll_pwait",
        "poll",
        "ppoll",
        "select",
        "pselect",
        "pselect6",
        "nanosleep",
        "clock_nanosleep",
        "pthread_cond_wait",
        "pthread_cond_timedwait",
        "pthread_cond_clockwait",
        "sem_wait",
        "sem_timedwait",
        "sem_clockwait",
        "PyThread_acquire_lock_timed",
    }
)


def _native_name(frame: str) -> str | None:
    """The function name of a native frame, None for a Python frame."""
    name, _, where = frame.partition(" (")
    # A Python frame is "name (path/file.py:LINE)"; a native one "name (library)".
    file = where.rstrip(")").rsplit(":", 1)[0]
    return None if file.endswith((".py", ".pyx")) else name


def in_collection(stack: str) -> bool:
    """Whether a collapsed stack (``frame;frame;...``) was sampled inside a collection."""
    for frame in stack.split(";"):
        name = _native_name(frame)
        if name is not None and name.startswith(_COLLECTOR_PREFIX):
            return True
    return False


def is_waiting(stack: str) -> bool:
    """Whether a native stack was sampled in a thread waiting (see the module's note)."""
    return any(_native_name(frame) in _WAITS for frame in stack.split(";"))


def classify(stack: str, *, collections_apart: bool = True) -> str:
    """The layer of one collapsed py-spy stack (``frame;frame;...``, root first).

    With ``collections_apart`` a stack inside a collection (visible in native stacks
    only) is :data:`COLLECTOR`; otherwise, and for every other stack, it is the layer of
    the innermost matching frame (the collection charged to the code that triggered it).
    """
    if collections_apart and in_collection(stack):
        return COLLECTOR
    for frame in reversed(stack.split(";")):
        for layer, fragments in LAYERS:
            if any(fragment in frame for fragment in fragments):
                return layer
    return OTHER


@dataclass
class Profile:
    """Samples per layer, both ways: as sampled, and with collections apart.

    ``native``: whether the stacks had native frames; without them no collection is
    visible, and ``collections_apart`` equals ``as_sampled`` without meaning anything.
    """

    as_sampled: Counter[str] = field(default_factory=Counter)
    collections_apart: Counter[str] = field(default_factory=Counter)
    native: bool = False
    #: Native samples of threads waiting, left out of both counters.
    idle: int = 0

    def __add__(self, other: Profile) -> Profile:
        """Both profiles' samples together (rounds of one scenario)."""
        return Profile(
            as_sampled=self.as_sampled + other.as_sampled,
            collections_apart=self.collections_apart + other.collections_apart,
            native=self.native or other.native,
            idle=self.idle + other.idle,
        )

    @property
    def samples(self) -> int:
        """Samples in the profile."""
        return sum(self.as_sampled.values())

    def share(self, layer: str, *, collections_apart: bool = False) -> float:
        """``layer``'s fraction of the samples (NaN without samples, or when collections
        apart are asked of a profile without native frames)."""
        if collections_apart and not self.native:
            return float("nan")
        layers = self.collections_apart if collections_apart else self.as_sampled
        total = sum(layers.values())
        return layers[layer] / total if total else float("nan")


def read_profile(path: Path, *, native: bool = False) -> Profile:
    """Samples per layer from py-spy's raw (collapsed stacks) output."""
    profile = Profile(native=native)
    if not path.exists():
        return profile
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        if native and is_waiting(stack):
            profile.idle += int(count)
        else:
            profile.as_sampled[classify(stack, collections_apart=False)] += int(count)
            profile.collections_apart[classify(stack)] += int(count)
    return profile


@contextlib.contextmanager
def profiled(pid: int, out: Path, enabled: bool, *, native: bool = False) -> Iterator[None]:
    """Sample ``pid`` with py-spy meanwhile, :data:`RATE` times a second.

    Without ``native``, non-blocking: the server is never paused. py-spy cannot unwind
    native stacks of a running process, so ``native`` pauses the server at each sample,
    :data:`NATIVE_RATE` times a second.
    """
    proc = None
    if enabled:
        mode = ["--native"] if native else ["--nonblocking"]
        proc = subprocess.Popen(
            [
                shutil.which("py-spy") or "py-spy",
                "record",
                "--pid",
                str(pid),
                *mode,
                "--rate",
                str(NATIVE_RATE if native else RATE),
                "--format",
                "raw",
                "--output",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    try:
        yield
    finally:
        if proc is not None:
            proc.send_signal(2)  # SIGINT: py-spy writes what it has and exits
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
