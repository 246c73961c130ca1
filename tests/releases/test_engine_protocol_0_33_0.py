"""The engine side speaking vLLM 0.33.0's wire, checked with corewire's own pieces.

Runs in any environment (no vLLM needed): a raw front-end drives ``EngineCoreProc(
release="0.33.0")`` processes and reads their frames with ``NativeDecoder(release=
"0.33.0")``; the output conversion (``corewire.wire.outputs``) and corewire's own DP
coordinator under 0.33.0 are checked directly. vLLM 0.33.0's own client and coordinator
against the same engines: ``test_vllm_0_33_0_engine.py`` and
``test_vllm_0_33_0_engine_handshake.py`` (0.33.0 environment only).

Checks ``docs/protocol.md`` §11 and ``docs/vllm-0.33.0-notes.md`` §2.2-§2.3, §2.8, §5.1,
§5.3 and §6.3.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from client_support import request
from corewire.codec import Encoder, NativeDecoder
from corewire.coordinator import CoordinatorState, DPCoordinator
from corewire.dp_messages import DPState
from corewire.engine.ready_layouts import ReadyResponse0330
from corewire.engine.replay import run_replay_engine
from corewire.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsTensors,
    UtilityOutput,
)
from corewire.wire.layouts import types_for
from corewire.wire.outputs import StepOutputs, _splice, output_converter
from dp_support import FrontEndPeer, Sockets, coordinator_addresses
from engine_support import LIGHT_REFERENCE, FrontEnd

V33 = "0.33.0"
T33 = types_for(V33)

# ---------------------------------------------------------------- the output conversion


def test_0_25_1_outputs_go_out_as_built() -> None:
    """0.25.1's messages go out as the engine built them, only their stats completed in
    place (vLLM's Rust front-end needs every key: test_engine_stats_complete.py)."""
    for release in ("0.25.1", None):
        convert = output_converter(release)
        assert convert is not None
        message = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [1])])
        assert convert(message) is message
        assert message.outputs[0] == EngineCoreOutput("r", [1])


def test_0_33_0_conversion_moves_every_field_by_name() -> None:
    convert = output_converter(V33)
    assert convert is not None
    tensors = LogprobsTensors(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2))
    out = EngineCoreOutput(
        "r1",
        [5, 6],
        new_prompt_logprobs_tensors=tensors,
        finish_reason=FinishReason.STOP,
        stop_reason=6,
        kv_transfer_params={"k": 1},
        trace_headers={"t": "1"},
        prefill_stats={"num_prompt_tokens": 2},
        num_nans_in_logits=3,
    )
    message = EngineCoreOutputs(
        engine_index=1, outputs=[out], scheduler_stats={"num_running_reqs": 1}, timestamp=2.0
    )
    step = convert(StepOutputs(message, "v7"))
    assert type(step) is T33["EngineCoreOutputs"] and step.weight_version == "v7"
    got = step.outputs[0]
    assert type(got) is T33["EngineCoreOutput"]
    for name in EngineCoreOutput.__struct_fields__:
        if name not in ("new_prompt_logprobs_tensors", "prefill_stats"):
            assert getattr(got, name) == getattr(out, name), name
    assert got.ec_transfer_params is None and got.error is None
    assert len(got.new_prompt_logprobs_tensors) == 5
    # vLLM 0.33.0's PrefillStats: every key (its engines write them all), the engine's in place.
    assert got.prefill_stats == {
        "num_prompt_tokens": 2,
        "num_computed_tokens": 0,
        "num_cached_tokens": 0,
        "num_local_cached_tokens": 0,
        "num_external_cached_tokens": 0,
        "num_cache_creation_tokens": 0,
    }
    # vLLM 0.33.0's SchedulerStats: every key, in its order, the engine's values in place.
    stats = step.scheduler_stats
    assert len(stats) == 18 and list(stats)[:4] == [
        "num_running_reqs",
        "num_waiting_reqs",
        "num_skipped_waiting_reqs",
        "num_kv_fetch_reqs_by_stage",
    ]
    assert stats["num_running_reqs"] == 1 and stats["kv_cache_usage"] == 0.0
    # Not a step's message: no weight version. Already converted: passed through.
    plain = convert(EngineCoreOutputs(utility_output=UtilityOutput(3, None, None)))
    assert plain.weight_version is None
    assert convert(plain) is plain
    # What corewire's 0.33.0 decoder reads back, fields by name.
    frames = Encoder(release=V33).encode(step)
    decoded = NativeDecoder(release=V33).decode(frames)
    assert decoded.weight_version == "v7" and decoded.outputs[0].kv_transfer_params == {"k": 1}
    assert decoded.outputs[0].trace_headers == {"t": "1"}
    assert decoded.outputs[0].num_nans_in_logits == 3


