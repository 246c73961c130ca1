"""Engine processes driven over real ZeroMQ sockets by a raw pyzmq front-end.

Everything here runs the engine as a real child process (``run_engine_core`` under the
``spawn`` context, or the ``corewire engine`` command) and talks to it with hand-built
frames, the way a vLLM 0.25.1 front-end would. One reference engine is shared by the
tests that leave it healthy; the fault tests start their own.

Checks ``docs/protocol.md`` §2 (identity, client index), §3.1 (the ready response), §4
(ADD short and long, sampling, pooling, ABORT, UTILITY, START_DP_WAVE without DP), §5
(output layout, utility replies and failure text), §7 (ENGINE_CORE_DEAD and stopping),
§9.1-§9.3 (bad frames fail alone, errors the engine reports).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from client_support import request
from corewire.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    PoolingParams,
)
from engine_support import (
    LIGHT_REFERENCE,
    FrontEnd,
    start_engine_then_wait,
)
from leak_support import no_leaks, pid_gone, wait_pid_gone

ENGINE_INDEX = 3
# The module's shared engine: it outlives single tests (conftest's leak check).
LEAK_ALLOWED_PIDS: set[int] = set()


@pytest.fixture(scope="module")
def private_dir() -> Iterator[Path]:
    """A private (0700) directory for the module's ipc:// endpoints."""
    with tempfile.TemporaryDirectory(prefix="corewire-engine-test-") as path:
        os.chmod(path, 0o700)
        yield Path(path)


@pytest.fixture(scope="module")
def ref(private_dir: Path) -> Iterator[FrontEnd]:
    """A front-end with one reference engine (index 3, events on) shared by the module;
    nothing of it outlives the module."""
    with no_leaks(fds=False):
        fe = FrontEnd(private_dir, "shared")
        proc = fe.start_engine(None, {**LIGHT_REFERENCE, "record_events": True}, ENGINE_INDEX)
        LEAK_ALLOWED_PIDS.add(proc.pid)
        fe.ready = fe.wait_ready()  # type: ignore[attr-defined]
        yield fe
        assert proc.is_alive(), "the shared engine died during the module"
        proc.terminate()  # SIGTERM: must be a clean exit
        proc.join(10)
        exitcode = proc.exitcode
        LEAK_ALLOWED_PIDS.discard(proc.pid)
        fe.close()
        assert exitcode == 0


# ---------------------------------------------------------------------- handshake & layout


def test_ready_message_identity_and_map(ref: FrontEnd) -> None:
    identity, ready = ref.ready  # type: ignore[attr-defined]
    # Two independent spellings of the identity (docs/protocol.md §2).
    assert identity == ENGINE_INDEX.to_bytes(2, "little") == b"\x03\x00"
    # vLLM 0.25.1's EngineCoreReadyResponse, every key, with the engine's own values
    # (the reference engine has no KV cache), plus corewire's own three keys.
    assert ready == {
        "max_model_len": 2048,
        "num_gpu_blocks": 0,
        "block_size": 16,
        "dp_stats_address": None,
        "dtype": "float32",
        "vllm_version": "0.25.1",
        "world_size": 1,
        "data_parallel_size": 1,
        "kv_cache_size_tokens": None,
        "kv_cache_max_concurrency": None,
        "status": "READY",
        "engine_index": ENGINE_INDEX,
        "pid": ref.procs[0].pid,
    }


