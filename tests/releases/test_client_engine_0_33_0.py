"""corewire's clients and engines, both with ``release="0.33.0"``, end to end.

A client of protocol 0.33.0 starts its engines with that protocol: requests (0.25.1's
struct, converted, or 0.33.0's) go out in 0.33.0's layout, the engines read them, and
their outputs (with ``weight_version``) come back in it. The async, sync and DP clients;
a request the engine refuses finishes with ERROR and leaves no trace in the DP client's
in-flight tracking. Runs in either environment (no vLLM involved).
"""

from __future__ import annotations

import asyncio
from typing import Any

from client_support import request
from corewire import AsyncMPClient, DPLBAsyncMPClient, SyncMPClient
from corewire.protocol import FinishReason
from corewire.wire import layouts

SYNTHETIC = "corewire.engine.synthetic:SyntheticEngine"
V33 = layouts.types_for("0.33.0")


def _request_0_33_0(request_id: str, max_tokens: int) -> Any:
    """The same request as ``client_support.request`` would build, in 0.33.0's struct."""
    old = request(request_id, max_tokens=max_tokens)
    sampling = V33["SamplingParams"](
        **{
            name: getattr(old.sampling_params, name)
            for name in old.sampling_params.__struct_fields__
        }
    )
    return V33["EngineCoreRequest"](
        request_id=request_id,
        prompt_token_ids=list(old.prompt_token_ids),
        sampling_params=sampling,
        session_id="s-1",  # 0.33.0 only: read by the engine, which ignores it
    )


async def _until_finished(client: Any, ids: set[str]) -> dict[str, Any]:
    """Every output of ``ids`` until each finished: id -> (tokens, finish, messages)."""
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    finish: dict[str, Any] = {}
    versions = set()
    while len(finish) < len(ids):
        outputs = await asyncio.wait_for(client.get_output_async(), 30)
        versions.add(outputs.weight_version)
        for out in outputs.outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    return {"tokens": tokens, "finish": finish, "weight_versions": versions}


async def test_async_client_and_engine_speak_0_33_0() -> None:
    client = AsyncMPClient(engine=SYNTHETIC, release="0.33.0")
    try:
        await client.add_request_async(request("old", max_tokens=3))
        await client.add_request_async(_request_0_33_0("new", max_tokens=3))
        got = await _until_finished(client, {"old", "new"})
        assert got["finish"] == {"old": FinishReason.LENGTH, "new": FinishReason.LENGTH}
        # The same prompt gives the same tokens, whichever struct the caller used.
        assert got["tokens"]["old"] == got["tokens"]["new"] and len(got["tokens"]["old"]) == 3
        # 0.33.0's engine stamps weight_version on step messages.
        assert got["weight_versions"] == {"default"}
        assert await client.call_utility_async("is_sleeping") is False
        assert client.engine_status == {}  # fault tolerance is off: no status pushed
    finally:
        client.shutdown()


def test_sync_client_and_engine_speak_0_33_0() -> None:
    client = SyncMPClient(engine=SYNTHETIC, release="0.33.0")
    try:
        client.add_request(request("s", max_tokens=2))
        tokens: list[int] = []
        while True:
            outputs = client.get_output(timeout=30)
            for out in outputs.outputs:
                tokens += out.new_token_ids
                last = out
            if outputs.outputs and last.finish_reason is not None:
                break
        assert len(tokens) == 2 and last.finish_reason == FinishReason.LENGTH
        assert outputs.weight_version == "default"
        assert client.ft_status_dropped == 0
    finally:
        client.shutdown()


async def test_dplb_client_and_engines_speak_0_33_0() -> None:
    client = DPLBAsyncMPClient(data_parallel_size=2, engine=SYNTHETIC, release="0.33.0")
    try:
        ids = {f"r{i}" for i in range(6)}
        for rid in sorted(ids):
            await client.add_request_async(request(rid, max_tokens=3))
        # A prompt over the engine's limit: refused with ERROR, finished like the others.
        await client.add_request_async(
            request("too-long", max_tokens=2, prompt=range(1, 100_000), rank=1)
        )
        got = await _until_finished(client, ids | {"too-long"})
        assert got["finish"].pop("too-long") == FinishReason.ERROR
        assert set(got["finish"].values()) == {FinishReason.LENGTH}
        assert sorted(client.router.in_flight()) == [0, 0]
        assert client.reqs_in_flight == {}
        # No first-request notices under 0.33.0: the engines started the wave themselves,
        # and the coordinator ended it once the group went idle.
        deadline = asyncio.get_running_loop().time() + 10
        while client.dp_engines_running() or client.current_wave == 0:
            assert asyncio.get_running_loop().time() < deadline, (
                client.current_wave,
                client.dp_engines_running(),
            )
            await asyncio.sleep(0.02)
    finally:
        client.shutdown()
