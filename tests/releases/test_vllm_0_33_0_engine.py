"""vLLM 0.33.0's own ``AsyncMPClient`` drives ``corewire engine --release 0.33.0``.

The 0.33.0 counterpart of ``test_vllm_engine_client.py``: vLLM 0.33.0's real client class
(built with ``client_addresses``, as its API server builds it for engines it does not
launch) on real sockets, the ``corewire engine`` command running the reference engine in
0.33.0's wire. Expected tokens and logprobs come from the same reference engine run in
this process. A second part puts a raw front-end in place of vLLM's client and checks
that every frame the engine writes is byte for byte what vLLM 0.33.0's own encoder
writes for the same objects.

Runs only where vLLM 0.33.0 is installed (skipped under 0.25.1; with
``COREWIRE_REQUIRE_VLLM`` set, a missing or other vLLM fails instead).

Checks ``docs/protocol.md`` §11 and ``docs/vllm-0.33.0-notes.md`` §2.2-§2.3 (outputs,
``weight_version``), §2.8 (``RequestError``) and §5.1 (the ready response) against
vLLM 0.33.0's own client.
"""

from __future__ import annotations

import asyncio
import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_0_33_0_gate import RELEASE, as_the_client_sends, require_vllm_0_33_0

vllm = require_vllm_0_33_0()

import msgspec  # noqa: E402
import torch  # noqa: E402
from vllm.v1.engine import EngineCoreOutputs, EngineCoreReadyResponse, FinishReason  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from corewire import releases  # noqa: E402
from corewire.engine.reference import ReferenceEngine  # noqa: E402
from corewire.protocol import EngineCoreRequestType  # noqa: E402
from engine_support import LIGHT_REFERENCE, FrontEnd  # noqa: E402
from vllm_client_support import (  # noqa: E402
    SEEDED_PROMPT,
    SEEDED_SAMPLING,
    Stack,
    abort_mid_request,
    assert_fatal_error_reaches_client_as_engine_dead,
    assert_greedy_generation_matches_reference,
    assert_prompt_logprobs_match_reference,
    assert_seeded_sampling_matches_reference,
    client_stack,
    collect,
    collect_after,
    collect_messages,
    generate,
    tokens,
)
from vllm_support import ENGINE_ARGS, offline_environment, vllm_request  # noqa: E402

offline_environment()

# The module's shared engine: it outlives single tests (conftest's leak check).
LEAK_ALLOWED_PIDS: set[int] = set()
PROTOCOL = RELEASE
#: Whether the release's front-end has 0.33.0's ``pause_generation`` and its engines
#: refuse requests with a ``RequestError`` (0.33.0 on; 0.32.0 has neither).
PAUSE_GENERATION = releases.get(RELEASE).generation_pause_utilities
REQUEST_ERRORS = releases.get(RELEASE).request_errors
#: Whether step messages carry the engine's weight version (0.32.0 on; from 0.27.0 the
#: front-end sets and reads it by utility calls only).
WEIGHT_VERSIONS = releases.get(RELEASE).weight_versions


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with client_stack("corewire-vllm-0330-", LEAK_ALLOWED_PIDS, PROTOCOL) as shared:
        yield shared


# ---------------------------------------------------------------------- start-up


def test_vllm_0_33_0_accepts_the_ready_response_and_applies_it(stack: Stack) -> None:
    # vLLM 0.33.0 decodes the 28-key response strictly (a 0.25.1 one fails its start-up)
    # and took the engine's smaller max_model_len and its (absent) KV cache.
    assert stack.config.model_config.max_model_len == ENGINE_ARGS["max_model_len"] == 512
    cache = stack.config.cache_config
    assert cache.num_gpu_blocks == 0 and cache.block_size == 16
    assert stack.client.core_engines == [b"\x00\x00"]
    stack.run(stack.client.reset_mm_cache_async())
    assert stack.run(stack.client.get_supported_tasks_async()) == ["generate", "embed"]


# ---------------------------------------------------------------------- generation


def test_greedy_generation_matches_the_reference_engine(stack: Stack) -> None:
    outs = assert_greedy_generation_matches_reference(stack)
    for rid_outs in outs.values():
        # 0.33.0's fields, read unconditionally by its output processor (those the
        # release has: spec_decode_metrics and new_sampling_mask from 0.32.0 on).
        for out in rid_outs:
            assert out.ec_transfer_params is None
            assert not REQUEST_ERRORS or out.error is None
            assert getattr(out, "spec_decode_metrics", None) is None
            assert getattr(out, "new_sampling_mask", None) is None