def test_add_short_vllm_layout_and_output_golden_layout(ref: FrontEnd) -> None:
    # An ADD exactly as vLLM lays it out, cut after data_parallel_rank (index 8), with
    # sampling params as a map that omits defaults and carries keys corewire ignores.
    payload = msgspec.msgpack.encode(
        [
            "golden-1",
            [5, 6, 7],
            None,
            {"max_tokens": 3, "temperature": 0.0, "output_kind": 2, "future_key": [1, 2]},
            None,
            1700000000.5,
            None,
            None,
            None,
        ]
    )
    ref.send_frames([EngineCoreRequestType.ADD.value, payload])
    messages = []
    while len(messages) < 3:
        frames = ref.recv_raw()
        assert len(frames) == 1  # nothing big enough for an aux frame
        messages.append(msgspec.msgpack.decode(frames[0].bytes))
    tokens = []
    for n, msg in enumerate(messages):
        # EngineCoreOutputs: every one of the 8 fields, positionally.
        assert len(msg) == 8
        engine_index, outputs, stats, timestamp, utility, finished, wave_c, start_w = msg
        assert engine_index == ENGINE_INDEX
        assert isinstance(timestamp, float) and abs(timestamp - time.monotonic()) < 60
        assert utility is None and finished is None and wave_c is None and start_w is None
        assert stats["num_waiting_reqs"] == 0
        assert stats["num_running_reqs"] == (0 if n == 2 else 1)
        assert len(outputs) == 1
        out = outputs[0]
        # EngineCoreOutput: all 13 fields.
        assert len(out) == 13
        assert out[0] == "golden-1"
        assert len(out[1]) == 1 and 0 <= out[1][0] < 4096
        assert out[2:5] == [None, None, None]
        assert out[5] == (1 if n == 2 else None)  # FinishReason.LENGTH as an int
        assert out[6] is None
        if n == 0:
            # Events (record_events=True) are maps {"type", "timestamp"}: QUEUED, SCHEDULED.
            assert [e["type"] for e in out[7]] == [1, 2]
            assert all(set(e) == {"type", "timestamp"} for e in out[7])
            assert out[7][0]["timestamp"] <= out[7][1]["timestamp"]
        else:
            assert out[7] is None
        assert out[8:10] == [None, None]
        # prefill_stats (vLLM's PrefillStats as a map) with the first output only.
        prefill = {"num_prompt_tokens": 3, "num_computed_tokens": 3, "num_cached_tokens": 0}
        prefill |= {"num_local_cached_tokens": 0, "num_external_cached_tokens": 0}
        assert out[10] == (prefill if n == 0 else None)
        assert out[11] is None
        assert out[12] == 0
        tokens.append(out[1][0])
    # The short array and the unknown sampling keys did not change the request.
    assert tokens == ref.generate(request("golden-2", 3, prompt=[5, 6, 7]))


def test_add_full_layout_with_unknown_trailing_field(ref: FrontEnd) -> None:
    fields = [
        "long-1", [9, 9], None, {"max_tokens": 2, "temperature": 0.0}, None, 0.0, None,
        "salt", None, None, None, 0, 0, 0, {"traceparent": "x"}, False, "ext-1", None,
        None, False, "a field from a newer version",
    ]  # fmt: skip
    assert len(fields) == 21
    ref.send_frames([EngineCoreRequestType.ADD.value, msgspec.msgpack.encode(fields)])
    outs = ref.collect(["long-1"])["long-1"]
    assert [o.finish_reason for o in outs] == [None, FinishReason.LENGTH]


def test_utility_round_trip_values_and_golden_layout(ref: FrontEnd) -> None:
    values = [None, True, -1, 2**64 - 1, 1.5, "ünïcode", b"\x00\xff", [1, [2, {"a": 3}]], {}]
    for value in values:
        assert ref.value("echo", value) == value
    # vLLM draws call ids from uuid1().int >> 64: above 2**63 is normal.
    call_id = 2**64 - 2
    ref.send(EngineCoreRequestType.UTILITY.value, [0, call_id, "echo", [{"k": [None, 2]}]])
    frames = ref.recv_raw()
    assert len(frames) == 1
    msg = msgspec.msgpack.decode(frames[0].bytes)
    assert msg[0] == ENGINE_INDEX and msg[1] == [] and msg[2] is None
    assert isinstance(msg[3], float)
    assert msg[4] == [call_id, None, [None, {"k": [None, 2]}]]
    assert msg[5:] == [None, None, None]


