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
import dataclasses
import os
import tempfile
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

import corewire.protocol as corewire_protocol
from client_support import request as corewire_request
from corewire.engine.reference import ReferenceEngine
from vllm_support import (
    ENGINE_ARGS,
    EngineProcs,
    offline_environment,
    reference_run,
    vllm_config,
    vllm_request,
    write_model_dir,
)

offline_environment()
pytest.importorskip("vllm")

from vllm import PoolingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.engine import EngineCoreRequest, FinishReason  # noqa: E402
from vllm.v1.engine.core_client import AsyncMPClient  # noqa: E402
from vllm.v1.executor.abstract import Executor  # noqa: E402

T = TypeVar("T")
# The module's shared engine: it outlives single tests (conftest's leak check).
LEAK_ALLOWED_PIDS: set[int] = set()
_CALL_TIMEOUT_S = 30.0


@dataclasses.dataclass
class Stack:
    """vLLM's client, the loop it lives on, and the engine behind it."""

    client: Any
    loop: asyncio.AbstractEventLoop
    engines: EngineProcs
    config: Any
    profile_dir: Path

    def run(self, coro: Awaitable[T]) -> T:
        """Run a coroutine on the client's loop, with a deadline."""
        return self.loop.run_until_complete(asyncio.wait_for(coro, _CALL_TIMEOUT_S))


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with tempfile.TemporaryDirectory(prefix="corewire-vllm-client-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o700)
        profile_dir = root / "profiles"
        profile_dir.mkdir(mode=0o700)
        engines = EngineProcs(root)
        addresses = {"input_address": f"ipc://{root}/in", "output_address": f"ipc://{root}/out"}
        proc = engines.start(
            "--input-address",
            addresses["input_address"],
            "--output-address",
            addresses["output_address"],
            "--engine-index",
            "0",
            engine_args={**ENGINE_ARGS, "profile_dir": str(profile_dir)},
        )
        LEAK_ALLOWED_PIDS.add(proc.pid)
        loop = asyncio.new_event_loop()
        client = None
        try:
            config = vllm_config(write_model_dir(root / "model"))

            async def make() -> Any:
                # Built inside the loop, as vLLM's API server does: its output task
                # starts here.
                return AsyncMPClient(config, Executor, False, client_addresses=addresses)

            client = loop.run_until_complete(make())
            yield Stack(client, loop, engines, config, profile_dir)
        finally:
            if client is not None:
                client.shutdown()
                loop.run_until_complete(asyncio.sleep(0))
                # vLLM's client leaves its ZeroMQ context to the process exit.
                client.resources.ctx.destroy(linger=0)
            loop.close()
            codes = engines.stop()
            LEAK_ALLOWED_PIDS.clear()
        assert codes == [0], engines.logs()


async def collect(client: Any, rids: set[str]) -> dict[str, list[Any]]:
    """Every output of ``rids`` until each finished (outputs of others are dropped)."""
    outs: dict[str, list[Any]] = {rid: [] for rid in rids}
    pending = set(rids)
    while pending:
        batch = await client.get_output_async()
        for out in batch.outputs:
            if out.request_id in outs:
                outs[out.request_id].append(out)
                if out.finish_reason is not None:
                    pending.discard(out.request_id)
    return outs


async def generate(client: Any, requests: list[EngineCoreRequest]) -> dict[str, list[Any]]:
    """Send ``requests`` and collect their outputs."""
    for request in requests:
        await client.add_request_async(request)
    return await collect(client, {r.request_id for r in requests})


def tokens(outs: list[Any]) -> list[int]:
    """The token ids of one request's outputs."""
    return [t for out in outs for t in out.new_token_ids]


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
    prompts = {"g0": [5, 6, 7], "g1": [9], "g2": [100, 200, 300, 400]}
    sp = {"temperature": 0.0, "max_tokens": 8}
    outs = stack.run(generate(stack.client, [vllm_request(r, p, **sp) for r, p in prompts.items()]))
    expected = reference_run([(r, p, sp) for r, p in prompts.items()])
    for rid in prompts:
        assert tokens(outs[rid]) == expected[rid][0]
        assert outs[rid][-1].finish_reason == FinishReason.LENGTH
        assert all(o.finish_reason is None for o in outs[rid][:-1])


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
    prompt = [11, 12, 13, 14]
    base = {
        "temperature": 0.8,
        "top_k": 50,
        "top_p": 0.9,
        "seed": 1234,
        "min_tokens": 3,
        "max_tokens": 12,
        "ignore_eos": True,
        "logprobs": 3,
    }
    stop = _stopping_token(prompt, base)
    sp = {**base, "stop_token_ids": [stop]}
    (expected_tokens, expected_lps) = reference_run([("s", prompt, sp)])["s"]
    first = stack.run(generate(stack.client, [vllm_request("s1", prompt, **sp)]))["s1"]
    again = stack.run(generate(stack.client, [vllm_request("s2", prompt, **sp)]))["s2"]
    assert tokens(first) == tokens(again) == expected_tokens
    assert first[-1].finish_reason == FinishReason.STOP and first[-1].stop_reason == stop
    assert len(expected_tokens) < sp["max_tokens"]
    # vLLM's LogprobsLists per output: the sampled token first, then the top 3.
    for out, want in zip(first, expected_lps, strict=True):
        lp = out.new_logprobs
        assert lp.logprob_token_ids.shape == lp.logprobs.shape == (1, 4)
        assert lp.logprob_token_ids[0, 0] == out.new_token_ids[0]
        np.testing.assert_allclose(lp.logprobs, want, rtol=1e-5)
        assert lp.sampled_token_ranks.shape == (1,) and lp.sampled_token_ranks[0] >= 1


def test_prompt_logprobs_arrive_as_vllms_tensors(stack: Stack) -> None:
    prompt = [21, 22, 23, 24]
    request = vllm_request("pl", prompt, temperature=0.0, max_tokens=2, prompt_logprobs=3)
    first = stack.run(collect_after(stack.client, request))[0]
    lp = first.new_prompt_logprobs_tensors
    assert isinstance(lp.logprobs, torch.Tensor) and lp.logprobs.shape == (3, 4)
    assert lp.logprob_token_ids[:, 0].tolist() == prompt[1:]
    engine = ReferenceEngine(**{**ENGINE_ARGS, "step_delay": 0.0})
    engine.add_request(corewire_request("pl", 2, prompt=prompt, sampling={"prompt_logprobs": 3}))
    want = engine.step()[0].new_prompt_logprobs_tensors
    torch.testing.assert_close(lp.logprobs, want.logprobs)
    torch.testing.assert_close(lp.logprob_token_ids, want.logprob_token_ids)


def test_abort_stops_a_running_request(stack: Stack) -> None:
    client = stack.client

    async def scenario() -> tuple[int, list[Any], list[int]]:
        await client.add_request_async(
            vllm_request("long", [3, 4], temperature=0.0, max_tokens=400, ignore_eos=True)
        )
        seen = 0
        while seen < 3:
            batch = await client.get_output_async()
            seen += sum(len(o.new_token_ids) for o in batch.outputs if o.request_id == "long")
        await client.abort_requests_async(["long"])
        # The engine applies input in order: once this reply is back, every output it
        # made for "long" before the abort is already queued here.
        assert await client.is_sleeping_async() is False
        late: list[Any] = []
        while not client.outputs_queue.empty():
            late.extend((await client.get_output_async()).outputs)
        seen += sum(len(o.new_token_ids) for o in late if o.request_id == "long")
        after = await generate(
            client, [vllm_request("after", [3, 4], temperature=0.0, max_tokens=4)]
        )
        return seen, [o for o in late if o.finish_reason is not None], tokens(after["after"])

    seen, finished, after = stack.run(scenario())
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


async def collect_after(client: Any, request: EngineCoreRequest) -> list[Any]:
    """Send one request and return its outputs."""
    await client.add_request_async(request)
    return (await collect(client, {request.request_id}))[request.request_id]


def test_a_fatal_engine_error_reaches_vllms_client_as_engine_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    # The fault hook lives in the tests' own engine, which the engine command imports.
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    engines = EngineProcs(tmp_path)
    addresses = {
        "input_address": f"ipc://{tmp_path}/in",
        "output_address": f"ipc://{tmp_path}/out",
    }
    proc = engines.start(
        "--input-address",
        addresses["input_address"],
        "--output-address",
        addresses["output_address"],
        "--engine",
        "hook_engine:HookEngine",
    )
    config = vllm_config(write_model_dir(tmp_path / "model"))
    loop = asyncio.new_event_loop()
    client = None

    async def scenario() -> None:
        nonlocal client
        client = AsyncMPClient(config, Executor, False, client_addresses=addresses)
        await client.call_utility_async("fail_next_step", "injected by the test")
        await client.add_request_async(vllm_request("doomed", [1], temperature=0.0, max_tokens=4))
        with pytest.raises(EngineDeadError):
            while True:
                await client.get_output_async()

    try:
        loop.run_until_complete(asyncio.wait_for(scenario(), _CALL_TIMEOUT_S))
    finally:
        if client is not None:
            client.shutdown()
            loop.run_until_complete(asyncio.sleep(0))
            client.resources.ctx.destroy(linger=0)
        loop.close()
        try:
            code = proc.wait(20)  # the engine leaves by itself after ENGINE_CORE_DEAD
        finally:
            engines.stop()
    assert code == 1, engines.logs()
    assert "injected by the test" in engines.logs()
