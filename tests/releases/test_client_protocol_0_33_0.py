"""The clients with ``release="0.33.0"``, both ways, against raw engine peers (real sockets).

The frames the engines "send" here are vLLM 0.33.0's own (``tests/data/vllm-0.33.0``,
written by its ``MsgpackEncoder``), and what the clients send is compared byte for byte
with vLLM 0.33.0's own requests from the same place; ``test_vllm_0_33_0_client.py`` does
the same live against an installed vLLM 0.33.0. Runs in either environment.

- requests: a 0.25.1 ``EngineCoreRequest`` (converted) or a 0.33.0 one goes out in
  0.33.0's layout (LoRA included, and ``add_lora``'s argument); a 0.25.1 client is as
  before;
- call id -2: the async clients keep each engine's latest status and never complete a
  call with one; the sync client drops and counts it;
- the ``error`` field reaches the caller, and the DP client forgets the failed request;
- DP: both count shapes parse; no first-request notice under 0.33.0; vLLM 0.33.0's
  KV-pressure routing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from client_wire_support import CoordinatorPeer, EnginePeer, client_addresses, client_and_peer
from corewire import AsyncMPClient, DPAsyncMPClient, DPLBAsyncMPClient, SyncMPClient
from corewire import protocol as p
from corewire.codec import Encoder, request_decoder
from corewire.protocol import FinishReason, UtilityOutput, UtilityResult
from corewire.wire import layouts
from corewire.wire.requests import to_0_33_0
from dp_support import Sockets, coordinator_addresses, wait_for
from golden_0_33_0_requests_support import expected_requests, request_frames
from golden_0_33_0_support import DATA

V33 = layouts.types_for("0.33.0")


def golden_output(case: str) -> list[bytes]:
    """An output message vLLM 0.33.0's encoder wrote (``tests/data/vllm-0.33.0``)."""
    return [(DATA / f"{case}.0.bin").read_bytes()]


def encode_0_33_0(outputs: Any) -> list[bytes]:
    return [bytes(f) for f in Encoder(release="0.33.0").encode(outputs)]


def status_frames(engine: int, status: dict[str, Any]) -> list[bytes]:
    """A call id -2 message as vLLM 0.33.0's engine writes it (same layout)."""
    utility = UtilityOutput(call_id=layouts.FT_STATUS_CALL_ID, result=UtilityResult(status))
    return encode_0_33_0(V33["EngineCoreOutputs"](engine_index=engine, utility_output=utility))


def reply_frames(call_id: int, value: Any, engine: int = 0) -> list[bytes]:
    utility = UtilityOutput(call_id=call_id, result=UtilityResult(value))
    return encode_0_33_0(V33["EngineCoreOutputs"](engine_index=engine, utility_output=utility))


@pytest.fixture
def sockets() -> Iterator[Sockets]:
    s = Sockets()
    yield s
    s.close()


# -- requests ------------------------------------------------------------------------


def _sampling(**kw: Any) -> p.SamplingParams:
    return p.SamplingParams(**kw)


def _request_0_25_1(rid: str, **kw: Any) -> p.EngineCoreRequest:
    """corewire's 0.25.1 request built as make_golden_requests.py builds vLLM's."""
    fields: dict[str, Any] = {"prompt_token_ids": [1, 2, 3, 4], "arrival_time": 1234.5}
    fields.update(kw)
    return p.EngineCoreRequest(request_id=rid, **fields)


#: The golden cases a 0.25.1 struct can express (0.33.0's new fields at their defaults).
OLD_STRUCT_CASES = {
    "plain": lambda: _request_0_25_1("req-0", sampling_params=_sampling()),
    "lora": lambda: _request_0_25_1(
        "req-lora",
        sampling_params=_sampling(max_tokens=3),
        lora_request=layouts.LoRARequest(
            "adapter", 3, "/adapters/a", "base", None, load_inplace=True, is_3d_lora_weight=True
        ),
    ),
    "prompt_embeds": lambda: _request_0_25_1(
        "req-emb",
        prompt_token_ids=None,
        sampling_params=_sampling(max_tokens=2),
        prompt_embeds=torch.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16),
    ),
    "prompt_embeds_mixed": lambda: _request_0_25_1(
        "req-mix",
        prompt_token_ids=[1, 0, 3],
        sampling_params=_sampling(max_tokens=2),
        prompt_embeds=torch.ones(3, 4, dtype=torch.float16),
        prompt_is_token_ids=[True, False, True],
        resumable=True,
        reasoning_ended=False,
        abort_immediately=True,
    ),
}


