"""Malformed frames from an engine: the frame fails alone, the client lives on.

Checks ``docs/protocol.md`` §9.2 (corewire's clients: the frame fails alone, and a
readable call id or request id gets its error) and §5.6 (utility replies).
"""

from __future__ import annotations

import asyncio

import pytest

from client_support import GARBAGE, SUPPORT, finished, request
from corewire import AsyncMPClient, ProtocolError, SyncMPClient
from leak_support import no_leaks


@pytest.mark.parametrize("kind", sorted(GARBAGE))
async def test_malformed_frame_fails_alone_while_requests_stream(kind: str) -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=SUPPORT, engine_args={"step_delay": 0.002})
        try:
            for i in range(4):
                await client.add_request_async(request(f"p{i}", max_tokens=30))
            first = await client.get_output_async()
            tokens = {out.request_id: list(out.new_token_ids) for out in first.outputs}
            # The engine pushes the bad frame in the middle of the streams.
            assert await client.call_utility_async("garbage", kind, "sent") == "sent"
            errors: list[ProtocolError] = []
            done = 0
            while done < 4:
                try:
                    outputs = await asyncio.wait_for(client.get_output_async(), 10)
                except ProtocolError as exc:
                    errors.append(exc)
                    continue
                for out in outputs.outputs:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                done += len(finished(outputs))
            assert len(errors) == 1, "exactly the bad frame fails"
            assert str(errors[0])  # says what is wrong
            # Every other output arrived, in order.
            assert tokens == {f"p{i}": list(range(1, 31)) for i in range(4)}
            assert not client.engine_dead
            assert await client.call_utility_async("echo", "alive") == "alive"
            await client.check_health_async(5)
        finally:
            client.shutdown()


def test_malformed_frame_sync_client() -> None:
    with no_leaks():
        client = SyncMPClient(engine_main=SUPPORT)
        try:
            assert client.call_utility("garbage", "not_msgpack") is None
            with pytest.raises(ProtocolError):
                client.get_output(timeout=5)
            assert client.call_utility("echo", 1) == 1
            client.add_request(request("ok", max_tokens=1))
            assert finished(client.get_output(timeout=5)) == ["ok"]
        finally:
            client.shutdown()


async def test_undecodable_utility_reply_fails_its_caller() -> None:
    """The reply's call id is still readable: that caller gets the ProtocolError (it used
    to wait forever while the error went to the output queue)."""
    with no_leaks():
        client = AsyncMPClient(engine_main=SUPPORT)
        try:
            with pytest.raises(ProtocolError, match="extension"):
                await asyncio.wait_for(client.call_utility_async("unreadable_reply"), 10)
            assert len(client.resources.registry) == 0
            assert client.outputs_queue.empty()  # attributed to its caller, nowhere else
            assert await client.call_utility_async("echo", "alive") == "alive"
        finally:
            client.shutdown()


def test_undecodable_utility_reply_fails_its_caller_sync() -> None:
    with no_leaks():
        client = SyncMPClient(engine_main=SUPPORT)
        try:
            with pytest.raises(ProtocolError, match="extension"):
                client.call_utility("unreadable_reply", timeout=10)
            assert client.call_utility("echo", 2) == 2
        finally:
            client.shutdown()


async def test_undecodable_outputs_name_their_requests() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=SUPPORT)
        try:
            await client.call_utility_async("garbage", "aux_out_of_range")
            with pytest.raises(ProtocolError) as info:
                await asyncio.wait_for(client.get_output_async(), 10)
            assert info.value.request_ids == ("req",)
            await client.call_utility_async("garbage", "not_msgpack")
            with pytest.raises(ProtocolError) as info:
                await asyncio.wait_for(client.get_output_async(), 10)
            assert info.value.request_ids == ()
        finally:
            client.shutdown()
