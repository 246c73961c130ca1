"""The Rust call-id registry and send tracker, through their Python bindings."""

from __future__ import annotations

import asyncio
import gc
import weakref

import numpy as np
import pytest
import zmq

from corewire import EngineDeadError
from corewire._native import CallRegistry, SendTracker


def test_registry_ids_are_unique_and_pop_returns_the_future() -> None:
    reg = CallRegistry()
    futures = [object() for _ in range(1000)]
    ids = [reg.register(f) for f in futures]
    assert len(set(ids)) == 1000
    assert all(0 <= i < 2**64 for i in ids)
    assert len(reg) == 1000
    for i, f in zip(ids, futures, strict=True):
        assert i in reg
        assert reg.pop(i) is f
    assert len(reg) == 0


def test_registry_ids_above_2_pow_63_and_wraparound() -> None:
    reg = CallRegistry(start=2**64 - 2)
    ids = [reg.register(n) for n in range(3)]
    assert ids == [2**64 - 2, 2**64 - 1, 0]
    assert reg.pop(2**64 - 1) == 1
    assert reg.pop(2**64 - 2) == 0


def test_registry_random_start() -> None:
    starts = {CallRegistry().register(None) for _ in range(16)}
    assert len(starts) > 1


@pytest.mark.parametrize("bad", [-1, 2**64, 2**70, "7", None, 1.5])
def test_registry_unknown_or_invalid_ids_are_harmless(bad: object) -> None:
    reg = CallRegistry(start=7)
    call_id = reg.register("kept")
    assert reg.pop(bad) is None
    assert reg.discard(bad) is False
    assert bad not in reg
    assert reg.pop(call_id + 1) is None
    assert len(reg) == 1 and reg.pop(call_id) == "kept"
    assert reg.pop(call_id) is None  # a second reply for the same id finds nothing


def test_registry_discard_releases_the_future() -> None:
    reg = CallRegistry()

    class Future:
        pass

    future = Future()
    ref = weakref.ref(future)
    call_id = reg.register(future)
    del future
    assert ref() is not None
    assert reg.discard(call_id) is True
    assert ref() is None
    assert reg.discard(call_id) is False


def test_registry_drain_and_close() -> None:
    reg = CallRegistry()
    futures = {reg.register(n): n for n in range(50)}
    assert sorted(reg.drain()) == sorted(futures.values())
    assert len(reg) == 0 and not reg.closed
    reg.register("late")
    assert reg.drain(close=True) == ["late"]
    assert reg.closed
    with pytest.raises(EngineDeadError):
        reg.register("after death")
    assert len(reg) == 0
    assert "closed=True" in repr(reg)


async def test_registry_holds_asyncio_futures() -> None:
    reg = CallRegistry()
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    call_id = reg.register(future)
    reg.pop(call_id).set_result(42)
    assert await future == 42


def test_tracker_keeps_objects_alive_until_zeromq_is_done() -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    pull = ctx.socket(zmq.PULL)
    try:
        push.bind("inproc://tracker")
        pull.connect("inproc://tracker")
        tracker = SendTracker()
        payload = np.arange(1 << 16, dtype=np.int64)  # 512 KiB: sent without a copy
        ref = weakref.ref(payload)
        zmq_tracker = push.send(payload, copy=False, track=True)
        tracker.track(zmq_tracker, payload)
        del payload
        gc.collect()
        # inproc hands the message to the peer by reference: not done until it is read
        # and dropped, and the array must stay alive until then.
        assert len(tracker) == 1 and ref() is not None
        assert tracker.reap() == 0
        frame = pull.recv(copy=False)
        assert np.frombuffer(frame.buffer, dtype=np.int64)[-1] == (1 << 16) - 1
        del frame
        zmq_tracker.wait(5)
        assert tracker.reap() == 1
        assert len(tracker) == 0 and ref() is None
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_tracker_skips_done_trackers_and_reaps_oldest_first() -> None:
    class Fake:
        def __init__(self, done: bool) -> None:
            self.done = done

    tracker = SendTracker()
    tracker.track(Fake(True), "never stored")
    assert len(tracker) == 0
    first, second = Fake(False), Fake(False)
    tracker.track(first, "a")
    tracker.track(second, "b")
    second.done = True
    assert tracker.reap() == 0  # the oldest holds back the newer one
    first.done = True
    assert tracker.reap() == 2
    tracker.track(Fake(False), "c")
    assert tracker.clear() == 1 and len(tracker) == 0


def test_tracker_propagates_errors_from_done() -> None:
    class Broken:
        @property
        def done(self) -> bool:
            raise RuntimeError("tracker broke")

    tracker = SendTracker()
    with pytest.raises(RuntimeError, match="tracker broke"):
        tracker.track(Broken(), None)
    assert len(tracker) == 0
