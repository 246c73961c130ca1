"""Engine processes under hostile input: duplicate ids, oversized and deeply nested
requests, malformed-frame floods, unsafe utilities, and what an ERROR finish tells the
client.

The engine runs as a real child process (``run_engine_core`` under ``spawn``, or the
``corewire engine`` command) and gets hand-built frames over real ZeroMQ sockets. One
engine (the reference engine with test hooks, ``max_model_len`` 512, a 5 ms step) is
shared by the tests that leave it healthy.

Checks ``docs/protocol.md`` §9.2 (a bad frame fails alone, even nested past every
decoder's limit), §9.3 (ERROR finishes, their reasons, duplicate ids) and §5.5 (the
prefill stats vLLM reads).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import psutil
import pytest

from client_support import request
from corewire.engine.reference import ReferenceEngine
from corewire.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    PoolingParams,
)
from engine_support import (
    LIGHT_REFERENCE,
    FrontEnd,
)
from hook_engine import INTERNAL_ERROR_ID, VALUE_ERROR_WITH_PATH_ID
from paths_support import TESTS_DIR

MAX_MODEL_LEN = 512
# The module's shared engine: it outlives single tests (conftest's leak check).
LEAK_ALLOWED_PIDS: set[int] = set()
_encode = msgspec.msgpack.encode


@pytest.fixture(scope="module")
def eng() -> Iterator[FrontEnd]:
    """A front-end with one hook engine shared by the module."""
    with tempfile.TemporaryDirectory(prefix="corewire-hardening-") as path:
        os.chmod(path, 0o700)
        fe = FrontEnd(Path(path), "hard")
        args = {**LIGHT_REFERENCE, "max_model_len": MAX_MODEL_LEN, "step_delay": 0.005}
        proc = fe.start_engine("hook_engine:HookEngine", args)
        LEAK_ALLOWED_PIDS.add(proc.pid)
        fe.wait_ready()
        yield fe
        assert proc.is_alive(), "the shared engine died during the module"
        proc.terminate()
        proc.join(10)
        exitcode = proc.exitcode
        LEAK_ALLOWED_PIDS.discard(proc.pid)
        fe.close()
        assert exitcode == 0


def pooling(rid: str, prompt: list[int]) -> EngineCoreRequest:
    """An embedding request."""
    return EngineCoreRequest(
        request_id=rid, prompt_token_ids=prompt, pooling_params=PoolingParams()
    )


# ---------------------------------------------------------------------- duplicate ids


def test_duplicate_request_id_is_dropped_and_the_original_streams_on(eng: FrontEnd) -> None:
    before = eng.value("engine_core_counters")["duplicate_requests"]
    eng.add(request("dup", 60, prompt=[1, 2, 3]))
    first = eng.recv()
    assert isinstance(first, EngineCoreOutputs)
    assert [o.request_id for o in first.outputs] == ["dup"]
    # The same id again while the first still runs (other parameters, to be sure which
    # one the engine keeps), then an unrelated request.
    eng.add(request("dup", 5, prompt=[9, 9]))
    eng.add(request("dup-neighbour", 4, prompt=[4]))
    got = eng.collect(["dup", "dup-neighbour"])
    outs = [first.outputs[0], *got["dup"]]
    # One coherent stream: no ERROR, exactly one finish, and it is the last output.
    assert [o.finish_reason for o in outs] == [None] * 59 + [FinishReason.LENGTH]
    assert sum(len(o.new_token_ids) for o in outs) == 60
    assert got["dup-neighbour"][-1].finish_reason == FinishReason.LENGTH
    assert eng.nothing_for(0.2)  # nothing more under "dup" after its finish
    # Once finished, the id is free again.
    assert len(eng.generate(request("dup", 3, prompt=[1, 2, 3]))) == 3
    assert eng.value("engine_core_counters")["duplicate_requests"] == before + 1


def test_aborted_id_can_be_reused_at_once(eng: FrontEnd) -> None:
    eng.add(request("reuse", 400, prompt=[5]))
    eng.recv()
    eng.abort(["reuse"])
    eng.add(request("reuse", 3, prompt=[5]))
    outs = eng.collect(["reuse"])["reuse"]
    assert outs[-1].finish_reason == FinishReason.LENGTH
    # Outputs of the aborted run may still have been in flight; the new run is whole.
    assert eng.nothing_for(0.2)


def test_resumable_requests_are_refused_without_streaming_input(eng: FrontEnd) -> None:
    # vLLM's streaming input sends later chunks under the same id; an engine that cannot
    # take them refuses the request up front instead of failing a chunk mid-stream.
    resumable = request("resumable", 4, prompt=[1, 2])
    resumable.resumable = True
    eng.add(resumable)
    (out,) = eng.collect(["resumable"])["resumable"]
    assert out.finish_reason == FinishReason.ERROR
    assert out.stop_reason == "streaming input (resumable requests) is not supported"


# ---------------------------------------------------------------------- engine limits


def test_every_request_kind_is_checked_against_max_model_len(eng: FrontEnd) -> None:
    eng.add(pooling("pool-too-long", [1] * (MAX_MODEL_LEN + 1)))
    eng.add(request("gen-too-long", 8, prompt=[1] * (MAX_MODEL_LEN + 1)))
    eng.add(pooling("pool-fits", [1] * MAX_MODEL_LEN))
    got = eng.collect(["pool-too-long", "gen-too-long", "pool-fits"])
    for rid in ("pool-too-long", "gen-too-long"):
        (out,) = got[rid]
        assert out.finish_reason == FinishReason.ERROR
        assert out.stop_reason == f"prompt of 513 tokens exceeds max_model_len {MAX_MODEL_LEN}"
    assert got["pool-fits"][-1].finish_reason == FinishReason.STOP


def test_huge_pooling_prompt_is_refused_fast_while_others_stream(eng: FrontEnd) -> None:
    engine = psutil.Process(eng.procs[0].pid)
    rss_before = engine.memory_info().rss
    eng.add(request("bystander", 150, prompt=[7]))
    eng.recv()
    # 1M tokens: a 3 MB frame, which used to stall every request for 30 s and take 5 GB.
    huge = pooling("huge-pool", list(range(1000, 1000 + 1_000_000)))
    sent = time.monotonic()
    eng.add(huge)
    gaps: list[float] = []
    refused_after = None
    last = time.monotonic()
    while True:
        msg = eng.recv(timeout=30)
        assert isinstance(msg, EngineCoreOutputs)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        rids = {o.request_id: o for o in msg.outputs}
        if "huge-pool" in rids:
            assert rids["huge-pool"].finish_reason == FinishReason.ERROR
            assert rids["huge-pool"].stop_reason == (
                f"prompt of 1000000 tokens exceeds max_model_len {MAX_MODEL_LEN}"
            )
            refused_after = now - sent
        if "bystander" in rids and rids["bystander"].finish_reason is not None:
            break
    assert refused_after is not None and refused_after < 3.0, refused_after
    assert max(gaps) < 2.0, max(gaps)
    assert engine.memory_info().rss - rss_before < 400 << 20


# ---------------------------------------------------------------------- deep nesting

# An array nested 100,000 levels deep: far past Python's recursion limit.
_DEEP = b"\x91" * 100_000 + b"\xc0"


def test_deeply_nested_requests_are_answered_when_ids_are_readable(eng: FrontEnd) -> None:
    # ADD: the request id comes first; sampling_params.extra_args holds the deep value.
    add = b"".join(
        [
            b"\x99",
            _encode("deep-add"),
            _encode([1, 2]),
            b"\xc0",
            b"\x81" + _encode("extra_args") + b"\x81" + _encode("x") + _DEEP,
            b"\xc0",
            _encode(0.0),
            b"\xc0\xc0\xc0",
        ]
    )
    eng.send_frames([EngineCoreRequestType.ADD.value, add])
    (out,) = eng.collect(["deep-add"], timeout=20)["deep-add"]
    assert out.finish_reason == FinishReason.ERROR
    assert out.stop_reason is not None and "nested too deeply" in out.stop_reason
    # UTILITY: the call id is readable before the deep arguments.
    utility = b"\x94" + _encode(0) + _encode(4242) + _encode("echo") + b"\x91" + _DEEP
    eng.send_frames([EngineCoreRequestType.UTILITY.value, utility])
    reply = eng.wait_utility(4242, timeout=20)
    assert reply.failure_message is not None
    assert reply.failure_message.startswith("Call to echo method failed: ")
    assert "nested too deeply" in reply.failure_message
    # Nothing readable to answer: dropped, and the engine serves on.
    eng.send_frames([EngineCoreRequestType.ADD.value, b"\x91" + _DEEP])
    eng.send_frames([EngineCoreRequestType.ABORT.value, b"\x91" + _DEEP])
    eng.send_frames([EngineCoreRequestType.UTILITY.value, _DEEP])
    assert eng.value("echo", "alive") == "alive"
    assert len(eng.generate(request("after-deep", 2, prompt=[3]))) == 2
    assert not eng.backlog


# ---------------------------------------------------------------------- error reasons


def test_error_finishes_carry_a_short_safe_reason(eng: FrontEnd) -> None:
    eng.add(EngineCoreRequest(request_id="oov", prompt_token_ids=[1, 99999]))
    eng.add(EngineCoreRequest(request_id=INTERNAL_ERROR_ID, prompt_token_ids=[1]))
    eng.add(EngineCoreRequest(request_id=VALUE_ERROR_WITH_PATH_ID, prompt_token_ids=[1]))
    eng.send_frames([EngineCoreRequestType.ADD.value, _encode(["malformed", "not a token list"])])
    got = eng.collect(["oov", INTERNAL_ERROR_ID, VALUE_ERROR_WITH_PATH_ID, "malformed"])
    reasons = {}
    for rid, outs in got.items():
        (out,) = outs
        assert out.finish_reason == FinishReason.ERROR
        reasons[rid] = out.stop_reason
    # A request the engine refused: the engine's own words.
    assert reasons["oov"] == "prompt token id 99999 is outside the vocabulary [0, 4096)"
    # An unexpected failure inside the engine: nothing of its text reaches the client.
    assert reasons[INTERNAL_ERROR_ID] == "internal engine error"
    # A refusal whose text names a file: first line only, the path left out.
    assert reasons[VALUE_ERROR_WITH_PATH_ID] == "prompt refused by <path>"
    assert reasons["malformed"].startswith("malformed request: ")
    for reason in reasons.values():
        assert "/" not in reason and "\n" not in reason and len(reason) <= 200


# ---------------------------------------------------------------------- utilities


def test_shipped_reference_engine_has_no_fault_hooks() -> None:
    for name in ("fail_next_step", "raise_error"):
        assert not hasattr(ReferenceEngine, name), name


def test_delayed_echo_refuses_delays_it_cannot_honour(eng: FrontEnd) -> None:
    for delay in (1e300, float("inf"), float("nan"), -1.0, "soon"):
        text = eng.call("delayed_echo", "x", delay, timeout=10).failure_message
        assert text is not None and text.startswith("Call to delayed_echo method failed: ")
    # The timer is alive and well: a normal delay still answers.
    assert eng.value("delayed_echo", "y", 0.05) == "y"


def test_delayed_echo_uses_one_thread_for_many_calls() -> None:
    engine = ReferenceEngine(device="cpu")
    try:
        before = threading.active_count()
        futures = [engine.delayed_echo(i, 0.3 - i / 1000) for i in range(300)]
        assert threading.active_count() <= before + 1
        assert [f.result(timeout=10) for f in futures] == list(range(300))
        # Bounded backlog: past the limit, calls fail instead of queueing without end.
        pending = []
        with pytest.raises(ValueError, match="too many pending"):
            for _ in range(100_000):
                pending.append(engine.delayed_echo(None, 60.0))
        assert 0 < len(pending) < 100_000
    finally:
        engine.shutdown()
    assert all(f.cancelled() for f in pending)


def test_profile_reports_failure_when_it_cannot_write(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    engine = ReferenceEngine(device="cpu", profile_dir=str(blocker / "traces"))
    try:
        engine.profile(True, "t")
        with pytest.raises(OSError, match="could not write the profiler trace"):
            engine.profile(False)
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------- log floods


def test_malformed_frame_flood_logs_a_bounded_summary(tmp_path: Path) -> None:
    fe = FrontEnd(tmp_path, "flood")
    log_path = tmp_path / "engine.log"
    cmd = [
        sys.executable, "-m", "corewire.cli", "engine",
        "--input-address", fe.input_address, "--output-address", fe.output_address,
        "--engine", "corewire.engine.synthetic:SyntheticEngine",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    try:
        fe.wait_ready()
        count = 20_000
        kinds = [
            [EngineCoreRequestType.ADD.value, b"\xc1"],
            [EngineCoreRequestType.ABORT.value, b"\x92"],
            [b"\x09", b"x"],  # no request type
            [EngineCoreRequestType.UTILITY.value, b"\xff"],
        ]
        for i in range(count):
            fe.send_frames(kinds[i % len(kinds)])
            if i % 500 == 499:
                # A ROUTER drops what passes its high-water mark: pace the flood with
                # round trips (the reply comes after every frame sent before the call).
                assert fe.value("engine_core_counters")["malformed_frames"] == i + 1
        counters = fe.value("engine_core_counters")
        child.send_signal(signal.SIGTERM)
        child.wait(20)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        fe.close()
    text = log_path.read_text(errors="replace")
    warnings = [line for line in text.splitlines() if "malformed" in line]
    assert len(warnings) <= 15, f"{len(warnings)} lines, {len(text)} bytes of log"
    assert len(text) < 20_000
    assert counters["malformed_frames"] == count
    assert counters["log_lines_suppressed"] == count - len(
        [line for line in warnings if "dropping a malformed request" in line]
    )
    # Every frame is accounted for: a line of its own, or counted in a summary line.
    summarized = [
        int(m.group(1))
        for line in warnings
        if (m := re.search(r"(\d+) more malformed request warning\(s\) not logged", line))
    ]
    assert summarized and len(warnings) - len(summarized) + sum(summarized) == count


def test_megabyte_ids_and_names_keep_every_log_line_small(tmp_path: Path) -> None:
    """Request ids, utility names and error texts of 1 MB, each logged by a real engine
    (a duplicate ADD, a refused ADD, an unknown utility, a failing one at DEBUG): the
    whole log stays a few KB, each value shortened with its length shown, and every
    caller still gets its whole answer (the id it sent, the error it caused)."""
    fe = FrontEnd(tmp_path, "big")
    log_path = tmp_path / "engine.log"
    cmd = [
        sys.executable, "-m", "corewire.cli", "engine",
        "--input-address", fe.input_address, "--output-address", fe.output_address,
        "--engine", "hook_engine:HookEngine",
        "--engine-args", json.dumps({**LIGHT_REFERENCE, "max_model_len": MAX_MODEL_LEN}),
    ]  # fmt: skip
    tests_dir = str(TESTS_DIR)
    env = {**os.environ, "COREWIRE_LOG_LEVEL": "DEBUG", "PYTHONPATH": tests_dir}
    mb = 1 << 20
    long_id, refused_id = "L" * mb, "R" * mb
    with open(log_path, "wb") as log:
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
    try:
        fe.wait_ready()
        fe.add(request(long_id, max_tokens=20))
        fe.add(request(long_id, max_tokens=20))  # a duplicate of a request in flight
        fe.add(request(refused_id, prompt=[1] * (MAX_MODEL_LEN + 1)))
        unknown = fe.call("u" * mb)
        failing = fe.call("raise_error", "e" * mb)
        done = fe.collect([long_id, refused_id])
        counters = fe.value("engine_core_counters")
        child.send_signal(signal.SIGTERM)
        assert child.wait(20) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        fe.close()
    assert done[refused_id][-1].finish_reason == FinishReason.ERROR
    assert done[long_id][-1].finish_reason == FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in done[long_id]) == 20  # the duplicate ran not
    assert counters["duplicate_requests"] == 1 and counters["refused_requests"] == 1
    assert unknown.failure_message is not None and "no utility method" in unknown.failure_message
    assert failing.failure_message is not None and "e" * mb in failing.failure_message
    text = log_path.read_text(errors="replace")
    assert len(text.encode()) < 20_000, f"{len(text)} bytes of log"
    assert max(map(len, text.splitlines())) < 1_000
    # Each value was logged, shortened, with its length.
    for logged in ("in flight", "refused", "utility call", "raise_error"):
        assert logged in text, logged
    assert text.count(f"... ({mb} chars)") == 3  # the ids and the utility's name
    assert re.search(r"raise_error failed: RuntimeError\('e+\.\.\. \(\d{7} chars\)", text)


# ---------------------------------------------------------------------- vLLM metrics


def _prefill(n: int) -> dict[str, int]:
    return {
        "num_prompt_tokens": n,
        "num_computed_tokens": n,
        "num_cached_tokens": 0,
        "num_local_cached_tokens": 0,
        "num_external_cached_tokens": 0,
    }


@pytest.mark.parametrize("kind", ["reference", "synthetic"])
def test_first_output_carries_prefill_stats_vllm_reads(kind: str) -> None:
    from vllm.v1.engine import EngineCoreOutputs as VllmOutputs
    from vllm.v1.metrics.stats import PrefillStats, SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder

    from corewire.codec import Encoder
    from corewire.engine.synthetic import SyntheticEngine

    engine: Any = ReferenceEngine(device="cpu") if kind == "reference" else SyntheticEngine()
    engine.add_request(request("a", 3, prompt=[5, 6, 7]))
    outputs = engine.step()
    # A request that joins a batch already running gets its own first-output stats.
    engine.add_request(request("b", 2, prompt=[1] * 4))
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    firsts = {}
    for out in outputs:
        firsts.setdefault(out.request_id, out)
    for out in outputs:
        want = None
        if firsts[out.request_id] is out:
            want = _prefill(3 if out.request_id == "a" else 4)
        assert out.prefill_stats == want, (out.request_id, out.prefill_stats)
    # vLLM's own decoder turns it into its PrefillStats, and takes every stats key.
    stats = engine.scheduler_stats()
    frames = Encoder().encode(
        EngineCoreOutputs(outputs=[firsts["a"]], scheduler_stats=stats, timestamp=1.0)
    )
    decoded = MsgpackDecoder(VllmOutputs).decode(frames)
    assert decoded.outputs[0].prefill_stats == PrefillStats(**_prefill(3))
    known = {f.name for f in dataclasses.fields(SchedulerStats)}
    assert set(stats) <= known, set(stats) - known
    engine.shutdown()


def test_reference_engine_counts_steps_under_vllms_name() -> None:
    engine = ReferenceEngine(device="cpu")
    engine.add_request(request("s", 2, prompt=[1]))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler_stats() == {
        "num_running_reqs": 0,
        "num_waiting_reqs": 0,
        "step_counter": 2,
    }
    engine.shutdown()


def test_replay_engine_outputs_carry_a_timestamp(tmp_path: Path) -> None:
    from corewire.engine.replay import EngineLink, ReplayEngine

    fe = FrontEnd(tmp_path, "replay")
    link = EngineLink(0, fe.input_address, fe.output_address)
    try:
        replay = ReplayEngine(link)
        link.reply(1, "plain")
        link.reply(2, failure="Call to x method failed: no")
        link.reply(3, np.zeros(4))  # not plain msgpack: the encoder's path
        replay.add(request("r", 50, prompt=[1]))
        replay.handle([EngineCoreRequestType.ABORT.value, _encode(["r"])])
        for _ in range(4):
            msg = fe.recv(timeout=10)
            assert isinstance(msg, EngineCoreOutputs)
            assert msg.timestamp > 0.0, msg
    finally:
        link.close()
        fe.close()


@pytest.mark.parametrize(
    "result",
    [None, "plain", [1, 2.5, {"a": [True, None]}], -(2**63), 2**64 - 1, b"\x00bin", {"k": "v"}],
)
def test_replay_plain_reply_is_the_codec_encoding(result: Any) -> None:
    """The replay link's cheap utility reply is byte for byte what the codec writes for
    the same EngineCoreOutputs; values the plain encoder cannot write go to the codec."""
    from corewire.codec import Encoder
    from corewire.engine.link import engine_outputs
    from corewire.engine.replay import encode_plain_outputs
    from corewire.protocol import UtilityOutput, UtilityResult

    outputs = engine_outputs(3, utility_output=UtilityOutput(7, None, UtilityResult(result)))
    (codec,) = Encoder().encode(outputs)
    assert encode_plain_outputs(outputs) == bytes(codec)
    array = engine_outputs(3, utility_output=UtilityOutput(7, None, UtilityResult(np.zeros(2))))
    assert encode_plain_outputs(array) is None