def test_seeded_sampling_with_logprobs_matches_the_reference_engine(stack: Stack) -> None:
    assert_seeded_sampling_matches_reference(stack, SEEDED_PROMPT, SEEDED_SAMPLING)


def test_prompt_logprobs_arrive_as_vllms_five_element_tensors(stack: Stack) -> None:
    prompt = [21, 22, 23, 24]
    request = vllm_request("pl", prompt, temperature=0.0, max_tokens=2, prompt_logprobs=3)
    first = stack.run(collect_after(stack.client, request))[0]
    lp = first.new_prompt_logprobs_tensors
    # The release's own tensors: five elements from 0.32.0 on (four before).
    assert len(lp) == len(releases.get(RELEASE).native_layout["LogprobsTensors"])
    assert getattr(lp, "cu_num_generated_tokens_tensor", None) is None
    assert isinstance(lp.logprobs, torch.Tensor) and lp.logprobs.shape == (3, 4)
    assert_prompt_logprobs_match_reference(lp, "pl", prompt, 3)
    # The first output's PrefillStats, with 0.33.0's num_cache_creation_tokens.
    assert first.prefill_stats.num_prompt_tokens == 4
    assert first.prefill_stats.num_cache_creation_tokens == 0


@pytest.mark.skipif(not WEIGHT_VERSIONS, reason=f"vLLM {RELEASE}'s messages carry none")
def test_every_step_message_carries_the_weight_version(stack: Stack) -> None:
    request = vllm_request("wv", [3, 4, 5], temperature=0.0, max_tokens=4)
    stack.run(stack.client.add_request_async(request))
    outs, messages = stack.run(collect_messages(stack.client, {"wv"}))
    assert len(tokens(outs["wv"])) == 4
    assert [m.weight_version for m in messages] == ["default"] * len(messages)


def test_abort_stops_a_running_request(stack: Stack) -> None:
    seen, finished, after = stack.run(abort_mid_request(stack.client))
    assert 3 <= seen < 400
    assert finished == []
    assert len(after) == 4


def test_embedding_request_returns_a_tensor(stack: Stack) -> None:
    from vllm import PoolingParams

    request = vllm_request("emb", [1, 2, 3])
    request.sampling_params = None
    request.pooling_params = PoolingParams(task="embed", dimensions=16)
    (out,) = stack.run(collect_after(stack.client, request))
    assert out.finish_reason == FinishReason.STOP and out.new_token_ids == []
    assert isinstance(out.pooling_output, torch.Tensor) and out.pooling_output.shape == (16,)


# ---------------------------------------------------------------------- utilities


@pytest.mark.skipif(not PAUSE_GENERATION, reason=f"vLLM {RELEASE} has no pause_generation")
def test_pause_generation_refuses_new_requests_with_a_retryable_error(stack: Stack) -> None:
    client = stack.client

    async def scenario() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        await client.add_request_async(
            vllm_request("running", [4], temperature=0.0, max_tokens=400, ignore_eos=True)
        )
        await client.get_output_async()
        # "abort": what runs finishes as ABORT; what comes later is refused, retryable.
        await client.pause_generation_async("abort", True)
        seen["running"] = (await collect(client, {"running"}))["running"][-1]
        assert await client.is_scheduler_paused_async() is True
        seen["refused"] = await collect_after(client, vllm_request("late", [4], max_tokens=2))
        await client.resume_scheduler_async()
        seen["resumed"] = await collect_after(
            client, vllm_request("resumed", [4], temperature=0.0, max_tokens=2)
        )
        # "keep": nothing refused; a new request waits until resume.
        await client.pause_generation_async("keep", False)
        await client.add_request_async(vllm_request("kept", [4], temperature=0.0, max_tokens=2))
        await asyncio.sleep(0.3)
        seen["kept_while_paused"] = client.outputs_queue.empty()
        await client.resume_scheduler_async()
        seen["kept"] = (await collect(client, {"kept"}))["kept"]
        # "wait": the reply comes once the request in flight finished; then refusals.
        await client.add_request_async(vllm_request("drained", [4], temperature=0.0, max_tokens=10))
        await client.pause_generation_async("wait", True)
        drained: list[Any] = []
        while not client.outputs_queue.empty():
            drained.extend((await client.get_output_async()).outputs)
        seen["drained"] = [o.finish_reason for o in drained if o.request_id == "drained"]
        seen["refused_wait"] = await collect_after(client, vllm_request("late2", [4]))
        # A full wake-up lifts the refusal too (it resumes the scheduler, as vLLM's).
        assert await client.wake_up_async(None) is True
        seen["woken"] = await collect_after(
            client, vllm_request("woken", [4], temperature=0.0, max_tokens=2)
        )
        return seen

    seen = stack.run(scenario())
    assert seen["running"].finish_reason == FinishReason.ABORT
    for key in ("refused", "refused_wait"):
        (refused,) = seen[key]
        assert refused.finish_reason == FinishReason.ERROR and refused.new_token_ids == []
        assert refused.error.code == "engine_paused" and refused.error.retryable is True
        assert refused.error.message == "Generation is paused. Please retry after it resumes."
    for key in ("resumed", "kept", "woken"):
        assert len(tokens(seen[key])) == 2 and seen[key][-1].error is None
    assert seen["kept_while_paused"] is True
    assert seen["drained"][-1] == FinishReason.LENGTH


