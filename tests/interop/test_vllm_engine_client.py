"""vLLM 0.25.1's own ``AsyncMPClient`` drives a ``corewire engine`` process.

The front-end side is vLLM's real class (built with ``client_addresses``, as vLLM's API
server builds it for engines it does not launch) on real sockets; the engine is the
``corewire engine`` command running the reference engine. Expected tokens and logprobs
come from the same reference engine run in this process.

Checks ``docs/protocol.md`` §2 (sockets, identities), §3.1 (the ready response), §4.2-§4.6
(ADD, sampling and pooling parameters, ABORT, UTILITY), §5 (outputs, finish reasons,
stats, utility replies, logprobs), §7 (ENGINE_CORE_DEAD) and §9.3 (errors an engine
reports), each against vLLM's own client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import corewire.protocol as corewire_protocol
from corewire.engine.reference import ReferenceEngine
from vllm_support import ENGINE_ARGS, offline_environment, reference_run, vllm_request

offline_environment()
pytest.importorskip("vllm")

from vllm import PoolingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402

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
    generate,
    tokens,
)

# The module's shared engine: it outlives single tests (conftest's leak check).
LEAK_ALLOWED_PIDS: set[int] = set()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with client_stack("corewire-vllm-client-", LEAK_ALLOWED_PIDS) as shared:
        yield shared


# ---------------------------------------------------------------------- start-up


def test_ready_response_is_applied_to_vllms_config(stack: Stack) -> None:
    # vLLM decoded the ready response strictly (a missing key fails its start-up) and
    # took the engine's smaller max_model_len and its (absent) KV cache.
    assert stack.config.model_config.max_model_len == ENGINE_ARGS["max_model_len"] == 512
    cache = stack.config.cache_config
    assert cache.num_gpu_blocks == 0 and cache.block_size == 16
    assert cache.kv_cache_size_tokens is None and cache.kv_cache_max_concurrency is None
    # vLLM's own identity for engine 0, spelled out (docs/protocol.md §2).
    assert stack.client.core_engines == [b"\x00\x00"]
    # What vLLM's front-end calls right after start-up.
    stack.run(stack.client.reset_mm_cache_async())
    assert stack.run(stack.client.get_supported_tasks_async()) == ["generate", "embed"]


# ---------------------------------------------------------------------- generation


def test_greedy_generation_matches_the_reference_engine(stack: Stack) -> None:
    assert_greedy_generation_matches_reference(stack)


def _stopping_token(prompt: list[int], sp: dict[str, Any]) -> int:
    """A token id that, as the request's stop token, ends this seeded request early."""
    plain = reference_run([("probe", prompt, sp)])["probe"][0]
    for candidate in plain[sp["min_tokens"] :]:
        stop_sp = {**sp, "stop_token_ids": [candidate]}
        got = reference_run([("probe", prompt, stop_sp)])["probe"][0]
        if len(got) < sp["max_tokens"] and got[-1] == candidate:
            return candidate
    raise AssertionError("no token of the probe run ends it early")


def test_seeded_sampling_with_every_parameter_and_logprobs(stack: Stack) -> None:
    prompt, base = SEEDED_PROMPT, SEEDED_SAMPLING
    stop = _stopping_token(prompt, base)
    sp = {**base, "stop_token_ids": [stop]}
    first, expected_tokens = assert_seeded_sampling_matches_reference(stack, prompt, sp)
    assert first[-1].finish_reason == FinishReason.STOP and first[-1].stop_reason == stop
    assert len(expected_tokens) < sp["max_tokens"]
    # vLLM's LogprobsLists per output also ranks the sampled token.
    for out in first:
        lp = out.new_logprobs
        assert lp.sampled_token_ranks.shape == (1,) and lp.sampled_token_ranks[0] >= 1


def test_prompt_logprobs_arrive_as_vllms_tensors(stack: Stack) -> None:
    prompt = [21, 22, 23, 24]
    request = vllm_request("pl", prompt, temperature=0.0, max_tokens=2, prompt_logprobs=3)
    first = stack.run(collect_after(stack.client, request))[0]
    lp = first.new_prompt_logprobs_tensors
    assert isinstance(lp.logprobs, torch.Tensor) and lp.logprobs.shape == (3, 4)
    assert lp.logprob_token_ids[:, 0].tolist() == prompt[1:]
    assert_prompt_logprobs_match_reference(lp, "pl", prompt, 3)