async def test_async_client_writes_0_33_0_requests(ipc_dir: Path, sockets: Sockets) -> None:
    with client_and_peer(ipc_dir, sockets, AsyncMPClient, release="0.33.0") as (client, peer):
        # A 0.25.1 struct: converted once, by field name (the caller's object untouched).
        for case, build in OLD_STRUCT_CASES.items():
            request = build()
            await client.add_request_async(request)
            assert type(request) is p.EngineCoreRequest
            assert peer.recv_add() == request_frames(case), case
        # A 0.33.0 struct: written as is (vLLM's own golden requests, decoded).
        for case in sorted(expected_requests()):
            request = request_decoder("0.33.0").decode(request_frames(case))
            if request.client_index != client.client_index:
                continue  # stamped by the client: covered by the sync test below
            await client.add_request_async(request)
            assert peer.recv_add() == request_frames(case), case


def test_sync_client_writes_0_33_0_requests(ipc_dir: Path, sockets: Sockets) -> None:
    # openai_default was sent by client 1.
    with client_and_peer(ipc_dir, sockets, SyncMPClient, release="0.33.0", client_index=1) as (
        client,
        peer,
    ):
        request = request_decoder("0.33.0").decode(request_frames("openai_default"))
        client.add_request(request)
        assert peer.recv_add() == request_frames("openai_default")
        request = OLD_STRUCT_CASES["plain"]()
        client.add_request(request)
        want = request_decoder("0.33.0").decode(request_frames("plain"))
        want.client_index = 1
        assert peer.recv_add() == encode_0_33_0(want)


def test_sampling_params_whose_bytes_differ_are_rebuilt_as_0_33_0s() -> None:
    """routed_experts_prompt_start moved in 0.33.0's map, and 0.33.0 drops repeated stop
    token ids and bad words: such params are rebuilt, not written as 0.25.1's."""
    cases = [
        _sampling(routed_experts_prompt_start=3, seed=7),
        _sampling(stop_token_ids=[2, 2, 3]),
        _sampling(bad_words=["x", "x", "y"]),
        _sampling(temperature=0.5, stop=["a"], logprobs=2),
    ]
    for sampling in cases:
        old = p.EngineCoreRequest(request_id="r", sampling_params=sampling)
        new = to_0_33_0(old)
        # What 0.33.0's struct built from the same fields writes (its normalisations ran).
        fields = msgspec.structs.asdict(sampling)
        want = V33["EngineCoreRequest"](
            request_id="r", sampling_params=V33["SamplingParams"](**fields)
        )
        assert encode_0_33_0(new) == encode_0_33_0(want)
        # and it reads back as 0.33.0's, with the same values
        back = request_decoder("0.33.0").decode(encode_0_33_0(new))
        assert back.sampling_params == want.sampling_params
    moved = to_0_33_0(p.EngineCoreRequest(request_id="r", sampling_params=cases[0]))
    payload = encode_0_33_0(moved)[0]
    keys = list(msgspec.msgpack.decode(payload)[3])
    assert keys.index("routed_experts_prompt_start") > keys.index("seed")
    deduped = to_0_33_0(p.EngineCoreRequest(request_id="r", sampling_params=cases[1]))
    assert deduped.sampling_params.stop_token_ids == [2, 3]
    # The caller's own params are not changed.
    assert cases[1].stop_token_ids == [2, 2, 3]


