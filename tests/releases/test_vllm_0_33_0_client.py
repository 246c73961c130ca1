"""corewire's clients with ``release=RELEASE`` against vLLM 0.33.0 itself (runs only there).

Real clients, real sockets, a raw engine peer (``client_wire_support``) in the middle:

- what the clients send is compared byte for byte with what vLLM 0.33.0's
  ``MsgpackEncoder`` writes for the same request (built with vLLM's own classes from the
  same arguments), whether the caller passed corewire's 0.25.1 ``EngineCoreRequest``
  (converted) or 0.33.0's, and vLLM 0.33.0's ``MsgpackDecoder`` reads it back;
- what the peer sends was written by vLLM 0.33.0's encoder, as its engine writes it: the
  fault-tolerance status (call id -2, built as ``EngineCoreSentinel._push_status``
  builds it) and a failed request's ``RequestError``; the clients handle both as vLLM
  0.33.0's ``AsyncMPClient`` does (the sync client drops statuses, where vLLM's fails).

With vLLM 0.25.1 (the main environment) it is skipped; ``test_client_protocol_0_33_0.py``
covers the same ground there with vLLM 0.33.0's golden frames.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from vllm_0_33_0_gate import RELEASE, as_the_client_sends, require_vllm_0_33_0

vllm = require_vllm_0_33_0()

import torch  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.pooling_params import PoolingParams  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1 import engine as E  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from client_wire_support import EnginePeer, client_addresses, client_and_peer  # noqa: E402
from corewire import (  # noqa: E402
    AsyncMPClient,
    DPAsyncMPClient,
    DPLBAsyncMPClient,
    SyncMPClient,
    releases,
)
from corewire import protocol as p  # noqa: E402
from corewire.codec import request_decoder  # noqa: E402
from corewire.protocol import FinishReason  # noqa: E402
from corewire.wire import layouts  # noqa: E402
from dp_support import Sockets, coordinator_addresses, wait_for  # noqa: E402

ENCODER = MsgpackEncoder()


def vllm_frames(obj: Any) -> list[bytes]:
    return [bytes(f) for f in ENCODER.encode(obj)]


@pytest.fixture
def sockets() -> Iterator[Sockets]:
    s = Sockets()
    yield s
    s.close()


# -- requests: the same request built by vLLM 0.33.0 and by corewire (0.25.1's struct) ---

_COMMON: dict[str, Any] = {"prompt_token_ids": [5, 6, 7], "arrival_time": 99.5}


def _vllm(rid: str, **kw: Any) -> E.EngineCoreRequest:
    fields: dict[str, Any] = {
        "request_id": rid,
        "mm_features": None,
        "sampling_params": None,
        "pooling_params": None,
        "lora_request": None,
        "cache_salt": None,
        "data_parallel_rank": None,
        **_COMMON,
    }
    fields.update(kw)
    return E.EngineCoreRequest(**fields)


def _corewire(rid: str, **kw: Any) -> p.EngineCoreRequest:
    return p.EngineCoreRequest(request_id=rid, **{**_COMMON, **kw})


def _routed(params: Any) -> Any:
    params.routed_experts_prompt_start = 4  # moved in 0.33.0's map
    return params


SAMPLING_ARGS: dict[str, dict[str, Any]] = {
    "default": {},
    "greedy": {"temperature": 0.0, "max_tokens": 5},
    "sampled": {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 3, "max_tokens": 8},
    "stops": {"stop": ["x", "yz"], "stop_token_ids": [2, 2, 3], "bad_words": ["a", "a"]},
    "logprobs": {"logprobs": 2, "prompt_logprobs": 1, "min_tokens": 1},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.1, "repetition_penalty": 1.1},
}

#: name -> (vLLM's request, corewire's 0.25.1 request), the same arguments.
# The request fields both types spell alike (no nested structs).
_FIELDS: dict[str, Any] = {
    "cache_salt": "s",
    "data_parallel_rank": 0,
    "priority": 3,
    "trace_headers": {"a": "b"},
    "external_req_id": "ext",
    "resumable": True,
    "reasoning_ended": True,
}
CASES: dict[str, Callable[[], tuple[Any, Any]]] = {
    **{
        f"sampling-{name}": (
            lambda kw=kw, name=name: (
                _vllm(name, sampling_params=SamplingParams(**kw)),
                _corewire(name, sampling_params=p.SamplingParams(**kw)),
            )
        )
        for name, kw in SAMPLING_ARGS.items()
    },
    "routed-experts": lambda: (
        _vllm("re", sampling_params=_routed(SamplingParams(max_tokens=2))),
        _corewire("re", sampling_params=_routed(p.SamplingParams(max_tokens=2))),
    ),
    "fields": lambda: (
        _vllm("f", sampling_params=SamplingParams(), **_FIELDS),
        _corewire("f", sampling_params=p.SamplingParams(), **_FIELDS),
    ),
    "pooling": lambda: (
        _vllm("pool", pooling_params=PoolingParams(task="embed", dimensions=8)),
        _corewire("pool", pooling_params=p.PoolingParams(task="embed", dimensions=8)),
    ),
    "lora": lambda: (
        _vllm("l", sampling_params=SamplingParams(), lora_request=LoRARequest("a", 2, "/p")),
        _corewire(
            "l", sampling_params=p.SamplingParams(), lora_request=layouts.LoRARequest("a", 2, "/p")
        ),
    ),
    "embeds-aux": lambda: (
        _vllm("e", prompt_token_ids=None, prompt_embeds=torch.arange(96.0).reshape(8, 12)),
        _corewire("e", prompt_token_ids=None, prompt_embeds=torch.arange(96.0).reshape(8, 12)),
    ),
}


def _read_back(frames: list[bytes]) -> E.EngineCoreRequest:
    # Writable copies: torch warns about read-only buffers (as vLLM's zmq frames are not).
    return MsgpackDecoder(E.EngineCoreRequest).decode([bytearray(f) for f in frames])


async def test_async_client_requests_are_vllm_0_33_0s(ipc_dir: Path, sockets: Sockets) -> None:
    with client_and_peer(ipc_dir, sockets, AsyncMPClient, release=RELEASE) as (client, peer):
        for name, build in CASES.items():
            theirs, ours = build()
            want = vllm_frames(as_the_client_sends(theirs))
            # corewire's 0.25.1 struct, converted by the client
            await client.add_request_async(ours)
            got = peer.recv_add()
            assert got == want, name
            assert vllm_frames(_read_back(got)) == want, name
            # 0.33.0's struct, as vLLM's decoder on the engine side would hand it over
            typed = request_decoder(RELEASE).decode(want)
            await client.add_request_async(typed)
            assert peer.recv_add() == want, name
            # vLLM's own request object, as vLLM's AsyncLLM hands it to the plugin's client
            await client.add_request_async(theirs)
            assert peer.recv_add() == want, name


def test_sync_client_requests_are_vllm_0_33_0s(ipc_dir: Path, sockets: Sockets) -> None:
    with client_and_peer(ipc_dir, sockets, SyncMPClient, release=RELEASE, client_index=2) as (
        client,
        peer,
    ):
        for name in ("sampling-stops", "lora", "embeds-aux"):
            theirs, ours = CASES[name]()
            theirs.client_index = 2  # vLLM's client stamps it too
            client.add_request(ours)
            got = peer.recv_add()
            assert got == vllm_frames(as_the_client_sends(theirs)), name
            assert _read_back(got).client_index == 2


async def test_add_lora_argument_reads_as_vllm_0_33_0s(ipc_dir: Path, sockets: Sockets) -> None:
    with client_and_peer(ipc_dir, sockets, AsyncMPClient, release=RELEASE) as (client, peer):
        call = asyncio.ensure_future(
            client.add_lora_async(layouts.LoRARequest("a", 2, "/p", "base", None, True))
        )
        frames = await asyncio.to_thread(peer.recv)
        # vLLM's engine decodes a utility call untyped, then the LoRA with its own type.
        _, call_id, method, args = msgspec.msgpack.decode(frames[1])
        assert method == "add_lora"
        lora = msgspec.convert(args[0], LoRARequest)
        assert lora == LoRARequest("a", 2, "/p", "base", True)
        peer.send(_vllm_reply(call_id, True))
        assert await call is True
        # vLLM's own LoRARequest (what vLLM's add_lora_async passes) goes as given.
        theirs = LoRARequest("b", 3, "/q")
        call = asyncio.ensure_future(client.add_lora_async(theirs))
        frames = await asyncio.to_thread(peer.recv)
        _, call_id, _, args = msgspec.msgpack.decode(frames[1])
        assert msgspec.convert(args[0], LoRARequest) == theirs
        peer.send(_vllm_reply(call_id, True))
        assert await call is True


def _vllm_reply(call_id: int, value: Any) -> list[bytes]:
    return vllm_frames(
        E.EngineCoreOutputs(
            utility_output=E.UtilityOutput(call_id=call_id, result=E.UtilityResult(value))
        )
    )


# -- call id -2, as vLLM 0.33.0's EngineCoreSentinel pushes it --------------------------


def _status(engine: int, status: str, fault_info: str | None = None) -> list[bytes]:
    payload: dict[str, Any] = {"id": engine, "status": status}
    if fault_info is not None:
        payload["fault_info"] = fault_info
    outputs = E.EngineCoreOutputs(
        utility_output=E.UtilityOutput(call_id=E.FT_STATUS_CALL_ID, result=E.UtilityResult(payload))
    )
    outputs.engine_index = engine
    return vllm_frames(outputs)


async def _until(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_async_clients_keep_engine_status(ipc_dir: Path, sockets: Sockets) -> None:
    addresses = client_addresses(ipc_dir)
    peers = [EnginePeer(sockets, addresses, i) for i in range(2)]
    client = DPAsyncMPClient(
        data_parallel_size=2,
        engine_indices=[0, 1],
        client_addresses=addresses,
        coordinator_addresses=coordinator_addresses(ipc_dir),
        release=RELEASE,
        ready_timeout=10,
    )
    try:
        call = asyncio.ensure_future(client.call_utility_async("is_sleeping"))
        ids = [(await asyncio.to_thread(peer.recv_utility))[1] for peer in peers]
        peers[1].send(_status(1, "unhealthy", "RuntimeError"))
        peers[0].send(_status(0, "healthy"))
        await _until(lambda: len(client.engine_status) == 2)
        assert client.engine_status == {
            0: {"id": 0, "status": "healthy"},
            1: {"id": 1, "status": "unhealthy", "fault_info": "RuntimeError"},
        }
        assert not call.done()  # a status answers no call
        peers[1].send(_status(1, "dead"))
        await _until(lambda: client.engine_status[1]["status"] == "dead")
        for peer, call_id in zip(peers, ids, strict=True):
            peer.send(_vllm_reply(call_id, False))
        assert await call is False
    finally:
        client.shutdown()


def test_sync_client_drops_engine_status(ipc_dir: Path, sockets: Sockets) -> None:
    with client_and_peer(ipc_dir, sockets, SyncMPClient, release=RELEASE) as (client, peer):
        peer.send(_status(0, "unhealthy", "ValueError"))
        peer.send(_status(0, "healthy"))
        wait_for(lambda: client.ft_status_dropped == 2, what="dropped statuses")
        client.add_request(_corewire("after", sampling_params=p.SamplingParams()))
        peer.recv_add()
        assert not client.engine_dead and client.outputs_queue.empty()


# -- the error field -----------------------------------------------------------------


@pytest.mark.skipif(
    not releases.get(RELEASE).request_errors, reason=f"vLLM {RELEASE} has no RequestError"
)
async def test_request_error_reaches_the_caller_and_ends_the_request(
    ipc_dir: Path, sockets: Sockets
) -> None:
    addresses = client_addresses(ipc_dir)
    peers = [EnginePeer(sockets, addresses, i) for i in range(2)]
    client = DPLBAsyncMPClient(
        data_parallel_size=2,
        client_addresses=addresses,
        coordinator_addresses=coordinator_addresses(ipc_dir),
        release=RELEASE,
        ready_timeout=10,
    )
    try:
        await client.add_request_async(_corewire("paused", data_parallel_rank=0))
        await client.add_request_async(_corewire("invalid", data_parallel_rank=1))
        for peer in peers:
            peer.recv_add()
        assert client.router.in_flight() == [1, 1]
        errors = {
            "paused": vllm.outputs.RequestError(
                "engine_paused", "Generation is paused. Please retry after it resumes.", True
            ),
            "invalid": vllm.outputs.RequestError("validation_error", "bad structured output"),
        }
        for index, (rid, error) in enumerate(errors.items()):
            # As vLLM 0.33.0's engine refuses an ADD: ERROR, the error, the id finished.
            outputs = E.EngineCoreOutputs(
                engine_index=index,
                outputs=[
                    E.EngineCoreOutput(rid, [], finish_reason=E.FinishReason.ERROR, error=error)
                ],
                finished_requests={rid},
            )
            peers[index].send(vllm_frames(outputs))
            got = await asyncio.wait_for(client.get_output_async(), 10)
            (out,) = got.outputs
            assert (out.request_id, out.finish_reason) == (rid, FinishReason.ERROR)
            assert (out.error.code, out.error.message, out.error.retryable) == (
                error.code,
                error.message,
                error.retryable,
            )
        assert client.reqs_in_flight == {}
        assert client.router.in_flight() == [0, 0]
    finally:
        client.shutdown()
