"""Deeply nested free-form values: the native decoder reads every depth vLLM reads.

vLLM 0.25.1's decoder (msgspec) stops where Python's recursion limit runs out, so it reads
``kv_transfer_params`` values and utility results a little under 1000 levels deep.
corewire's decoder reads up to ``MAX_DEPTH`` (1000) levels inside such a field and fails
one level deeper with a ``ProtocolError`` that names the depth and the path. Its walk
keeps open containers on the heap, so decoding at the bound needs no more stack than a
shallow value: checked on a thread with a 256 KiB stack, in a child process (a stack
overflow there fails the test instead of killing the runner).

"Levels" counts the containers in the field's value: ``[[]]`` is 2 levels.

Checks ``docs/protocol.md`` §9.1 (free-form values nested more than 1000 levels).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import pytest

from corewire import ProtocolError
from corewire.codec import NativeDecoder
from depth_support import PLACES, SHAPES, chain, deep, in_kv_transfer_params
from paths_support import TESTS_DIR

# corewire's bound (rust/src/core/schema.rs, MAX_DEPTH).
MAX_DEPTH = 1000

TOO_DEEP = re.escape(
    f"value nested {MAX_DEPTH + 1} levels deep, deeper than the {MAX_DEPTH} allowed"
)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("place", list(PLACES))
def test_bound_decodes_and_one_level_deeper_fails(place: str, shape: str) -> None:
    """MAX_DEPTH levels decode whole; one more is a ProtocolError naming depth and path;
    the decoder then reads the next frame normally."""
    frame, get, path = PLACES[place]
    decoder = NativeDecoder(release="0.25.1")
    value = get(decoder.decode([frame(deep(shape, MAX_DEPTH))]))
    assert len(chain(value)) == MAX_DEPTH
    with pytest.raises(ProtocolError) as info:
        decoder.decode([frame(deep(shape, MAX_DEPTH + 1))])
    text = str(info.value)
    assert text.startswith(path), text
    # The path is shortened around a count of the segments left out.
    assert re.search(r"\]…\(\d+ more\)…\[", text), text
    assert re.search(f": {TOO_DEEP}$", text), text
    assert len(text) < 300, text
    assert len(chain(get(decoder.decode([frame(deep(shape, 3))])))) == 3


def test_far_past_the_bound_is_a_protocol_error() -> None:
    """Millions of levels fail at the bound, quickly, without recursion."""
    for shape in SHAPES:
        with pytest.raises(ProtocolError, match=TOO_DEEP):
            NativeDecoder(release="0.25.1").decode([in_kv_transfer_params(deep(shape, 3_000_000))])


def _vllm_deepest(
    decode: Callable[[bytes], Any], make: Callable[[int], bytes], get: Callable[[Any], Any]
) -> tuple[int, list[str]]:
    """Most levels vLLM's decoder reads, from a fresh thread (its shallowest Python stack,
    so the most it ever reads: a deeper caller leaves it fewer levels), and the chain of
    the value it decodes there."""
    found: list[tuple[int, list[str]]] = []

    def reads(levels: int) -> bool:
        try:
            decode(make(levels))
        except RecursionError:
            return False
        return True

    def search() -> None:
        lo, hi = 2, MAX_DEPTH + 1
        if reads(hi):
            lo = hi
        while lo + 1 < hi:  # reads(lo) and not reads(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if reads(mid) else (lo, mid)
        found.append((lo, chain(get(decode(make(lo))))))

    thread = threading.Thread(target=search)
    thread.start()
    thread.join()
    return found[0]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("place", list(PLACES))
def test_every_depth_vllm_reads_is_read(place: str, shape: str) -> None:
    """vLLM's own MsgpackDecoder(EngineCoreOutputs) reads no deeper than MAX_DEPTH, and the
    deepest frame it reads decodes to the same value here."""
    pytest.importorskip("vllm")
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder

    frame, get, _ = PLACES[place]
    vllm = MsgpackDecoder(EngineCoreOutputs)
    deepest, vllm_chain = _vllm_deepest(
        lambda b: vllm.decode([b]), lambda n: frame(deep(shape, n)), get
    )
    print(f"vLLM reads {place} {shape} up to {deepest} levels; corewire up to {MAX_DEPTH}")
    assert 900 < deepest <= MAX_DEPTH
    assert len(vllm_chain) == deepest
    native = NativeDecoder(release="0.25.1").decode([frame(deep(shape, deepest))])
    assert chain(get(native)) == vllm_chain


_SMALL_STACK_SCRIPT = textwrap.dedent(
    """
    import sys
    import threading

    from corewire import ProtocolError
    from corewire.codec import NativeDecoder
    from depth_support import PLACES, SHAPES, chain, deep

    MAX_DEPTH = int(sys.argv[1])


    def run():
        decoder = NativeDecoder(release="0.25.1")
        for place, (frame, get, _) in PLACES.items():
            for shape in SHAPES:
                message = decoder.decode([frame(deep(shape, MAX_DEPTH))])
                levels = len(chain(get(message)))
                del message  # freed here, on the small stack too
                for levels_sent in (MAX_DEPTH + 1, 1_000_000):
                    try:
                        decoder.decode([frame(deep(shape, levels_sent))])
                        print(place, shape, levels, "decoded past the bound", flush=True)
                    except ProtocolError:
                        pass
                print(place, shape, levels, "ok", flush=True)


    threading.stack_size(256 * 1024)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    """
)


def test_bound_on_a_thread_with_a_small_stack() -> None:
    """At the bound and past it, on a 256 KiB thread stack: values or ProtocolError, never
    a crash (deep key tuples included, whose hashing recurses in CPython itself)."""
    tests_dir = str(TESTS_DIR)
    pythonpath = os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _SMALL_STACK_SCRIPT, str(MAX_DEPTH)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    expected = [f"{place} {shape} {MAX_DEPTH} ok" for place in PLACES for shape in SHAPES]
    assert proc.stdout.splitlines() == expected, proc.stdout


async def test_a_deep_utility_result_reaches_its_caller() -> None:
    """A real engine echoes a value 800 levels deep (deeper than the old bound of 64, as
    deep as vLLM's own client reads from its asyncio loop): the call completes with it."""
    from client_support import REPLAY
    from corewire import AsyncMPClient
    from leak_support import no_leaks

    value: list[Any] = []
    for _ in range(799):
        value = [value]
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            result = await client.call_utility_async("echo", value)
            assert chain(result) == ["list"] * 800
            assert await client.call_utility_async("echo", 1) == 1
        finally:
            client.shutdown()