async def test_add_lora_and_lora_refusals(ipc_dir: Path, sockets: Sockets) -> None:
    with client_and_peer(ipc_dir, sockets, AsyncMPClient, release="0.33.0") as (client, peer):
        lora = layouts.LoRARequest("a", 1, "/p")
        call = asyncio.ensure_future(client.add_lora_async(lora))
        _, call_id, method, args = await asyncio.to_thread(peer.recv_utility)
        assert method == "add_lora"
        # vLLM 0.33.0's LoRARequest("a", 1, "/p"): 6 fields (notes §2.11)
        assert msgspec.msgpack.encode(args[0]) == bytes.fromhex("96a16101a22f70c0c2c2")
        peer.send(reply_frames(call_id, True))
        assert await call is True
        # A LoRA 0.33.0 has no place for is refused before anything is sent.
        with pytest.raises(ValueError, match="tensorizer_config_dict"):
            await client.add_lora_async(layouts.LoRARequest("a", 1, "/p", None, {"x": 1}))
        bad = OLD_STRUCT_CASES["plain"]()
        bad.lora_request = ["a", 1, "/p", None, {"x": 1}, False, False]  # as decoded
        with pytest.raises(ValueError, match="tensorizer_config_dict"):
            await client.add_request_async(bad)
        assert peer.nothing_for(0.2)
        # Anything but corewire's 0.25.1 structs goes as given (vLLM's own, under the
        # plugin): for the encoder to write, or refuse.
        other = p.SamplingParams()
        assert to_0_33_0(other) is other
        with pytest.raises(TypeError, match="cannot be sent"):
            await client.add_request_async(p.SamplingParams(max_tokens=1))  # type: ignore[arg-type]


async def test_a_0_25_1_client_is_unchanged(ipc_dir: Path, sockets: Sockets) -> None:
    with client_and_peer(ipc_dir, sockets, AsyncMPClient) as (client, peer):
        request = OLD_STRUCT_CASES["plain"]()
        await client.add_request_async(request)
        frames = peer.recv_add()
        assert frames == [bytes(f) for f in Encoder().encode(request)]
        assert frames[0][:3] == b"\xdc\x00\x14"  # 20 fields
        with pytest.raises(TypeError, match=r"0\.33\.0"):
            await client.add_request_async(V33["EngineCoreRequest"](request_id="new"))
        lora = layouts.LoRARequest("a", 1, "/p")
        call = asyncio.ensure_future(client.add_lora_async(lora))
        _, call_id, _, args = await asyncio.to_thread(peer.recv_utility)
        assert len(args[0]) == 7  # 0.25.1's layout
        peer.send(reply_frames(call_id, True))
        assert await call is True


# -- call id -2 -------------------------------------------------------------------------


async def test_async_client_keeps_each_engines_status(ipc_dir: Path, sockets: Sockets) -> None:
    with client_and_peer(ipc_dir, sockets, AsyncMPClient, release="0.33.0") as (client, peer):
        assert client.engine_status == {}
        call = asyncio.ensure_future(client.call_utility_async("is_sleeping"))
        _, call_id, _, _ = await asyncio.to_thread(peer.recv_utility)
        # Statuses arrive while the call waits: they never complete it.
        peer.send(golden_output("ft_status"))  # engine 1 healthy, vLLM's own bytes
        unhealthy = {"id": 0, "status": "unhealthy", "fault_info": "RuntimeError"}
        peer.send(status_frames(0, unhealthy))
        await wait_for_async(lambda: len(client.engine_status) == 2)
        assert client.engine_status == {1: {"id": 1, "status": "healthy"}, 0: unhealthy}
        assert not call.done()
        assert layouts.EngineStatusType.from_wire(client.engine_status[0]["status"]) is (
            layouts.EngineStatusType.UNHEALTHY
        )
        # The latest replaces the whole map.
        peer.send(status_frames(0, {"id": 0, "status": "healthy"}))
        await wait_for_async(lambda: client.engine_status[0]["status"] == "healthy")
        assert "fault_info" not in client.engine_status[0]
        peer.send(reply_frames(call_id, False))
        assert await call is False
        # A status without a result, or one that is not a map, changes nothing.
        nothing = UtilityOutput(call_id=layouts.FT_STATUS_CALL_ID)
        peer.send(encode_0_33_0(V33["EngineCoreOutputs"](engine_index=0, utility_output=nothing)))
        peer.send(status_frames(0, ["not", "a", "map"]))  # type: ignore[arg-type]
        peer.send(status_frames(3, {"id": 3, "status": "dead"}))
        await wait_for_async(lambda: 3 in client.engine_status)
        assert client.engine_status[0] == {"id": 0, "status": "healthy"}
        assert not client.engine_dead