def test_a_refused_request_carries_a_validation_error(stack: Stack) -> None:
    refused = vllm_request("refused", [1, 99999], max_tokens=2)
    (bad,) = stack.run(collect_after(stack.client, refused))
    reason = "prompt token id 99999 is outside the vocabulary [0, 4096)"
    if not REQUEST_ERRORS:
        # Before 0.33.0 the text travels in stop_reason (there is no error field).
        assert bad.finish_reason == FinishReason.ERROR and bad.stop_reason == reason
        return
    # The text travels in the error, stop_reason is nil: vLLM 0.33.0's engine writes it so.
    assert bad.finish_reason == FinishReason.ERROR and bad.stop_reason is None
    assert (bad.error.code, bad.error.message, bad.error.retryable) == (
        "validation_error",
        reason,
        False,
    )


def test_weight_version_utilities_and_outputs(stack: Stack) -> None:
    client, run = stack.client, stack.run
    assert run(client.get_weight_version_async()) == "default"
    run(client.set_weight_version_async("v2"))
    try:
        assert run(client.get_weight_version_async()) == "v2"
        stack.run(client.add_request_async(vllm_request("v2", [3], max_tokens=2)))
        _outs, messages = stack.run(collect_messages(client, {"v2"}))
        if WEIGHT_VERSIONS:
            assert {m.weight_version for m in messages} == {"v2"}
        # Utility replies carry none (vLLM's engine stamps only a step's messages).
        assert run(client.call_utility_async("get_weight_version")) == "v2"
    finally:
        run(client.set_weight_version_async("default"))


def test_every_0_33_0_utility_with_vllms_argument_lists(stack: Stack) -> None:
    client, run = stack.client, stack.run
    # Sent to every engine and AND-ed by 0.33.0's client.
    assert run(client.reset_prefix_cache_async(True, True)) is True
    assert run(client.reset_encoder_cache_async()) is None
    # wake_up returns whether the engine is fully awake.
    run(client.sleep_async(1, "abort"))
    assert run(client.is_sleeping_async()) is True
    # ...where the release's client hands the answer on (0.31.0 on; None before).
    answers = str(inspect.signature(client.wake_up_async).return_annotation) in (
        "bool",
        str(bool),
    )
    woke = run(client.wake_up_async(["weights"]))  # the KV cache still sleeps
    assert woke is (False if answers else None)
    assert run(client.wake_up_async(None)) is (True if answers else None)
    assert run(client.is_sleeping_async()) is False
    # release_kv_cache_memory (0.31.0 on): only after a pause, as vLLM's engine.
    if hasattr(client, "release_kv_cache_memory_async"):
        with pytest.raises(Exception, match="requires a completed pause first"):
            run(client.release_kv_cache_memory_async())
        if PAUSE_GENERATION:
            run(client.pause_generation_async("abort", True))
        else:
            run(client.pause_scheduler_async("abort", True))
        assert run(client.release_kv_cache_memory_async()) is None
        run(client.resume_scheduler_async())
    # profile with the arguments the release's client takes: 0.33.0's five (0.32.0's
    # four: no profiler_kwargs), read off vLLM's own method.
    n = len(inspect.signature(client.profile_async).parameters)
    run(client.profile_async(*(True, "trace33", None, None, None)[:n]))
    run(generate(client, [vllm_request("profiled", [1, 2], temperature=0.0, max_tokens=2)]))
    run(client.profile_async(*(False, None, None, None, None)[:n]))
    (trace,) = stack.profile_dir.iterdir()
    assert trace.name.startswith("trace33-") and trace.stat().st_size > 0
    if n >= 4:  # max_iterations: 0.32.0 on
        with pytest.raises(Exception, match=r"profile\(max_iterations\) is not supported"):
            run(client.profile_async(*(True, None, None, 5, None)[:n]))
    # Weight checksums of the engine's real weights, keyed as vLLM's workers key them
    # (0.32.0 on).
    if hasattr(client, "compute_weight_checksums_async"):
        checksums = run(client.compute_weight_checksums_async())
        engine = ReferenceEngine(**{**ENGINE_ARGS, "step_delay": 0.0})
        (want,) = engine.compute_weight_checksums()
        assert checksums == [{f"dp0:pp0:pcp0:tp0:{name}": d for name, d in want.items()}]
        assert len(next(iter(want.values()))) == 64
    # An unknown utility fails clearly, and the engine lives on.
    with pytest.raises(Exception, match="engine has no utility method 'no_such_utility'"):
        run(client.call_utility_async("no_such_utility"))
    outs = run(generate(client, [vllm_request("alive", [7], temperature=0.0, max_tokens=2)]))
    assert len(tokens(outs["alive"])) == 2


