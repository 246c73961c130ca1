"""The engine process's small helpers on their own: the iterative msgpack head reader,
rate-limited warnings, delayed results, and the reasons sent with ERROR finishes."""

from __future__ import annotations

import logging
import random
import threading
import time

import msgspec
import pytest

from corewire.engine.delayed import DelayedResults
from corewire.engine.frame_head import array_length, read_head
from corewire.engine.logthrottle import ThrottledWarning
from corewire.engine.reasons import INTERNAL_ERROR_REASON, reason_for, safe_reason

_encode = msgspec.msgpack.encode


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(12 if depth < 4 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-(2**63), 2**64 - 1)
    if kind == 3:
        return rng.randint(-40, 200)
    if kind == 4:
        return rng.random() * 10 ** rng.randint(-5, 5)
    if kind == 5:
        return "".join(rng.choice("aé€😀z ") for _ in range(rng.choice([0, 3, 40, 300])))
    if kind == 6:
        return bytes(rng.randrange(256) for _ in range(rng.choice([0, 5, 300])))
    if kind == 7:
        return msgspec.msgpack.Ext(rng.randrange(128), b"x" * rng.choice([1, 2, 4, 8, 16, 3]))
    if kind in (8, 9):
        return [_random_value(rng, depth + 1) for _ in range(rng.choice([0, 2, 20]))]
    return {str(i): _random_value(rng, depth + 1) for i in range(rng.choice([0, 2, 20]))}


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def test_read_head_matches_a_full_decode_on_random_arrays() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        items = [_random_value(rng) for _ in range(rng.choice([0, 1, 5, 14, 17]))]
        if rng.random() < 0.1:
            items = items + [None] * 70_000  # array32 header
        payload = _encode(items)
        fields = range(min(len(items), 20))
        want = {i: items[i] for i in fields if _is_scalar(items[i])}
        assert read_head(payload, fields) == want


def test_read_head_never_fails_on_truncated_or_hostile_input() -> None:
    payload = _encode(["rid", [1, [2, {"k": b"v" * 300}]], None, {"x": 1.5}, "tail", 7])
    for cut in range(len(payload)):
        head = read_head(payload[:cut], range(6))
        assert head is None or all(isinstance(k, int) for k in head)
    # A header that claims far more items than the bytes could hold.
    assert read_head(b"\x92\xdd\xff\xff\xff\xff\x01", (0, 1)) == {}
    assert read_head(b"\x93\x01\xdf\xff\xff\xff\xff", (0, 2)) == {0: 1}
    assert read_head(b"\x92\xc1\x01", (0, 1)) == {}  # 0xc1 is never valid
    assert read_head(b"\x91\xa2\xff\xfe", (0,)) == {}  # not UTF-8: not readable as str
    assert read_head(_encode({"a": 1}), (0,)) is None
    assert read_head(b"", (0,)) is None


def test_read_head_reads_past_nesting_deeper_than_any_recursion_limit() -> None:
    deep = b"\x91" * 300_000 + b"\xc0"
    payload = b"\x94" + _encode(3) + _encode(2**64 - 1) + deep + _encode("after")
    assert read_head(payload, (0, 1, 2, 3), budget=400_000) == {0: 3, 1: 2**64 - 1, 3: "after"}
    # The default budget bounds the work: fields past it are left out, those before kept.
    started = time.perf_counter()
    assert read_head(payload, (0, 1, 2, 3)) == {0: 3, 1: 2**64 - 1}
    assert time.perf_counter() - started < 1.0
    wide = _encode(["rid", list(range(2_000_000)), None, 5])
    assert read_head(wide, (0, 3)) == {0: "rid"}


def test_array_length_reads_the_declared_count_alone() -> None:
    assert array_length(_encode(["r", list(range(70_000))]), 1) == 70_000
    assert array_length(_encode(["r", [1, 2]]), 1) == 2
    assert array_length(_encode(["r", "not an array"]), 1) is None
    assert array_length(_encode(["r"]), 1) is None
    # The header alone counts: a frame cut right after it still tells.
    assert array_length(b"\x92\xa1r\xdd\x00\x10\x00\x00", 1) == 1 << 20
    assert array_length(_encode({"a": 1}), 0) is None


