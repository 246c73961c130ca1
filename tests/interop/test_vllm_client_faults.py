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

import pytest

pytest.importorskip("vllm")

from corewire.protocol import FinishReason
from corewire.vllm.adapters.classes import client_classes
from corewire.vllm.adapters.client import INSTALLED_RELEASE
from vllm_support import (
    HandEngine,
    hand_output,
    require_vllm_0_25_1,
    vllm_config,
    write_model_dir,
)

require_vllm_0_25_1()


async def test_bad_frame_ends_its_requests_and_the_stream_goes_on(tmp_path: Path) -> None:
    config = vllm_config(write_model_dir(tmp_path / "model"))
    addresses = {
        "input_address": f"ipc://{tmp_path}/in",
        "output_address": f"ipc://{tmp_path}/out",
    }
    engine: list[HandEngine] = []
    # The client waits for the ready map in its constructor: connect meanwhile.
    joiner = threading.Timer(
        0.3,
        lambda: engine.append(HandEngine(addresses["input_address"], addresses["output_address"])),
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
        hand.push([0, [hand_output("bad", ["x"]), hand_output("also-bad", [1])], None, 1.0])
        hand.push(b"\xc1 not msgpack at all")
        hand.push([0, [hand_output("good", [7], FinishReason.LENGTH)], None, 2.0])
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