def test_a_fatal_engine_error_reaches_vllms_client_as_engine_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_fatal_error_reaches_client_as_engine_dead(tmp_path, monkeypatch, PROTOCOL)


# ---------------------------------------------------------------------- byte for byte


@pytest.fixture
def raw_front_end(ipc_dir: Path) -> Iterator[FrontEnd]:
    front = FrontEnd(ipc_dir)
    try:
        yield front
    finally:
        front.close()


def _vllm_add(front: FrontEnd, encoder: MsgpackEncoder, request: Any) -> None:
    # As the release's own client writes it (0.34.0 packs the prompt).
    frames = encoder.encode(as_the_client_sends(request))
    front.send_frames([EngineCoreRequestType.ADD.value, *frames])


def test_every_frame_is_what_vllm_0_33_0_writes(raw_front_end: FrontEnd) -> None:
    front = raw_front_end
    front.start_engine(engine_args={**LIGHT_REFERENCE, "max_model_len": 512}, release=PROTOCOL)
    assert front.router.poll(60_000), "no ready response"
    front.identity, payload = front.router.recv_multipart()
    # Strictly, as vLLM 0.33.0's front-end decodes it: the engine's own values.
    ready = msgspec.msgpack.decode(payload, type=EngineCoreReadyResponse)
    assert (ready.data_parallel_rank, ready.max_num_seqs, ready.max_model_len) == (0, 256, 512)
    assert ready.max_num_batched_tokens == 512 and ready.tensor_parallel_size == 1
    # supports_lora from 0.29.0 on, enable_sleep_mode from 0.28.0 on.
    assert getattr(ready, "supports_lora", False) is False
    assert getattr(ready, "enable_sleep_mode", True) is True

    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    _vllm_add(front, encoder, vllm_request("a", [1, 2, 3], temperature=0.0, max_tokens=3))
    _vllm_add(front, encoder, vllm_request("b", [4, 5], max_tokens=2, logprobs=2, seed=7))
    _vllm_add(
        front,
        encoder,
        vllm_request("c", [6, 7, 8], temperature=0.0, max_tokens=1, prompt_logprobs=2),
    )
    _vllm_add(front, encoder, vllm_request("bad", [1, 99999], max_tokens=2))

    def receive() -> Any:
        frames = [bytes(f.buffer) for f in front.recv_raw()]
        with warnings.catch_warnings():
            # vLLM's decoder wraps read-only bytes in tensors, which torch warns about
            warnings.simplefilter("ignore", UserWarning)
            message = decoder.decode(frames)
        # vLLM's own encoder writes the decoded message back to the same bytes.
        again = [bytes(f) for f in encoder.encode(message)]
        assert again == frames, message
        return message

    finished: set[str] = set()
    frames_seen = 0
    while finished != {"a", "b", "c", "bad"}:
        message = receive()
        stamped = getattr(message, "weight_version", "default")
        assert stamped == "default" or message.outputs[0].request_id == "bad"
        frames_seen += 1
        for out in message.outputs:
            if out.finish_reason is not None:
                finished.add(out.request_id)
    assert frames_seen >= 4
    # A utility reply and a refusal while paused: no weight version (no step made them).
    utility = EngineCoreRequestType.UTILITY.value
    pause = "pause_generation" if PAUSE_GENERATION else "pause_scheduler"
    front.send_frames([utility, *encoder.encode((0, 7, pause, ("abort", True)))])
    reply = receive()
    assert reply.utility_output.call_id == 7
    assert getattr(reply, "weight_version", None) is None
    if not PAUSE_GENERATION:
        return  # before 0.33.0 a paused engine queues new requests: nothing is refused
    _vllm_add(front, encoder, vllm_request("paused", [1], max_tokens=2))
    refusal = receive()
    assert refusal.weight_version is None and refusal.outputs[0].error.code == "engine_paused"