def test_abort_stops_a_running_request(stack: Stack) -> None:
    seen, finished, after = stack.run(abort_mid_request(stack.client))
    assert 3 <= seen < 400
    assert finished == []  # vLLM's engines send nothing for a request the client aborted
    assert len(after) == 4


# ---------------------------------------------------------------------- utilities


def test_every_utility_with_vllms_argument_lists(stack: Stack) -> None:
    client, run = stack.client, stack.run
    assert run(client.reset_prefix_cache_async(True, True)) is True
    assert run(client.reset_prefix_cache_async()) is True
    assert run(client.reset_mm_cache_async()) is None
    assert run(client.reset_encoder_cache_async()) is None
    assert run(client.execute_dummy_batch_async()) is None
    # collective_rpc(method, timeout, args, kwargs): one worker, one result.
    assert run(client.collective_rpc_async("echo", None, (5,), None)) == [5]
    assert run(client.collective_rpc_async("echo", 10.0, (1, 2), {})) == [[1, 2]]
    assert run(client.collective_rpc_async("dtype")) == ["float32"]
    # pause_scheduler(mode, clear_cache) / resume / is_scheduler_paused.
    run(client.pause_scheduler_async("keep", False))
    assert run(client.is_scheduler_paused_async()) is True
    assert run(client.is_sleeping_async()) is True  # vLLM counts a pause as sleeping
    run(client.resume_scheduler_async())
    assert run(client.is_scheduler_paused_async()) is False
    # sleep(level, mode) / is_sleeping / wake_up(tags), level 0 (a pause) to 2.
    run(client.sleep_async(0, "keep"))
    assert run(client.is_sleeping_async()) is True
    run(client.wake_up_async(["scheduling"]))
    assert run(client.is_sleeping_async()) is False
    for level in (1, 2):
        run(client.sleep_async(level, "abort"))
        assert run(client.is_sleeping_async()) is True
        run(client.wake_up_async(["weights"]))
        assert run(client.is_sleeping_async()) is True  # the KV cache still sleeps
        run(client.wake_up_async(None))
        assert run(client.is_sleeping_async()) is False
    # profile(is_start, profile_prefix): a trace named by the prefix, only ever
    # written into the engine's profile_dir.
    run(client.profile_async(True, "vllm-trace"))
    run(generate(client, [vllm_request("profiled", [1, 2], temperature=0.0, max_tokens=3)]))
    run(client.profile_async(False, None))
    (trace,) = stack.profile_dir.iterdir()
    assert trace.name.startswith("vllm-trace-") and trace.stat().st_size > 0
    with pytest.raises(Exception, match="file-name prefix, not a path"):
        run(client.profile_async(True, "../outside"))
    assert list(stack.profile_dir.iterdir()) == [trace]
    # Still serving after all of it.
    outs = run(generate(client, [vllm_request("alive", [7], temperature=0.0, max_tokens=2)]))
    assert len(tokens(outs["alive"])) == 2


def test_unsupported_utilities_fail_clearly(stack: Stack) -> None:
    client, run = stack.client, stack.run
    lora = "Call to {} method failed: LoRA adapters are not supported by ReferenceEngine"
    with pytest.raises(Exception, match=lora.format("add_lora")):
        run(client.add_lora_async(LoRARequest("adapter", 1, "/nonexistent")))
    with pytest.raises(Exception, match=lora.format("remove_lora")):
        run(client.remove_lora_async(1))
    with pytest.raises(Exception, match=lora.format("list_loras")):
        run(client.list_loras_async())
    with pytest.raises(Exception, match=lora.format("pin_lora")):
        run(client.pin_lora_async(1))
    with pytest.raises(Exception, match="save_sharded_state is not supported by ReferenceEngine"):
        run(client.save_sharded_state_async("/nonexistent", None, None))
    assert run(client.is_sleeping_async()) is False  # the engine lives on


