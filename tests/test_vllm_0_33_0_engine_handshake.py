"""``corewire engine --protocol 0.33.0 --handshake-address`` joins vLLM 0.33.0's front-end.

The 0.33.0 counterpart of ``test_vllm_engine_handshake.py``: vLLM 0.33.0's engine-core
client built the way ``vllm serve --data-parallel-size-local 0`` builds it (its own
factory, a handshake ROUTER on ``--data-parallel-rpc-port``, and with DP > 1 vLLM
0.33.0's own DP coordinator process); the engines are ``corewire engine`` processes
started first. The HELLO / metadata / READY handshake is unchanged in 0.33.0; the
coordinator now publishes ``[waiting, running, kv_cache_usage]`` per engine, which the
engines' reports feed.

Runs only where vLLM 0.33.0 is installed (skipped under 0.25.1; with
``COREWIRE_REQUIRE_VLLM`` set, a missing or other vLLM fails instead).

Checks ``docs/vllm-0.33.0-notes.md`` §5.2 (HELLO, metadata, READY) and §5.3 (the DP
coordinator's counts).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_0_33_0_gate import require_vllm_0_33_0

vllm = require_vllm_0_33_0()

import msgspec  # noqa: E402
import zmq  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.engine.core_client import (  # noqa: E402
    AsyncMPClient,
    DPLBAsyncMPClient,
    EngineCoreClient,
)
from vllm.v1.executor.abstract import Executor  # noqa: E402

from corewire.dp_messages import XPUB_SUBSCRIBE  # noqa: E402
from dp_support import free_tcp_port  # noqa: E402
from vllm_support import (  # noqa: E402
    ENGINE_ARGS,
    EngineProcs,
    offline_environment,
    reference_run,
    vllm_config,
    vllm_request,
    write_model_dir,
)

offline_environment()

_DEADLINE_S = 90.0


@pytest.fixture
def root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="corewire-vllm-0330-join-") as tmp:
        os.chmod(tmp, 0o700)
        yield Path(tmp)


def request(rid: str, prompt: list[int], max_tokens: int = 6) -> Any:
    """A greedy vLLM request (see ``vllm_support.vllm_request``)."""
    return vllm_request(rid, prompt, temperature=0.0, max_tokens=max_tokens)


async def generate(client: Any, requests: list[Any]) -> dict[str, Any]:
    """Send the requests; per request id, ``(tokens, engine indices that served it)``."""
    for r in requests:
        await client.add_request_async(r)
    result: dict[str, Any] = {r.request_id: ([], set()) for r in requests}
    pending = set(result)
    while pending:
        batch = await client.get_output_async()
        assert batch.weight_version in ("default", None)
        for out in batch.outputs:
            if out.request_id in result:
                result[out.request_id][0].extend(out.new_token_ids)
                result[out.request_id][1].add(batch.engine_index)
                if out.finish_reason is not None:
                    assert out.finish_reason == FinishReason.LENGTH
                    pending.discard(out.request_id)
    return result


def join_args(port: int, index: int, *extra: str) -> list[str]:
    """``corewire engine`` arguments that join the 0.33.0 front-end at ``port``."""
    return [
        "--handshake-address",
        f"tcp://127.0.0.1:{port}",
        "--engine-index",
        str(index),
        "--handshake-timeout",
        "90",
        "--protocol",
        "0.33.0",
        *extra,
    ]


def run_frontend(config: Any, engines: EngineProcs, scenario: Any) -> Any:
    """Build vLLM 0.33.0's client with its own factory (it waits for the engines'
    handshake), run ``scenario(client)`` on its loop, and shut everything down: the
    engines must exit cleanly."""
    loop = asyncio.new_event_loop()
    client = None
    try:

        async def main() -> Any:
            nonlocal client
            # 0.33.0's AsyncLLM passes keywords (and a renderer, None for text).
            client = EngineCoreClient.make_async_mp_client(
                vllm_config=config, executor_class=Executor, log_stats=False
            )
            return await scenario(client)

        return loop.run_until_complete(asyncio.wait_for(main(), _DEADLINE_S))
    finally:
        if client is not None:
            client.shutdown()
            loop.run_until_complete(asyncio.sleep(0))
            client.resources.ctx.destroy(linger=0)
        loop.close()
        codes = engines.stop()
        assert codes == [0] * len(codes), engines.logs()


def test_one_engine_joins_a_frontend_only_vllm_0_33_0_client(root: Path) -> None:
    port = free_tcp_port()
    engines = EngineProcs(root)
    engines.start(*join_args(port, 0))
    config = vllm_config(
        write_model_dir(root / "model"),
        data_parallel_size=1,
        data_parallel_size_local=0,
        data_parallel_master_ip="127.0.0.1",
        data_parallel_rpc_port=port,
    )

    async def scenario(client: Any) -> Any:
        assert type(client) is AsyncMPClient
        tasks = await client.get_supported_tasks_async()
        got = await generate(client, [request("a", [5, 6, 7]), request("b", [8])])
        return tasks, got

    tasks, got = run_frontend(config, engines, scenario)
    assert tasks == ["generate", "embed"]
    # The 0.33.0 ready response reached vLLM's config: the engine's smaller limit won.
    assert config.model_config.max_model_len == ENGINE_ARGS["max_model_len"]
    expected = reference_run(
        [(r, p, {"temperature": 0.0, "max_tokens": 6}) for r, p in (("a", [5, 6, 7]), ("b", [8]))]
    )
    assert {rid: toks for rid, (toks, _) in got.items()} == {
        rid: toks for rid, (toks, _) in expected.items()
    }
    assert "joined the front-end" in engines.logs()


def test_two_engines_join_behind_vllm_0_33_0s_dp_coordinator(root: Path) -> None:
    port = free_tcp_port()
    engines = EngineProcs(root)
    for index in (0, 1):
        engines.start(*join_args(port, index, "--data-parallel-size", "2"))
    config = vllm_config(
        write_model_dir(root / "model"),
        data_parallel_size=2,
        data_parallel_size_local=0,
        data_parallel_master_ip="127.0.0.1",
        data_parallel_rpc_port=port,
    )

    async def scenario(client: Any) -> Any:
        assert type(client) is DPLBAsyncMPClient
        # Listen to what vLLM's coordinator publishes to front-ends, as its client does.
        ctx = zmq.Context()
        stats = ctx.socket(zmq.XSUB)
        try:
            stats.connect(client.stats_update_address)
            stats.send(XPUB_SUBSCRIBE)
            await asyncio.sleep(0.2)
            prompts = {f"r{i}": [3 + i, 4] for i in range(10)}
            got = await generate(client, [request(r, p, 40) for r, p in prompts.items()])
            await asyncio.sleep(0.3)
            published = []
            while stats.poll(0):
                published.append(msgspec.msgpack.decode(stats.recv()))
        finally:
            stats.close(linger=0)
            ctx.term()
        return prompts, got, published

    prompts, got, published = run_frontend(config, engines, scenario)
    sp = {"temperature": 0.0, "max_tokens": 40}
    expected = reference_run([(r, p, sp) for r, p in prompts.items()])
    served = {rid: engines_seen for rid, (_, engines_seen) in got.items()}
    assert all(len(s) == 1 for s in served.values())  # one engine per request
    per_engine = [sum(1 for s in served.values() if s == {i}) for i in (0, 1)]
    assert per_engine[0] >= 2 and per_engine[1] >= 2, per_engine
    assert {rid: toks for rid, (toks, _) in got.items()} == {
        rid: toks for rid, (toks, _) in expected.items()
    }
    # The engines' counts reached 0.33.0's coordinator, which published them as
    # [waiting, running, kv_cache_usage] (both engines busy at some point, all idle at
    # the end; these engines have no KV cache).
    counts = [c for c, _wave, _running in published if c is not None]
    idle = [0, 0, 0.0]
    assert any(c[0] != idle for c in counts) and any(c[1] != idle for c in counts), counts
    assert all(len(e) == 3 and e[2] == 0.0 for c in counts for e in c), counts
    assert counts[-1] == [idle, idle]