def test_failing_utility_calls_exact_text_and_engine_lives(ref: FrontEnd) -> None:
    def failure(method: str, *args: Any) -> str:
        reply = ref.call(method, *args)
        assert reply.result is None
        assert reply.failure_message is not None
        return reply.failure_message

    # The shipped engine has no fault hooks (they live in tests/hook_engine.py).
    assert failure("raise_error", "boom") == (
        "Call to raise_error method failed: engine has no utility method 'raise_error'"
    )
    assert (
        failure("no_such_method")
        == "Call to no_such_method method failed: engine has no utility method 'no_such_method'"
    )
    assert failure("_model") == "Call to _model method failed: '_model' is not a utility method"
    assert failure("step") == "Call to step method failed: 'step' is not a utility method"
    assert failure("max_batch") == "Call to max_batch method failed: 'max_batch' is not callable"
    text = failure("echo")  # missing argument
    assert text.startswith("Call to echo method failed: ") and "missing" in text
    text = failure("sleep", 7)
    assert text == "Call to sleep method failed: sleep level must be 0, 1 or 2, got 7"
    assert ref.value("echo", "still alive") == "still alive"
    assert ref.procs[0].is_alive()


def test_utility_returning_a_future_does_not_block_the_engine(ref: FrontEnd) -> None:
    ref.send(EngineCoreRequestType.UTILITY.value, [0, 501, "delayed_echo", ["slow", 0.5]])
    started = time.monotonic()
    # The engine keeps serving while the future is pending: a fast call and a whole
    # generation finish before the slow reply.
    assert ref.value("echo", "fast") == "fast"
    ref.add(request("during-future", 4, prompt=[1, 2]))
    outs = ref.collect(["during-future"])["during-future"]
    assert outs[-1].finish_reason == FinishReason.LENGTH
    reply = ref.wait_utility(501)
    assert time.monotonic() - started >= 0.45
    assert reply.failure_message is None and reply.result.result == "slow"


# ---------------------------------------------------------------------- generation


def test_greedy_is_deterministic(ref: FrontEnd) -> None:
    prompt = [11, 22, 33, 44]
    first = ref.generate(request("det-1", 12, prompt=prompt))
    second = ref.generate(request("det-2", 12, prompt=prompt))
    assert len(first) == 12 and first == second
    # Two copies in one batch agree with each other.
    ref.add(request("det-3", 12, prompt=prompt))
    ref.add(request("det-4", 12, prompt=prompt))
    got = ref.collect(["det-3", "det-4"])
    batch = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in got.items()}
    assert batch["det-3"] == batch["det-4"]
    assert len(set(first)) > 1  # not a degenerate constant stream


def test_sampling_parameters_over_the_wire(ref: FrontEnd) -> None:
    prompt = [100, 200, 300]

    def run(rid: str, max_tokens: int, **sampling: Any) -> list[int]:
        return ref.generate(request(rid, max_tokens, prompt=prompt, sampling=sampling))

    g = run("sp-greedy", 8)
    # top_k=1 and a vanishing top_p both leave only the argmax, whatever the temperature.
    assert run("sp-topk1", 8, temperature=1.0, top_k=1) == g
    assert run("sp-topp", 8, temperature=2.0, top_p=1e-6) == g
    # Seeds: the same seed repeats, different seeds differ.
    a = run("sp-seed-a", 16, temperature=1.0, seed=1234)
    b = run("sp-seed-b", 16, temperature=1.0, seed=1234)
    c = run("sp-seed-c", 16, temperature=1.0, seed=4321)
    assert a == b and a != c
    # stop_token_ids: stops at the first occurrence, token included, stop_reason = token.
    j = next(i for i in range(1, 8) if g[i] not in g[:i])
    ref.add(request("sp-stop", 8, prompt=prompt, sampling={"stop_token_ids": [g[j]]}))
    outs = ref.collect(["sp-stop"])["sp-stop"]
    assert [t for o in outs for t in o.new_token_ids] == g[: j + 1]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == g[j]
    # min_tokens masks the stop token until enough tokens were generated.
    got = run("sp-min", 8, stop_token_ids=[g[0]], min_tokens=3)
    assert len(got) >= 3 and g[0] not in got[:3]