async def test_the_watchdog_spares_an_engine_in_fault_handling_and_finds_a_hung_one(
    ipc_dir: Path, sockets: Sockets
) -> None:
    """An engine that says it is unhealthy waits for an orchestrator's instruction and
    answers nothing else (vLLM's fault tolerance): the watchdog sends it no health check
    and never declares it dead. Once it says it is healthy again, silence is a hang."""
    watchdog = {"health_check_interval": 0.1, "health_check_timeout": 0.3}
    with client_and_peer(ipc_dir, sockets, AsyncMPClient, release="0.33.0", **watchdog) as (
        client,
        peer,
    ):
        peer.send(status_frames(0, {"id": 0, "status": "unhealthy", "fault_info": "Boom"}))
        await wait_for_async(lambda: client.engine_status.get(0, {}).get("status") == "unhealthy")
        # A check sent before the status arrived may still come in: take it, answer
        # nothing. After that none comes, over many intervals and timeouts.
        await asyncio.to_thread(peer.nothing_for, 0.3)
        while not await asyncio.to_thread(peer.nothing_for, 0.5):
            await asyncio.to_thread(peer.recv)
        await asyncio.to_thread(peer.nothing_for, 1.5)
        assert not client.engine_dead
        await client.check_health_async(0.3)  # asked directly: not dead either
        # Healthy again, and silent: found, as any hung engine.
        peer.send(status_frames(0, {"id": 0, "status": "healthy"}))
        await asyncio.to_thread(peer.recv_utility)  # the watchdog probes it again
        await wait_for_async(lambda: client.engine_dead)
        assert "did not answer a health check" in client.resources.dead_reason


def test_sync_client_drops_and_counts_statuses(
    ipc_dir: Path, sockets: Sockets, caplog: pytest.LogCaptureFixture
) -> None:
    with client_and_peer(ipc_dir, sockets, SyncMPClient, release="0.33.0") as (client, peer):
        with caplog.at_level(logging.WARNING, logger="corewire.client"):
            peer.send(golden_output("ft_status"))
            peer.send(status_frames(0, {"id": 0, "status": "unhealthy", "fault_info": "E"}))
            wait_for(lambda: client.ft_status_dropped == 2, what="two dropped statuses")
        logged = [r for r in caplog.records if "call id -2" in r.getMessage()]
        assert len(logged) == 1  # once, not per message
        # The client goes on: a call made now is answered, nothing was queued as output.
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(client.call_utility("echo", 1)))
        thread.start()
        _, call_id, _, _ = peer.recv_utility()
        peer.send(reply_frames(call_id, 1))
        thread.join(10)
        assert result == [1]
        assert client.outputs_queue.empty()
        assert not client.engine_dead