def test_throttled_warning_logs_a_burst_then_a_summary(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("corewire.test.throttle")
    throttle = ThrottledWarning(log, "test event", burst=3, interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger="corewire.test.throttle"):
        for i in range(100):
            throttle.warning("event %d", i)
        assert [r.getMessage() for r in caplog.records] == ["event 0", "event 1", "event 2"]
        throttle.flush()  # the interval is not over: nothing yet
        assert len(caplog.records) == 3
        time.sleep(0.25)
        throttle.flush()
        assert (
            caplog.records[-1]
            .getMessage()
            .startswith("97 more test event warning(s) not logged in the last")
        )
        assert caplog.records[-1].getMessage().endswith("(100 in total)")
        # A new interval: a new burst.
        throttle.warning("event %d", 100)
        assert caplog.records[-1].getMessage() == "event 100"
        throttle.close()  # nothing left out since: no summary
        assert caplog.records[-1].getMessage() == "event 100"
    assert (throttle.total, throttle.suppressed) == (101, 97)


def test_delayed_results_keep_order_and_stop_their_thread() -> None:
    delayed = DelayedResults("corewire-test-delayed", max_pending=5, max_delay_s=10.0)
    futures = [delayed.schedule(i, 0.1 - i / 100) for i in range(5)]
    with pytest.raises(ValueError, match="too many pending"):
        delayed.schedule(5, 0.0)
    assert [f.result(timeout=5) for f in futures] == [0, 1, 2, 3, 4]
    # Idle: the thread ends by itself, and comes back for the next result.
    deadline = time.monotonic() + 5
    while any(t.name == "corewire-test-delayed" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the idle timer thread did not end"
        time.sleep(0.01)
    assert delayed.schedule("again", 0.0).result(timeout=5) == "again"
    cancelled = delayed.schedule("never", 10.0)
    dropped = delayed.schedule("x", 0.05)
    dropped.cancel()  # a caller that gave up: the timer skips it
    delayed.close()
    assert cancelled.cancelled()
    with pytest.raises(ValueError, match="closed"):
        delayed.schedule(1, 0.0)
    for bad in (10.5, -0.1, float("nan"), float("inf"), True, "1", None):
        with pytest.raises(ValueError, match="delay must be"):
            DelayedResults("unused", max_delay_s=10.0).schedule(1, bad)


def test_reasons_are_short_one_line_and_free_of_paths() -> None:
    assert safe_reason("bad value 7") == "bad value 7"
    assert safe_reason("cannot read /srv/models/x.bin: denied") == "cannot read <path>: denied"
    assert safe_reason("see ./conf/a.json or ~/x/y") == "see <path> or <path>"
    assert safe_reason("and/or 3/4 stay") == "and/or 3/4 stay"
    assert safe_reason("first\nTraceback (most recent call last):\n  File ...") == "first"
    assert len(safe_reason("x" * 1000)) == 200
    assert safe_reason("   ") == INTERNAL_ERROR_REASON
    assert reason_for(ValueError("top_p must be in (0, 1]")) == "top_p must be in (0, 1]"
    assert reason_for(TypeError("bad type")) == "bad type"
    assert reason_for(RuntimeError("CUDA error at /opt/x.cu:7")) == INTERNAL_ERROR_REASON
    assert reason_for(KeyError("secret")) == INTERNAL_ERROR_REASON


def test_launch_picks_the_dp_proc_and_fails_loudly_without_it(monkeypatch):
    """DP options select the DP proc class; a DP module that cannot be imported is an
    error, never a plain engine that would silently ignore the options."""
    import sys

    from corewire.engine.core import EngineCoreProc
    from corewire.engine.dp import DPEngineCoreProc
    from corewire.engine.launch import _proc_class

    assert _proc_class({}) is EngineCoreProc
    assert _proc_class({"data_parallel_size": 2}) is DPEngineCoreProc
    monkeypatch.setitem(sys.modules, "corewire.engine.dp", None)
    with pytest.raises(ImportError):
        _proc_class({"data_parallel_size": 2})
    assert _proc_class({}) is EngineCoreProc