def test_logprobs_shapes_and_dtypes(ref: FrontEnd) -> None:
    ref.add(request("lp-5", 4, prompt=[7, 8, 9], sampling={"logprobs": 5}))
    ref.add(request("lp-0", 4, prompt=[7, 8, 9], sampling={"logprobs": 0}))
    got = ref.collect(["lp-5", "lp-0"])
    for rid, k in (("lp-5", 5), ("lp-0", 0)):
        for out in got[rid]:
            lp = out.new_logprobs
            assert lp is not None and lp.cu_num_generated_tokens is None
            assert lp.logprob_token_ids.dtype == np.int32
            assert lp.logprobs.dtype == np.float32
            assert lp.sampled_token_ranks.dtype == np.int32
            assert lp.logprob_token_ids.shape == lp.logprobs.shape == (1, k + 1)
            assert lp.sampled_token_ranks.shape == (1,)
            # Column 0 is the sampled token; greedy means it is also the top-1 (rank 1).
            assert lp.logprob_token_ids[0, 0] == out.new_token_ids[0]
            assert lp.sampled_token_ranks[0] == 1
            assert np.all(lp.logprobs <= 0)
            if k:
                assert lp.logprob_token_ids[0, 1] == out.new_token_ids[0]
                assert lp.logprobs[0, 0] == lp.logprobs[0, 1]
                assert np.all(np.diff(lp.logprobs[0, 1:]) <= 0)
                assert len(set(lp.logprob_token_ids[0, 1:].tolist())) == k
    # Without logprobs, none are sent.
    ref.add(request("lp-none", 1, prompt=[7, 8, 9]))
    assert ref.collect(["lp-none"])["lp-none"][0].new_logprobs is None


def test_pooling_request_gets_one_embedding(ref: FrontEnd) -> None:
    ref.add(
        EngineCoreRequest(
            request_id="emb", prompt_token_ids=[1, 2, 3, 4, 5], pooling_params=PoolingParams()
        )
    )
    frames = ref.recv_raw()
    # 128 float32 = 512 bytes: above the inline threshold, so it travels as aux frame 1.
    assert len(frames) == 2 and len(frames[1].bytes) == 512
    raw = msgspec.msgpack.decode(frames[0].bytes)
    out_raw = raw[1][0]
    assert out_raw[4] == ["float32", [128], 1]
    assert out_raw[1] == [] and out_raw[5] == 0  # no tokens, FinishReason.STOP
    out = ref.decoder.decode(frames).outputs[0]
    emb = out.pooling_output
    assert isinstance(emb, torch.Tensor) and emb.dtype == torch.float32
    assert math.isclose(float(emb.norm()), 1.0, rel_tol=1e-5)
    # dimensions truncates, normalize=False keeps the raw mean.
    ref.add(
        EngineCoreRequest(request_id="emb16", prompt_token_ids=[1, 2, 3, 4, 5],
                          pooling_params=PoolingParams(dimensions=16, normalize=False))
    )  # fmt: skip
    out16 = ref.collect(["emb16"])["emb16"]
    assert len(out16) == 1 and out16[0].finish_reason == FinishReason.STOP
    raw16 = out16[0].pooling_output
    assert raw16.shape == (16,)
    assert torch.allclose(torch.nn.functional.normalize(raw16, dim=0), emb[:16] / emb[:16].norm())


