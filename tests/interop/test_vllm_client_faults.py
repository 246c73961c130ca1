"""corewire's client under vLLM: faults that vLLM's own client turns into a dead server.

The engine here is a thread with real ZeroMQ sockets that speaks the protocol by hand, so
that it can send exactly the broken frames a test needs.

Checks ``docs/protocol.md`` §9.2 (a bad frame fails alone: the requests it names end,
the stream goes on) and §5.1 (output frames), against vLLM's own output processing.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import msgspec
import pytest
import zmq

pytest.importorskip("vllm")

from corewire.engine.interface import EngineInfo
from corewire.engine.ready import ready_response
from corewire.protocol import FinishReason
from corewire.vllm.classes import client_classes
from corewire.vllm.client import INSTALLED_RELEASE
from vllm_support import (
    require_vllm_0_25_1,
    vllm_config,
    write_model_dir,
)

require_vllm_0_25_1()


class _HandEngine:
    """Connects to a client, sends its ready map, then sends the frames it is given."""

    def __init__(self, input_address: str, output_address: str) -> None:
        self.ctx = zmq.Context()
        self.requests = self.ctx.socket(zmq.DEALER)
        # Engine 0's identity, written by hand like every frame here (docs/protocol.md §2).
        self.requests.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
        self.requests.connect(input_address)
        self.outputs = self.ctx.socket(zmq.PUSH)
        self.outputs.connect(output_address)
        ready = ready_response(EngineInfo(max_model_len=512), engine_index=0)
        self.requests.send(msgspec.msgpack.encode(ready))

    def push(self, payload: object) -> None:
        self.outputs.send(msgspec.msgpack.encode(payload))

    def close(self) -> None:
        self.requests.close(linger=0)
        self.outputs.close(linger=1000)
        self.ctx.term()


def _output(request_id: str, tokens: list[int], finish: int | None = None) -> list:
    return [request_id, tokens, None, None, None, finish, None, None, None, None, None, None, 0]


async def test_bad_frame_ends_its_requests_and_the_stream_goes_on(tmp_path: Path) -> None:
    config = vllm_config(write_model_dir(tmp_path / "model"))
    addresses = {
        "input_address": f"ipc://{tmp_path}/in",
        "output_address": f"ipc://{tmp_path}/out",
    }
    engine: list[_HandEngine] = []
    # The client waits for the ready map in its constructor: connect meanwhile.
    joiner = threading.Timer(
        0.3,
        lambda: engine.append(_HandEngine(addresses["input_address"], addresses["output_address"])),
    )
    joiner.start()
    client = client_classes(INSTALLED_RELEASE)["plain"](
        config, None, False, client_addresses=addresses
    )
    joiner.join()
    hand = engine[0]
    try:
        assert config.model_config.max_model_len == 512  # the ready map was applied
        # An output whose tokens are not ints: the frame cannot decode, its id can.
        hand.push([0, [_output("bad", ["x"]), _output("also-bad", [1])], None, 1.0])
        hand.push(b"\xc1 not msgpack at all")
        hand.push([0, [_output("good", [7], FinishReason.LENGTH)], None, 2.0])
        first = await asyncio.wait_for(client.get_output_async(), 10)
        assert [(o.request_id, o.finish_reason) for o in first.outputs] == [
            ("bad", FinishReason.ERROR),
            ("also-bad", FinishReason.ERROR),
        ]
        second = await asyncio.wait_for(client.get_output_async(), 10)
        assert [(o.request_id, o.new_token_ids) for o in second.outputs] == [("good", [7])]
        assert client.protocol_errors == 2
        assert not client.resources.engine_dead
    finally:
        client.shutdown()
        hand.close()