async def wait_for_async(predicate: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


# -- the error field ------------------------------------------------------------------


async def test_request_error_reaches_the_caller(ipc_dir: Path, sockets: Sockets) -> None:
    with client_and_peer(ipc_dir, sockets, AsyncMPClient, release="0.33.0") as (client, peer):
        await client.add_request_async(_request_0_25_1("req-err"))
        peer.recv_add()
        peer.send(golden_output("error"))
        outputs = await asyncio.wait_for(client.get_output_async(), 10)
        (out,) = outputs.outputs
        assert out.request_id == "req-err"
        assert out.finish_reason == FinishReason.ERROR
        assert isinstance(out.error, layouts.RequestError)
        assert out.error.code == "engine_paused"
        assert out.error.message.startswith("Generation is paused")
        assert out.error.retryable is True
        assert outputs.finished_requests == {"req-err"}
        assert outputs.weight_version is None
        peer.send(golden_output("error_validation"))
        (bad,) = (await asyncio.wait_for(client.get_output_async(), 10)).outputs
        assert (bad.error.code, bad.error.retryable) == ("validation_error", False)


# -- data parallel --------------------------------------------------------------------


def _publication(counts: Any, wave: int = 0, running: bool = False) -> bytes:
    # vLLM 0.33.0's coordinator: msgspec.msgpack.encode((counts, wave, running))
    return msgspec.msgpack.encode((counts, wave, running))


def _dplb(ipc_dir: Path, sockets: Sockets, release: str, size: int = 2) -> Any:
    addresses = client_addresses(ipc_dir)
    peers = [EnginePeer(sockets, addresses, i) for i in range(size)]
    coordinator = CoordinatorPeer(sockets, coordinator_addresses(ipc_dir))
    client = DPLBAsyncMPClient(
        data_parallel_size=size,
        client_addresses=addresses,
        coordinator_addresses=coordinator_addresses(ipc_dir),
        release=release,
        ready_timeout=10,
    )
    return client, peers, coordinator


async def _publish_and_wait(client: Any, coordinator: CoordinatorPeer, counts: Any) -> None:
    client._ensure_stats_update_task()
    await asyncio.to_thread(coordinator.wait_subscribed)
    coordinator.publish(_publication(counts))
    await wait_for_async(lambda: client.lb_engines == counts)


@pytest.mark.parametrize("release", ["0.25.1", "0.33.0"])
async def test_dp_first_request_notices(ipc_dir: Path, sockets: Sockets, release: str) -> None:
    """0.25.1: a request while paused sends ``[engine, wave]``; 0.33.0: nothing (its
    coordinator logs an error for it: the engines start waves)."""
    addresses = client_addresses(ipc_dir)
    peer = EnginePeer(sockets, addresses, 0)
    coordinator = CoordinatorPeer(sockets, coordinator_addresses(ipc_dir))
    client = DPAsyncMPClient(
        data_parallel_size=2,
        data_parallel_rank=0,
        client_addresses=addresses,
        coordinator_addresses=coordinator_addresses(ipc_dir),
        release=release,
        ready_timeout=10,
    )
    try:
        await client.add_request_async(_request_0_25_1("r1", current_wave=0))
        frames = peer.recv_add()
        assert frames[0][:3] == (b"\xdc\x00\x16" if release == "0.33.0" else b"\xdc\x00\x14")
        await asyncio.to_thread(coordinator.wait_subscribed)
        sent = await asyncio.to_thread(coordinator.messages)
        if release == "0.33.0":
            assert sent == []
        else:
            assert [msgspec.msgpack.decode(m) for m in sent] == [[0, 0]]
    finally:
        client.shutdown()


@pytest.mark.parametrize(
    "counts",
    [
        [[2, 1], [0, 3]],  # vLLM 0.25.1 / corewire's coordinator
        [[2, 1, 0.25], [0, 3, 0.0]],  # vLLM 0.33.0's coordinator
    ],
)
@pytest.mark.parametrize("release", ["0.25.1", "0.33.0"])
async def test_dp_counts_of_either_shape_parse(
    ipc_dir: Path, sockets: Sockets, release: str, counts: Any
) -> None:
    client, _, coordinator = _dplb(ipc_dir, sockets, release)
    try:
        await _publish_and_wait(client, coordinator, counts)
        assert client.router.counts() == [(2, 1), (0, 3)]  # kv usage <= 0.5: no penalty
        # The publication vLLM 0.33.0's coordinator was seen writing (notes §5.3).
        coordinator.publish(
            bytes.fromhex("9392930201cb3fd0000000000000930000cb000000000000000000c2")
        )
        await wait_for_async(lambda: client.lb_engines == [[2, 1, 0.25], [0, 0, 0.0]])
        # Malformed ones are ignored, with a warning; the last good counts stay.
        coordinator.publish(_publication([[1.5, 1]]))
        coordinator.publish(_publication([[1, 1, 0.5, 9]]))
        coordinator.publish(_publication([[4, 4, 0.1], [4, 4, 0.1]], wave=3))
        await wait_for_async(lambda: client.current_wave == 3)
        assert client.lb_engines == [[4, 4, 0.1], [4, 4, 0.1]]
    finally:
        client.shutdown()


async def test_dplb_pins_late_interaction_requests_whatever_the_load(
    ipc_dir: Path, sockets: Sockets
) -> None:
    """A late-interaction request goes to ``crc32(query_key) % engines`` (vLLM's pin),
    even to the busier engine; requests without one go by load."""
    client, peers, coordinator = _dplb(ipc_dir, sockets, "0.25.1")
    try:
        await _publish_and_wait(client, coordinator, [[9, 9], [0, 0]])
        keys = {zlib.crc32(k.encode()) % 2: k for k in ("alpha", "beta", "gamma", "delta")}
        for mode in ("cache_query", "score_doc"):
            pooling = p.PoolingParams(late_interaction_params=[mode, keys[0], 1])
            await client.add_request_async(_request_0_25_1(f"li-{mode}", pooling_params=pooling))
            assert client.reqs_in_flight[f"li-{mode}"] == 0
            peers[0].recv_add()
        await client.add_request_async(_request_0_25_1("plain"))
        assert client.reqs_in_flight["plain"] == 1
        peers[1].recv_add()
    finally:
        client.shutdown()


async def test_hybrid_balancing_routes_over_the_nodes_own_ranks(
    ipc_dir: Path, sockets: Sockets
) -> None:
    """One front-end per node (vLLM's --data-parallel-hybrid-lb): this one drives ranks
    2 and 3 of four, reads their slice of the coordinator's counts, routes by it, and
    sends aborts to the engine holding each request."""
    addresses = client_addresses(ipc_dir)
    peers = {i: EnginePeer(sockets, addresses, i) for i in (2, 3)}
    coordinator = CoordinatorPeer(sockets, coordinator_addresses(ipc_dir))
    client = DPLBAsyncMPClient(
        data_parallel_size=4,
        engine_indices=[2, 3],
        client_addresses=addresses,
        coordinator_addresses=coordinator_addresses(ipc_dir),
        ready_timeout=10,
    )
    try:
        # Ranks 0 and 1 (the other node) are busy; of this node's, rank 2 is.
        client._ensure_stats_update_task()
        await asyncio.to_thread(coordinator.wait_subscribed)
        coordinator.publish(_publication([[9, 9], [9, 9], [0, 5], [0, 0]]))
        await wait_for_async(lambda: client.lb_engines == [[0, 5], [0, 0]])
        assert client.router.counts() == [(0, 5), (0, 0)]
        for rid in ("a", "b", "c"):
            await client.add_request_async(_request_0_25_1(rid))
        assert client.reqs_in_flight == {"a": 1, "b": 1, "c": 1}  # positions: rank 3
        for _ in range(3):
            peers[3].recv_add()
        assert peers[2].nothing_for(0.2)
        await client.abort_requests_async(["b"])
        frames = await asyncio.to_thread(peers[3].recv)
        assert frames[0] == b"\x01" and msgspec.msgpack.decode(frames[1]) == ["b"]
        with pytest.raises(ValueError, match="rank 0"):
            await client.scale_elastic_ep(3)
    finally:
        client.shutdown()


async def test_dplb_follows_vllm_0_33_0s_kv_pressure_rule(ipc_dir: Path, sockets: Sockets) -> None:
    """Engine 0 has fewer requests, but its KV cache is 90 % full: 2 waiting there weigh
    2 + 2*6*0.4 = 6.8 > 3, so the request goes to engine 1 (0.33.0) / engine 0 (0.25.1)."""
    for release, want in (("0.33.0", 1), ("0.25.1", 0)):
        client, peers, coordinator = _dplb(ipc_dir / release, sockets, release)
        try:
            await _publish_and_wait(client, coordinator, [[2, 0, 0.9], [3, 0, 0.1]])
            await client.add_request_async(_request_0_25_1(f"kv-{release}"))
            assert client.reqs_in_flight == {f"kv-{release}": want}
            peers[want].recv_add()
        finally:
            client.shutdown()


async def test_dplb_forgets_a_request_that_failed_with_an_error(
    ipc_dir: Path, sockets: Sockets
) -> None:
    client, peers, _ = _dplb(ipc_dir, sockets, "0.33.0")
    try:
        await client.add_request_async(_request_0_25_1("req-err", data_parallel_rank=1))
        peers[1].recv_add()
        assert client.reqs_in_flight == {"req-err": 1}
        assert client.router.in_flight() == [0, 1]
        peers[1].send(golden_output("error"))
        outputs = await asyncio.wait_for(client.get_output_async(), 10)
        assert outputs.outputs[0].error.code == "engine_paused"
        assert client.reqs_in_flight == {}
        assert client.router.in_flight() == [0, 0]
        # An abort for it now goes nowhere: it is finished.
        await client.abort_requests_async(["req-err"])
        assert peers[1].nothing_for(0.2)
    finally:
        client.shutdown()


@pytest.fixture
def ipc_dir(ipc_dir: Path) -> Path:
    """The private directory, with one subdirectory per protocol (two clients in a test)."""
    for sub in ("0.25.1", "0.33.0"):
        (ipc_dir / sub).mkdir(mode=0o700)
    return ipc_dir


@pytest.mark.parametrize("release", ["0.25.1", "0.33.0"])
async def test_dplb_streaming_session_affinity(
    ipc_dir: Path, sockets: Sockets, release: str
) -> None:
    """0.33.0: the next input of a session in flight goes to the engine holding it (even
    against its ``data_parallel_rank``), and aborting the session reaches every engine.
    0.25.1: routed afresh, aborted where it was last routed."""
    client, peers, _ = _dplb(ipc_dir, sockets, release)
    try:
        await client.add_request_async(
            _request_0_25_1("sess", resumable=True, data_parallel_rank=1)
        )
        peers[1].recv_add()
        await client.add_request_async(
            _request_0_25_1("sess", resumable=True, data_parallel_rank=0)
        )
        second = 1 if release == "0.33.0" else 0
        peers[second].recv_add()
        assert client.reqs_in_flight["sess"] == second
        assert client.streaming_reqs == ({"sess"} if release == "0.33.0" else set())
        await client.abort_requests_async(["sess"])
        aborted_on = [0, 1] if release == "0.33.0" else [0]
        for index in aborted_on:
            frames = peers[index].recv()
            assert frames[0] == p.REQUEST_ABORT
            assert msgspec.msgpack.decode(frames[1]) == ["sess"]
        assert all(peer.nothing_for(0.1) for peer in peers)
        assert client.streaming_reqs == set()
        # A final (not resumable) input closes the session: its abort goes one way only.
        await client.add_request_async(_request_0_25_1("s2", resumable=True, data_parallel_rank=0))
        await client.add_request_async(_request_0_25_1("s2", data_parallel_rank=0))
        assert client.streaming_reqs == set()
    finally:
        client.shutdown()


def test_outputs_the_dp_client_makes_are_in_its_version() -> None:
    """A scale-down finishes a removed engine's requests client-side: under 0.33.0 the
    consumer gets 0.33.0's structs (it reads weight_version, error...), converted as the
    DP client converts them, by the engines' own output converter."""
    from corewire.wire.outputs import output_converter

    made = p.finished_outputs(["a", "b"], FinishReason.ABORT, engine_index=2)
    converted = output_converter("0.33.0")(made)
    assert type(converted) is V33["EngineCoreOutputs"]
    assert converted.weight_version is None
    assert [type(o) for o in converted.outputs] == [V33["EngineCoreOutput"]] * 2
    assert [(o.request_id, o.finish_reason, o.error) for o in converted.outputs] == [
        ("a", FinishReason.ABORT, None),
        ("b", FinishReason.ABORT, None),
    ]
    assert (converted.engine_index, converted.finished_requests) == (2, {"a", "b"})
    assert converted.timestamp == made.timestamp