def test_abort_stops_a_running_request(ref: FrontEnd) -> None:
    ref.add(request("long", 2000, prompt=[1]))
    first = ref.recv()
    assert isinstance(first, EngineCoreOutputs) and first.outputs[0].request_id == "long"
    ref.abort(["long", "never-existed"])
    # Outputs already in flight may still arrive, then nothing: no finish is sent for an
    # abort the front-end asked for.
    received = 1
    while not ref.nothing_for(0.3):
        msg = ref.recv()
        assert not isinstance(msg, bytes)
        for out in msg.outputs:
            assert out.request_id == "long" and out.finish_reason is None
            received += 1
    assert received < 2000
    # The engine holds nothing any more: a new request runs alone.
    ref.add(request("after-abort", 2, prompt=[1]))
    msg = ref.recv()
    assert [o.request_id for o in msg.outputs] == ["after-abort"]
    assert msg.scheduler_stats["num_running_reqs"] == 1
    assert msg.scheduler_stats["num_waiting_reqs"] == 0
    assert ref.collect(["after-abort"])["after-abort"][-1].finish_reason == FinishReason.LENGTH


def test_bad_requests_finish_with_error_and_engine_lives(ref: FrontEnd) -> None:
    ref.add(EngineCoreRequest(request_id="oov", prompt_token_ids=[1, 99999]))
    ref.add(EngineCoreRequest(request_id="no-prompt"))
    ref.add(request("bad-topp", 4, prompt=[1], sampling={"temperature": 1.0, "top_p": 0.0}))
    got = ref.collect(["oov", "no-prompt", "bad-topp"])
    for rid in ("oov", "no-prompt", "bad-topp"):
        (out,) = got[rid]
        assert out.finish_reason == FinishReason.ERROR and out.new_token_ids == []
    assert ref.generate(request("fine", 2, prompt=[1])) == ref.generate(
        request("fine2", 2, prompt=[1])
    )


def test_malformed_frames_never_kill_the_engine(ref: FrontEnd) -> None:
    encode = msgspec.msgpack.encode
    ref.send_frames([EngineCoreRequestType.ADD.value, b"\xc1"])  # 0xc1 is never valid msgpack
    ref.send_frames([EngineCoreRequestType.ABORT.value, b"\x92"])  # truncated array
    ref.send_frames([EngineCoreRequestType.ABORT.value, encode([1, 2])])  # ids must be strings
    ref.send_frames([b"\x09", b"x"])  # unknown request type
    ref.send_frames([EngineCoreRequestType.ADD.value])  # no payload frame
    # START_DP_WAVE is ignored without DP.
    ref.send_frames([EngineCoreRequestType.START_DP_WAVE.value, encode([1, 0])])
    ref.send_frames([EngineCoreRequestType.START_DP_WAVE.value, encode(["x"])])
    # Not msgpack: no call id to answer.
    ref.send_frames([EngineCoreRequestType.UTILITY.value, b"\xff\xff"])
    # Trailing bytes.
    ref.send_frames([EngineCoreRequestType.UTILITY.value, encode([0, 7, "echo", [1]]) + b"\x00"])
    # A frame that does not decode still names its caller: it gets a failure reply.
    assert ref.wait_utility(7).failure_message.startswith("Call to echo method failed: ")
    # A readable call id gets a failure reply instead of silence.
    ref.send_frames([EngineCoreRequestType.UTILITY.value, encode([0, 99, "echo"])])
    reply = ref.wait_utility(99)
    assert reply.failure_message == (
        "Call to echo method failed: malformed utility request: "
        "expected [client_index, call_id, method, args]"
    )
    ref.send_frames([EngineCoreRequestType.UTILITY.value, encode([0, 100, 5, []])])
    assert ref.wait_utility(100).failure_message.startswith("Call to <unknown> method failed")
    # A broken ADD whose request id is readable finishes that request with ERROR: here
    # a prompt_embeds tensor pointing at an aux frame that does not exist.
    bad = encode(["bad-add", [1], None, None, None, 0.0, None, None, None, ["float32", [4], 5]])
    ref.send_frames([EngineCoreRequestType.ADD.value, bad])
    ref.send_frames([EngineCoreRequestType.ADD.value, encode(["bad-add-2", "not a token list"])])
    got = ref.collect(["bad-add", "bad-add-2"])
    assert [o.finish_reason for o in got["bad-add"]] == [FinishReason.ERROR]
    assert [o.finish_reason for o in got["bad-add-2"]] == [FinishReason.ERROR]
    # Still serving, nothing stray was sent, and the process is the same one.
    assert ref.value("echo", "ok") == "ok"
    assert len(ref.generate(request("after-garbage", 3, prompt=[3]))) == 3
    assert not ref.backlog
    assert ref.procs[0].is_alive()