def test_sleep_and_pause_modes_act_on_running_requests(stack: Stack) -> None:
    client = stack.client

    async def scenario() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        # sleep(level 1, "abort"): the running request finishes as ABORT at once.
        await client.add_request_async(
            vllm_request("slept", [4], temperature=0.0, max_tokens=400, ignore_eos=True)
        )
        await client.get_output_async()
        await client.sleep_async(1, "abort")
        seen["slept"] = (await collect(client, {"slept"}))["slept"][-1].finish_reason
        # Asleep: a new request waits; waking up runs it.
        await client.add_request_async(vllm_request("queued", [4], temperature=0.0, max_tokens=3))
        await asyncio.sleep(0.2)
        seen["queued_while_asleep"] = not client.outputs_queue.empty()
        await client.wake_up_async(None)
        seen["queued"] = tokens((await collect(client, {"queued"}))["queued"])
        # pause_scheduler("wait"): the reply comes once the request in flight finished.
        await client.add_request_async(vllm_request("drained", [4], temperature=0.0, max_tokens=20))
        await client.pause_scheduler_async("wait", True)
        drained = []
        while not client.outputs_queue.empty():
            drained.extend((await client.get_output_async()).outputs)
        seen["drained"] = [o.finish_reason for o in drained if o.request_id == "drained"][-1]
        await client.resume_scheduler_async()
        # pause_scheduler("abort"): ABORT for what runs.
        await client.add_request_async(
            vllm_request("paused", [4], temperature=0.0, max_tokens=400, ignore_eos=True)
        )
        await client.get_output_async()
        await client.pause_scheduler_async("abort", True)
        seen["paused"] = (await collect(client, {"paused"}))["paused"][-1].finish_reason
        await client.resume_scheduler_async()
        return seen

    seen = stack.run(scenario())
    assert seen["slept"] == FinishReason.ABORT
    assert seen["queued_while_asleep"] is False
    assert (
        seen["queued"] == reference_run([("q", [4], {"temperature": 0.0, "max_tokens": 3})])["q"][0]
    )
    assert seen["drained"] == FinishReason.LENGTH
    assert seen["paused"] == FinishReason.ABORT


def test_embedding_request_returns_a_tensor(stack: Stack) -> None:
    request = vllm_request("emb", [1, 2, 3])
    request.sampling_params = None
    request.pooling_params = PoolingParams(task="embed", dimensions=16)
    (out,) = stack.run(collect_after(stack.client, request))
    engine = ReferenceEngine(**{**ENGINE_ARGS, "step_delay": 0.0})
    engine.add_request(
        corewire_protocol.EngineCoreRequest(
            request_id="emb",
            prompt_token_ids=[1, 2, 3],
            pooling_params=corewire_protocol.PoolingParams(dimensions=16),
        )
    )
    (want,) = engine.step()
    assert out.finish_reason == FinishReason.STOP and out.new_token_ids == []
    assert isinstance(out.pooling_output, torch.Tensor) and out.pooling_output.shape == (16,)
    torch.testing.assert_close(out.pooling_output, want.pooling_output)


def test_error_reason_and_prefill_stats_reach_vllms_client(stack: Stack) -> None:
    from vllm.v1.metrics.stats import PrefillStats

    # A refused request: ERROR with the engine's short reason as a str stop_reason,
    # which vLLM's output processor hands on unchanged.
    refused = vllm_request("refused", [1, 99999], max_tokens=2)
    (bad,) = stack.run(collect_after(stack.client, refused))
    assert bad.finish_reason == FinishReason.ERROR and bad.new_token_ids == []
    assert bad.stop_reason == "prompt token id 99999 is outside the vocabulary [0, 4096)"
    # Prompt tokens for vLLM's metrics: PrefillStats with the first output only.
    counted = vllm_request("counted", [1, 2, 3], max_tokens=3, temperature=0.0)
    outs = stack.run(collect_after(stack.client, counted))
    assert outs[0].prefill_stats == PrefillStats(3, 3, 0, 0, 0)
    assert all(o.prefill_stats is None for o in outs[1:])


def test_a_fatal_engine_error_reaches_vllms_client_as_engine_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_fatal_error_reaches_client_as_engine_dead(tmp_path, monkeypatch)
