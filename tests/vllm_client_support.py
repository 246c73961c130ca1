"""vLLM's own ``AsyncMPClient`` in front of one ``corewire engine`` process, for the
modules that test either vLLM release's client against the engine
(``test_vllm_engine_client.py`` under 0.25.1, ``test_vllm_0_33_0_engine.py`` under
0.33.0; imported only by modules that skip without vllm).

- :func:`client_stack`: the engine command on private ``ipc://`` sockets, vLLM's client
  built with ``client_addresses`` (as its API server builds it for engines it does not
  launch) on a loop of its own, and a clean stop whose exit code is checked.
- :func:`collect`, :func:`collect_messages`, :func:`generate`, :func:`collect_after`,
  :func:`tokens`: sending requests through that client and gathering their outputs.
- :func:`abort_mid_request`, :func:`assert_greedy_generation_matches_reference`,
  :func:`assert_seeded_sampling_matches_reference`,
  :func:`assert_prompt_logprobs_match_reference`,
  :func:`assert_fatal_error_reaches_client_as_engine_dead`: the checks both releases'
  clients must pass the same way.

vLLM's classes are imported where they are used: both releases keep them at the same
paths, and the calling module has already checked which release is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from client_support import request as corewire_request
from corewire.engine.reference import ReferenceEngine
from vllm_support import (
    ENGINE_ARGS,
    EngineProcs,
    close_client,
    reference_run,
    vllm_config,
    vllm_request,
    write_model_dir,
)

T = TypeVar("T")
#: A seeded request that uses every sampling parameter both releases share, with
#: logprobs (its prompt: :data:`SEEDED_PROMPT`).
SEEDED_SAMPLING: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 50,
    "top_p": 0.9,
    "seed": 1234,
    "min_tokens": 3,
    "max_tokens": 12,
    "ignore_eos": True,
    "logprobs": 3,
}
SEEDED_PROMPT = [11, 12, 13, 14]
#: How long one call on the client's loop may take.
CALL_TIMEOUT_S = 30.0


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
        return self.loop.run_until_complete(asyncio.wait_for(coro, CALL_TIMEOUT_S))


def _protocol_args(release: str | None) -> tuple[str, ...]:
    """The engine command's ``--release`` option (none: its default, 0.25.1)."""
    return () if release is None else ("--release", release)


@contextlib.contextmanager
def client_stack(
    prefix: str, leak_allowed: set[int], release: str | None = None
) -> Iterator[Stack]:
    """One engine (``protocol`` on the wire) behind vLLM's ``AsyncMPClient``; the
    engine's pid is in ``leak_allowed`` while it runs (the calling module's
    ``LEAK_ALLOWED_PIDS``: it outlives single tests). On a normal exit the engine must
    leave with code 0."""
    from vllm.v1.engine.core_client import AsyncMPClient
    from vllm.v1.executor.abstract import Executor

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
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
            *_protocol_args(release),
            engine_args={**ENGINE_ARGS, "profile_dir": str(profile_dir)},
        )
        leak_allowed.add(proc.pid)
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
            close_client(client, loop)
            codes = engines.stop()
            leak_allowed.clear()
        assert codes == [0], engines.logs()


async def collect_messages(client: Any, rids: set[str]) -> tuple[dict[str, list[Any]], list[Any]]:
    """Every output of ``rids`` until each finished (outputs of others are dropped), and
    the messages that carried them."""
    outs: dict[str, list[Any]] = {rid: [] for rid in rids}
    messages: list[Any] = []
    pending = set(rids)
    while pending:
        batch = await client.get_output_async()
        mine = [out for out in batch.outputs if out.request_id in outs]
        if mine:
            messages.append(batch)
        for out in mine:
            outs[out.request_id].append(out)
            if out.finish_reason is not None:
                pending.discard(out.request_id)
    return outs, messages


async def collect(client: Any, rids: set[str]) -> dict[str, list[Any]]:
    """Every output of ``rids`` until each finished (outputs of others are dropped)."""
    return (await collect_messages(client, rids))[0]


async def generate(client: Any, requests: list[Any]) -> dict[str, list[Any]]:
    """Send ``requests`` and collect their outputs."""
    for request in requests:
        await client.add_request_async(request)
    return await collect(client, {r.request_id for r in requests})