def test_reference_utilities(ref: FrontEnd, tmp_path: Path) -> None:
    assert ref.value("get_supported_tasks") == ["generate", "embed"]
    assert ref.value("collective_rpc", "echo", None, [7]) == [7]
    assert ref.value("collective_rpc", "device") == ["cpu"]
    assert ref.value("collective_rpc", "pid") == [ref.procs[0].pid]
    fail = ref.call("collective_rpc", "nope").failure_message
    assert fail == "Call to collective_rpc method failed: worker has no method 'nope'"
    assert ref.value("reset_prefix_cache") is True

    baseline = ref.generate(request("util-base", 4, prompt=[4, 5]))
    # Paused: requests queue and make no progress until resumed.
    assert ref.value("pause_scheduler") is None
    assert ref.value("is_scheduler_paused") is True
    ref.add(request("util-paused", 4, prompt=[4, 5]))
    assert ref.nothing_for(0.3)
    ref.value("resume_scheduler")
    assert ref.value("is_scheduler_paused") is False
    assert [t for o in ref.collect(["util-paused"])["util-paused"] for t in o.new_token_ids] == (
        baseline
    )
    # pause_scheduler("wait") answers only once the request in flight finished: its
    # reply waits on a future the engine resolves from its own loop.
    ref.add(request("util-drain", 30, prompt=[4, 5]))
    ref.send(EngineCoreRequestType.UTILITY.value, [0, 777, "pause_scheduler", ["wait"]])
    finished_before_reply = False
    while True:
        msg = ref._recv_socket(30, 0)
        assert isinstance(msg, EngineCoreOutputs)
        if msg.utility_output is not None:
            assert msg.utility_output.call_id == 777
            assert msg.utility_output.failure_message is None
            break
        finished_before_reply |= any(o.finish_reason is not None for o in msg.outputs)
    assert finished_before_reply
    ref.value("resume_scheduler")
    # Asleep (level 2 discards the weights): nothing runs until fully woken, and the
    # rebuilt weights give the same tokens.
    ref.value("sleep", 2)
    assert ref.value("is_sleeping") is True
    ref.add(request("util-asleep", 4, prompt=[4, 5]))
    assert ref.nothing_for(0.3)
    ref.value("wake_up", ["kv_cache"])
    assert ref.value("is_sleeping") is True
    ref.value("wake_up")
    assert ref.value("is_sleeping") is False
    assert [t for o in ref.collect(["util-asleep"])["util-asleep"] for t in o.new_token_ids] == (
        baseline
    )
    # A real torch profiler trace, named by vLLM's profile_prefix (never a path).
    assert ref.value("profile", True, "util-trace") is None
    ref.generate(request("util-profiled", 4, prompt=[4, 5]))
    trace = Path(ref.value("profile", False))
    assert trace.name.startswith("util-trace-") and trace.suffix == ".json"
    events = json.loads(trace.read_text())["traceEvents"]
    shutil.rmtree(trace.parent)
    assert any("linear" in str(e.get("name", "")).lower() for e in events)
    again = ref.call("profile", False).failure_message
    assert again == "Call to profile method failed: the profiler is not running"


# ---------------------------------------------------------------------- fault tests


