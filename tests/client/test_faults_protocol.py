"""Malformed frames from an engine: the frame fails alone, the client lives on.

Checks ``docs/protocol.md`` §9.2 (corewire's clients: the frame fails alone, a readable
call id or request id gets its error, a frame that names no one is dropped and counted)
and §5.6 (utility replies).
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from client_support import GARBAGE, SUPPORT, finished, request
from corewire import AsyncMPClient, ProtocolError, SyncMPClient
from leak_support import no_leaks

#: The GARBAGE frames whose request ids can still be read.
NAMES_A_REQUEST = {"aux_out_of_range"}


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
            # Exactly the bad frame fails: the consumer hears of it only when it named a
            # request (the consumer must end it); it is counted either way.
            assert len(errors) == (1 if kind in NAMES_A_REQUEST else 0)
            assert all(str(e) for e in errors)  # says what is wrong
            assert client.protocol_errors == 1
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
            assert client.call_utility("garbage", "aux_out_of_range") is None
            with pytest.raises(ProtocolError) as info:
                client.get_output(timeout=5)
            assert info.value.request_ids == ("req",)
            assert client.call_utility("garbage", "not_msgpack") is None
            deadline = time.monotonic() + 10
            while client.protocol_errors < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert client.protocol_errors == 2  # dropped, counted, not raised
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
        finally:
            client.shutdown()


async def test_a_frame_naming_no_one_is_dropped_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A frame whose payload is not even msgpack names no request and no call: nobody
    waits on it, so it fails nothing (no ProtocolError for the output consumer); the
    client counts it and logs it, bounded, and the streams around it go on."""
    with no_leaks():
        client = AsyncMPClient(engine_main=SUPPORT, engine_args={"step_delay": 0.002})
        try:
            await client.add_request_async(request("around", max_tokens=20))
            with caplog.at_level(logging.WARNING, logger="corewire"):
                await client.call_utility_async("garbage", "not_msgpack")
                tokens: list[int] = []
                while True:
                    outputs = await asyncio.wait_for(client.get_output_async(), 10)
                    tokens += [t for o in outputs.outputs for t in o.new_token_ids]
                    if finished(outputs):
                        break
            assert tokens == list(range(1, 21))
            assert client.protocol_errors == 1 and client.outputs_queue.empty()
            lines = [r.getMessage() for r in caplog.records if "broke the protocol" in r.message]
            assert len(lines) == 1 and "named no request or call: dropped" in lines[0]
            assert len(lines[0]) < 1000
        finally:
            client.shutdown()