async def collect_after(client: Any, request: Any) -> list[Any]:
    """Send one request and return its outputs."""
    await client.add_request_async(request)
    return (await collect(client, {request.request_id}))[request.request_id]


def tokens(outs: list[Any]) -> list[int]:
    """The token ids of one request's outputs."""
    return [t for out in outs for t in out.new_token_ids]


async def abort_mid_request(client: Any) -> tuple[int, list[Any], list[int]]:
    """Abort a long request after its first tokens: how many tokens it made in all, its
    outputs after the abort that carry a finish reason (vLLM's engines send none), and
    the tokens of a 4-token request sent afterwards."""
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
    after = await generate(client, [vllm_request("after", [3, 4], temperature=0.0, max_tokens=4)])
    return seen, [o for o in late if o.finish_reason is not None], tokens(after["after"])


def assert_fatal_error_reaches_client_as_engine_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: str | None = None
) -> None:
    """A step that fails in the engine (the tests' hook engine, ``protocol`` on the
    wire) reaches vLLM's client as ``EngineDeadError``; the engine leaves with code 1
    and logs the error."""
    from vllm.v1.engine.core_client import AsyncMPClient
    from vllm.v1.engine.exceptions import EngineDeadError
    from vllm.v1.executor.abstract import Executor

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
        *_protocol_args(release),
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
        loop.run_until_complete(asyncio.wait_for(scenario(), CALL_TIMEOUT_S))
    finally:
        close_client(client, loop)
        try:
            code = proc.wait(20)  # the engine leaves by itself after ENGINE_CORE_DEAD
        finally:
            engines.stop()
    assert code == 1, engines.logs()
    assert "injected by the test" in engines.logs()


def assert_greedy_generation_matches_reference(stack: Stack) -> dict[str, list[Any]]:
    """Three greedy requests at once through the client give the in-process reference
    engine's tokens, each ending with LENGTH on its last output only; their outputs."""
    from vllm.v1.engine import FinishReason

    prompts = {"g0": [5, 6, 7], "g1": [9], "g2": [100, 200, 300, 400]}
    sp = {"temperature": 0.0, "max_tokens": 8}
    outs = stack.run(generate(stack.client, [vllm_request(r, p, **sp) for r, p in prompts.items()]))
    expected = reference_run([(r, p, sp) for r, p in prompts.items()])
    for rid in prompts:
        assert tokens(outs[rid]) == expected[rid][0]
        assert outs[rid][-1].finish_reason == FinishReason.LENGTH
        assert all(o.finish_reason is None for o in outs[rid][:-1])
    return outs


def assert_seeded_sampling_matches_reference(
    stack: Stack, prompt: list[int], sp: dict[str, Any]
) -> tuple[list[Any], list[int]]:
    """Two runs of the seeded request ``sp`` (asking 3 logprobs) through the client give
    the reference engine's tokens, and each output the reference's logprob row (the
    sampled token first, then the top 3); the first run's outputs and those tokens."""
    (expected_tokens, expected_lps) = reference_run([("s", prompt, sp)])["s"]
    first = stack.run(generate(stack.client, [vllm_request("s1", prompt, **sp)]))["s1"]
    again = stack.run(generate(stack.client, [vllm_request("s2", prompt, **sp)]))["s2"]
    assert tokens(first) == tokens(again) == expected_tokens
    for out, want in zip(first, expected_lps, strict=True):
        lp = out.new_logprobs
        assert lp.logprob_token_ids.shape == lp.logprobs.shape == (1, 4)
        assert lp.logprob_token_ids[0, 0] == out.new_token_ids[0]
        np.testing.assert_allclose(lp.logprobs, want, rtol=1e-5)
    return first, expected_tokens


def assert_prompt_logprobs_match_reference(lp: Any, rid: str, prompt: list[int], n: int) -> None:
    """``lp`` (vLLM's prompt-logprobs tensors of a request asking ``n``) holds what the
    in-process reference engine computes for the same 2-token request."""
    engine = ReferenceEngine(**{**ENGINE_ARGS, "step_delay": 0.0})
    engine.add_request(corewire_request(rid, 2, prompt=prompt, sampling={"prompt_logprobs": n}))
    want = engine.step()[0].new_prompt_logprobs_tensors
    torch.testing.assert_close(lp.logprobs, want.logprobs)
    torch.testing.assert_close(lp.logprob_token_ids, want.logprob_token_ids)