def test_exception_in_step_sends_engine_core_dead_once_and_exits(tmp_path: Path) -> None:
    fe = FrontEnd(tmp_path, "dead")
    try:
        proc = fe.start_engine("engine_support:FailingStepEngine")
        fe.wait_ready()
        assert fe.value("echo", 1) == 1
        fe.add(EngineCoreRequest(request_id="doomed", prompt_token_ids=[1]))
        assert fe.recv() == ENGINE_CORE_DEAD
        proc.join(20)
        assert proc.exitcode == 1
        assert fe.nothing_for(0.3)  # exactly once
    finally:
        fe.close()


def test_output_that_cannot_be_encoded_is_fatal_too(tmp_path: Path) -> None:
    fe = FrontEnd(tmp_path, "unencodable")
    try:
        proc = fe.start_engine("engine_support:UnencodableOutputEngine")
        fe.wait_ready()
        fe.add(EngineCoreRequest(request_id="x", prompt_token_ids=[1]))
        assert fe.recv() == ENGINE_CORE_DEAD
        proc.join(20)
        assert proc.exitcode == 1
        assert fe.nothing_for(0.3)
    finally:
        fe.close()


def test_engine_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    fe = FrontEnd(tmp_path, "orphan")
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=False)
    middle = ctx.Process(
        target=start_engine_then_wait,
        args=(fe.input_address, fe.output_address, child_end),
        name="corewire-test-intermediate",
    )
    middle.start()
    engine_pid = None
    try:
        assert parent_end.poll(60)
        engine_pid = parent_end.recv()
        fe.wait_ready()
        assert fe.value("echo", "alive") == "alive"
        os.kill(middle.pid, signal.SIGKILL)
        middle.join(10)
        assert wait_pid_gone(engine_pid, 5.0), "engine outlived its parent"
    finally:
        if middle.is_alive():
            middle.kill()
            middle.join(5)
        middle.close()
        if engine_pid is not None and not pid_gone(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)
        parent_end.close()
        child_end.close()
        fe.close()


def test_sigterm_stops_cleanly_and_outputs_follow_client_index(tmp_path: Path) -> None:
    fe = FrontEnd(tmp_path, "multi", num_outputs=2)
    try:
        proc = fe.start_engine(None, LIGHT_REFERENCE)
        fe.wait_ready()
        r0 = request("c0", 2, prompt=[1])
        r1 = request("c1", 3, prompt=[1])
        r1.client_index = 1
        fe.add(r0)
        fe.add(r1)
        assert [len(o) for o in fe.collect(["c0"], client=0).values()] == [2]
        assert [len(o) for o in fe.collect(["c1"], client=1).values()] == [3]
        # A refused request's ERROR goes to the client that sent it too.
        bad = request("c1-bad", 2, prompt=[1, 99999])
        bad.client_index = 1
        fe.add(bad)
        assert [o.finish_reason for o in fe.collect(["c1-bad"], client=1)["c1-bad"]] == [
            FinishReason.ERROR
        ]
        # Prompts over max_model_len: refused from the frame's header when the client
        # index is within reach, else after a full decode; either way to client 1.
        for rid, length in (("c1-long", 3000), ("c1-very-long", 60_000)):
            long = request(rid, 2, prompt=[1] * length)
            long.client_index = 1
            fe.add(long)
            (out,) = fe.collect([rid], client=1)[rid]
            assert out.finish_reason == FinishReason.ERROR
            assert out.stop_reason == f"prompt of {length} tokens exceeds max_model_len 2048"
        assert fe.nothing_for(0.1, client=0)
        # A utility reply goes to the client that asked.
        fe.send(EngineCoreRequestType.UTILITY.value, [1, 42, "echo", ["to client 1"]])
        msg = fe.recv(client=1)
        assert msg.utility_output.call_id == 42
        assert fe.nothing_for(0.1, client=0)
        # SIGTERM while busy: a clean stop, status 0, and no ENGINE_CORE_DEAD.
        fe.add(request("busy", 2000, prompt=[1]))
        fe.recv()
        proc.terminate()
        proc.join(10)
        assert proc.exitcode == 0
        for client in (0, 1):
            while not fe.nothing_for(0.1, client):
                assert fe.recv(client=client) != ENGINE_CORE_DEAD
    finally:
        fe.close()