def test_a_layout_that_is_not_an_insertion_is_refused() -> None:
    moved = msgspec.defstruct(
        "Moved",
        [("request_id", str), ("new_logprobs", Any, None), ("new_token_ids", list, [])],
        array_like=True,
    )
    with pytest.raises(AssertionError, match="not EngineCoreOutput with fields inserted"):
        _splice(EngineCoreOutput, moved)


# ---------------------------------------------------------------- an engine process


@pytest.fixture
def front(ipc_dir: Path) -> Iterator[FrontEnd]:
    fe = FrontEnd(ipc_dir)
    fe.decoder = NativeDecoder(release=V33)
    fe.encoder = Encoder(release=V33)
    try:
        yield fe
    finally:
        fe.close()


def _request_0_33_0(rid: str, prompt: list[int], **sampling: Any) -> Any:
    sp = T33["SamplingParams"](**{"temperature": 0.0, "max_tokens": 3, **sampling})
    return T33["EngineCoreRequest"](
        request_id=rid, prompt_token_ids=prompt, sampling_params=sp, session_id=f"s-{rid}"
    )


def test_an_engine_speaks_0_33_0_to_a_raw_front_end(front: FrontEnd) -> None:
    front.start_engine(engine_args=LIGHT_REFERENCE, release=V33)
    _identity, ready = front.wait_ready()
    fields = list(ReadyResponse0330.__struct_fields__)
    assert list(ready) == [*fields, "status", "engine_index", "pid"]
    assert (ready["vllm_version"], ready["data_parallel_rank"], ready["max_num_seqs"]) == (
        V33,
        0,
        256,
    )
    assert ready["max_num_batched_tokens"] == 2048 and ready["supports_lora"] is False
    # A 0.33.0 request (22 fields) and a 0.25.1 one: both read, both answered in 0.33.0.
    front.add(_request_0_33_0("new", [5, 6, 7]))
    front.send_frames(
        [
            b"\x00",
            *Encoder().encode(request("old", 3, prompt=[5, 6, 7], sampling={"temperature": 0.0})),
        ]
    )
    stamps: set[Any] = set()
    tokens: dict[str, list[int]] = {"new": [], "old": []}
    pending = {"new", "old"}
    while pending:
        msg = front.recv()
        stamps.add(msg.weight_version)
        for out in msg.outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                pending.discard(out.request_id)
    assert stamps == {"default"} and tokens["new"] == tokens["old"] and len(tokens["new"]) == 3
    # A refusal for the request's own fault: a validation error (its text in the error,
    # stop_reason nil, as vLLM writes it); a message not from a step: not stamped.
    front.add(_request_0_33_0("bad", [1, 99999]))
    refusal = front.recv()
    (bad,) = refusal.outputs
    assert refusal.weight_version is None and refusal.finished_requests == {"bad"}
    assert bad.finish_reason == FinishReason.ERROR and bad.stop_reason is None
    assert bad.error.code == "validation_error" and bad.error.retryable is False
    assert "outside the vocabulary" in bad.error.message
    # pause_generation refuses new requests until resumed.
    assert front.value("pause_generation", "abort", True) is None
    front.add(_request_0_33_0("paused", [5]))
    (paused,) = front.collect(["paused"])["paused"]
    assert paused.error.code == "engine_paused" and paused.error.retryable is True
    assert paused.stop_reason is None
    assert front.value("resume_scheduler") is None
    assert len(front.generate(_request_0_33_0("after", [5]))) == 3
    # "keep" refuses none: the request waits for the resume, then runs.
    assert front.value("pause_generation", "keep", False) is None
    front.add(_request_0_33_0("kept", [5]))
    assert front.value("resume_scheduler") is None
    (kept,) = {o.finish_reason for o in front.collect(["kept"])["kept"] if o.finish_reason}
    assert kept == FinishReason.LENGTH
    # The weight version is set and read by utilities, and stamped on later steps.
    assert front.value("set_weight_version", "w2") is None
    assert front.value("get_weight_version") == "w2"
    front.add(_request_0_33_0("w2", [5]))
    seen: set[Any] = set()
    while True:
        msg = front.recv()
        seen.add(msg.weight_version)
        if any(o.finish_reason is not None for o in msg.outputs):
            break
    assert seen == {"w2"}
    checksums = front.value("compute_weight_checksums")
    assert len(checksums) == 1 and all(k.startswith("dp0:pp0:pcp0:tp0:") for k in checksums[0])