@pytest.mark.parametrize("tensor_elems", [1 << 18, 1024], ids=["big-aux", "small-aux"])
def test_slow_reader_gets_every_large_frame_intact(tmp_path: Path, tensor_elems: int) -> None:
    # The receiver holds at most one message, so ZeroMQ on the engine side keeps the
    # others (and the engine's encode buffers) while the engine keeps producing. With a
    # small aux frame (below ZeroMQ's copy threshold, so copied), the last frame's tracker
    # says nothing about the large payload before it.
    fe = FrontEnd(tmp_path, "slow", rcvhwm=1)
    count = 32
    try:
        fe.start_engine(
            "engine_support:BigPayloadEngine", {"count": count, "tensor_elems": tensor_elems}
        )
        fe.wait_ready()
        fe.add(EngineCoreRequest(request_id="big", prompt_token_ids=[1]))
        time.sleep(0.5)  # let the engine run ahead of the reader
        for i in range(count):
            frames = fe.recv_raw()
            assert len(frames[0].bytes) > 65536  # sent zero-copy from a reused buffer
            out = fe.decoder.decode(frames).outputs[0]
            base = (i + 1) * 1_000_000
            assert out.new_token_ids == list(range(base, base + 20_000)), f"message {i}"
            tensor = out.pooling_output
            assert tensor.shape == (tensor_elems,)
            assert bool((tensor == i).all()), f"tensor of message {i}"
            assert out.finish_reason == (FinishReason.LENGTH if i == count - 1 else None)
            time.sleep(0.01)
        # An unsendable utility result is a failure reply, not a dead engine.
        text = fe.call("unsendable").failure_message
        assert text == (
            "Call to unsendable method failed: result of type object cannot be sent: "
            "corewire cannot encode objects of type object"
        )
        # A future that fails from another thread is a failure reply too.
        text = fe.call("failing_future", "no luck").failure_message
        assert text == "Call to failing_future method failed: no luck"
        assert fe.value("echo", 5) == 5
    finally:
        fe.close()


def test_engine_that_fails_to_build_exits_without_ready(tmp_path: Path) -> None:
    fe = FrontEnd(tmp_path, "broken")
    try:
        proc = fe.start_engine("engine_support:NoSuchEngine")
        proc.join(60)
        assert proc.exitcode == 1
        assert not fe.router.poll(0)
    finally:
        fe.close()


def test_cli_external_engine_mode(tmp_path: Path) -> None:
    fe = FrontEnd(tmp_path, "cli")
    cmd = [
        sys.executable, "-m", "corewire.cli", "engine",
        "--input-address", fe.input_address, "--output-address", fe.output_address,
        "--engine-index", "1", "--engine", "reference",
        "--engine-args", json.dumps(LIGHT_REFERENCE),
    ]  # fmt: skip
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        identity, ready = fe.wait_ready()
        # The identity spelled out on purpose: index 1, two bytes little-endian (protocol §2).
        assert identity == b"\x01\x00" and ready["pid"] == child.pid
        assert fe.value("echo", "external") == "external"
        assert len(fe.generate(request("cli-1", 5, prompt=[1, 2]))) == 5
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=20)
        assert child.returncode == 0, stderr.decode()
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
        fe.close()


def test_cli_rejects_bad_engine_args() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "corewire.cli", "engine", "--input-address", "ipc://x",
         "--output-address", "ipc://y", "--engine-args", "[1, 2]"],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert b"--engine-args must be a JSON object" in result.stderr