def test_a_paused_engine_takes_the_next_input_of_an_open_session(front: FrontEnd) -> None:
    # vLLM 0.33.0 refuses only new work while generation is paused: a request the engine
    # already holds (an open streaming-input session) goes on, and finishes after resume.
    front.start_engine(engine="hook_engine:SessionEngine", release=V33)
    front.wait_ready()
    opening = _request_0_33_0("s", [5, 6])
    opening.resumable = True
    front.add(opening)
    assert front.value("pause_generation", "wait", False) is None
    front.add(_request_0_33_0("s", [7]))  # the session's last input
    front.add(_request_0_33_0("new", [5]))  # new work: refused while paused
    (refused,) = front.collect(["new"])["new"]
    assert refused.error.code == "engine_paused"
    assert front.value("resume_scheduler") is None
    outs = front.collect(["s"])["s"]
    assert all(o.error is None for o in outs) and outs[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outs) == 3


def test_a_0_34_0_engine_says_whether_it_is_ready_for_inference(ipc_dir: Path) -> None:
    # vLLM 0.34.0's Rust front-end (vllm-rs) calls is_inference_ready once its engines
    # are ready and gives up without an answer ("failed to connect to engine core").
    fe = FrontEnd(ipc_dir)
    fe.decoder = NativeDecoder(release="0.34.0")
    fe.encoder = Encoder(release="0.34.0")
    try:
        fe.start_engine(engine_args=LIGHT_REFERENCE, release="0.34.0")
        fe.wait_ready()
        assert fe.value("is_inference_ready") is True
        # Paused (refusing new requests, or keeping them waiting): not ready.
        for mode in ("abort", "keep"):
            assert fe.value("pause_generation", mode, False) is None
            assert fe.value("is_inference_ready") is False
            assert fe.value("resume_scheduler") is None
            assert fe.value("is_inference_ready") is True
    finally:
        fe.close()


def test_a_0_25_1_engine_has_none_of_0_33_0s_utilities(ipc_dir: Path) -> None:
    fe = FrontEnd(ipc_dir)
    try:
        fe.start_engine(engine_args=LIGHT_REFERENCE)
        _identity, ready = fe.wait_ready()
        assert "tensor_parallel_size" not in ready and ready["vllm_version"] == "0.25.1"
        for method in ("pause_generation", "get_weight_version"):
            reply = fe.call(method)
            assert reply.failure_message == (
                f"Call to {method} method failed: engine has no utility method {method!r}"
            )
        # The engine's own checksums, unkeyed (0.25.1's front-end never asks for them).
        (weights,) = fe.value("compute_weight_checksums")
        assert "embed.weight" in weights
    finally:
        fe.close()


# ---------------------------------------------------------------- corewire's coordinator


def test_coordinator_state_counts_triples_under_0_33_0() -> None:
    state = CoordinatorState(2, release=V33)
    assert state.snapshot().counts == [[0, 0, 0.0], [0, 0, 0.0]]
    state.on_first_request(0, 0)
    state.on_engine_report(0, {"num_waiting_reqs": 1, "num_running_reqs": 2}, None, None)
    state.on_engine_report(1, {"num_running_reqs": 1, "kv_cache_usage": 0.25}, None, None)
    assert state.snapshot().counts == [[1, 2, 0.0], [0, 1, 0.25]]
    assert state.engines_running
    state.on_engine_report(0, {}, None, None)
    state.on_engine_report(1, {"kv_cache_usage": 0.0}, None, None)
    assert not state.engines_running  # the group went idle: the wave ended
    state.on_scale(3)
    assert state.snapshot().counts[2] == [0, 0, 0.0]
    # Front-ends decode either shape.
    assert DPState.decode(state.snapshot().encode()).counts == [[0, 0, 0.0]] * 3
    assert CoordinatorState(1).snapshot().counts == [[0, 0]]


def test_a_0_33_0_dp_engine_feeds_corewires_coordinator_triples(ipc_dir: Path) -> None:
    addresses = coordinator_addresses(ipc_dir)
    coordinator = DPCoordinator(1, addresses, release=V33)
    sockets = Sockets()
    fe = FrontEnd(ipc_dir, "dp")
    fe.decoder = NativeDecoder(release=V33)
    try:
        publications = FrontEndPeer(sockets, addresses)
        assert publications.recv() == [[[0, 0, 0.0]], 0, False]
        fe.start_engine(
            engine_args={**LIGHT_REFERENCE, "step_delay": 0.02},
            data_parallel_size=1,
            coordinator_addresses=list(addresses.for_engine()),
            include_finished_set=True,
            release=V33,
        )
        fe.wait_ready()
        fe.add(request("r", 40, prompt=[5, 6], sampling={"temperature": 0.0, "ignore_eos": True}))
        busy = publications.recv_until(lambda m: m[0] != [[0, 0, 0.0]], timeout=30)
        assert busy[0][0][:2] in ([0, 1], [1, 0]) and busy[0][0][2] == 0.0
        fe.collect(["r"])
        assert publications.recv_until(lambda m: m[0] == [[0, 0, 0.0]], timeout=30)
    finally:
        fe.close()
        sockets.close()
        coordinator.shutdown()


# ---------------------------------------------------------------- the replay engine


def test_the_replay_engine_speaks_0_33_0(front: FrontEnd) -> None:
    proc = multiprocessing.get_context("spawn").Process(
        target=run_replay_engine,
        kwargs={
            "engine_index": 0,
            "input_address": front.input_address,
            "output_address": front.output_address,
            "parent_pid": os.getpid(),
            "release": V33,
        },
        daemon=True,
    )
    proc.start()
    front.procs.append(proc)
    _identity, ready = front.wait_ready()
    assert list(ready)[: len(ReadyResponse0330.__struct_fields__)] == list(
        ReadyResponse0330.__struct_fields__
    )
    front.add(_request_0_33_0("r", [1, 2], max_tokens=3))
    stamps = []
    tokens = []
    while len(tokens) < 3:
        msg = front.recv()
        stamps.append(msg.weight_version)
        tokens += [t for o in msg.outputs for t in o.new_token_ids]
    assert tokens == [1, 2, 3] and stamps == ["default"] * len(stamps)
    assert front.value("echo", 5) == 5
    size = front.value("replay", 16, 2)
    frames = [front.recv_raw() for _ in range(2)]
    assert [len(f[0].buffer) for f in frames] == [size, size]
    replayed = front.decoder.decode(frames[0])
    assert len(replayed.outputs) == 16 and replayed.weight_version == "default"
