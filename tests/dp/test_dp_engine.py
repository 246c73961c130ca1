"""DPEngineCoreProc in a real process, driven by a raw front-end and a raw coordinator.

The test binds the coordinator's sockets itself (stats PULL, wave XPUB), so it decides
every wave message the engine sees and reads every report the engine sends.

Checks ``docs/protocol.md`` §4.7 (START_DP_WAVE on the request link) and §8.2 (corewire's
coordinator protocol: subscription, waves, reports, scaling).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from client_support import request
from corewire.dp_messages import WAVE_COMPLETE, XPUB_SUBSCRIBE
from corewire.protocol import EngineCoreRequestType, FinishReason
from dp_support import LIGHT
from engine_support import FrontEnd


class FakeCoordinator:
    """The coordinator's two engine-side sockets, bound by the test."""

    def __init__(self, ipc_dir: Path) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.stats_address = f"ipc://{ipc_dir}/fake-stats"
        self.wave_address = f"ipc://{ipc_dir}/fake-wave"
        self.stats = self.ctx.socket(zmq.PULL)
        self.stats.linger = 0
        self.stats.bind(self.stats_address)
        self.wave = self.ctx.socket(zmq.XPUB)
        self.wave.linger = 0
        self.wave.bind(self.wave_address)
        self.reports: list[list[Any]] = []

    def wait_subscribed(self, timeout: float = 30.0) -> None:
        assert self.wave.poll(timeout * 1000), "the engine never subscribed"
        assert self.wave.recv()[:1] == XPUB_SUBSCRIBE

    def publish(self, type_byte: bytes, payload: Any) -> None:
        self.wave.send_multipart([type_byte, msgspec.msgpack.encode(payload)])

    def report(self, predicate: Callable[[list[Any]], bool], timeout: float = 10.0) -> list[Any]:
        """The first report (EngineCoreOutputs as a plain list) matching ``predicate``."""
        deadline = time.monotonic() + timeout
        while True:
            for msg in self.reports:
                if predicate(msg):
                    self.reports.remove(msg)
                    return msg
            left = deadline - time.monotonic()
            if left <= 0 or not self.stats.poll(left * 1000):
                raise AssertionError(f"no matching report; got {self.reports}")
            self.reports.append(msgspec.msgpack.decode(self.stats.recv()))

    def close(self) -> None:
        self.stats.close(0)
        self.wave.close(0)
        self.ctx.term()


def stats_of(report: list[Any]) -> dict[str, Any]:
    return report[2] or {}


@pytest.fixture
def group(ipc_dir: Path) -> Iterator[tuple[FrontEnd, FakeCoordinator]]:
    fe = FrontEnd(ipc_dir, "dp")
    coord = FakeCoordinator(ipc_dir)
    try:
        yield fe, coord
    finally:
        fe.close()
        coord.close()


def test_waves_scaling_utilities_and_retirement(group: tuple[FrontEnd, FakeCoordinator]) -> None:
    fe, coord = group
    proc = fe.start_engine(
        engine_args={**LIGHT, "step_delay": 0.01},
        engine_index=1,
        data_parallel_size=2,
        coordinator_addresses=["", coord.stats_address, coord.wave_address],
        include_finished_set=True,
    )
    identity, ready = fe.wait_ready()
    # The identity spelled out on purpose: index 1, two bytes little-endian (protocol §2).
    assert identity == b"\x01\x00" and ready["data_parallel_size"] == 2
    coord.wait_subscribed()
    assert fe.value("dp_state") == {
        "engine_index": 1,
        "current_wave": 0,
        "engines_running": False,
        "data_parallel_size": 2,
        "num_requests": 0,
    }

    # START_DP_WAVE on the front-end link (vLLM's framing) wakes it into wave 3 ...
    fe.send(EngineCoreRequestType.START_DP_WAVE.value, [3, 0])
    report = coord.report(lambda r: stats_of(r).get("current_wave") == 3)
    assert report[0] == 1 and stats_of(report)["num_running_reqs"] == 0
    # ... but not when it is the excluded engine, or the wave is older.
    fe.send(EngineCoreRequestType.START_DP_WAVE.value, [5, 1])
    fe.send(EngineCoreRequestType.START_DP_WAVE.value, [2, 0])
    state = fe.value("dp_state")
    assert (state["current_wave"], state["engines_running"]) == (3, True)

    # The coordinator ends wave 3: paused at wave 4. Junk on the wave socket is ignored.
    coord.wave.send_multipart([WAVE_COMPLETE, b"\xc1"])
    coord.wave.send_multipart([b"\x7f", msgspec.msgpack.encode([1])])  # no message type
    coord.publish(WAVE_COMPLETE, [3])
    coord.report(lambda r: stats_of(r).get("current_wave") == 4)
    state = fe.value("dp_state")
    assert (state["current_wave"], state["engines_running"]) == (4, False)

    # A request stamped with a wave that ended while paused: ask for a new wave.
    stale = request("stale", max_tokens=3)
    stale.current_wave = 2
    fe.add(stale)
    asked = coord.report(lambda r: r[7] is not None)
    assert asked[7] == 4 and asked[0] == 1
    assert len(fe.collect(["stale"])["stale"]) >= 1
    # Counts went up and back down to idle.
    coord.report(lambda r: stats_of(r).get("num_running_reqs") == 1)
    coord.report(lambda r: stats_of(r).get("num_running_reqs") == 0)

    # A newer wave on a request moves the engine forward.
    newer = request("newer", max_tokens=2)
    newer.current_wave = 9
    fe.add(newer)
    fe.collect(["newer"])
    assert fe.value("dp_state")["current_wave"] == 9

    # A request that races the end of its wave: the engine asks for the next one at once.
    long = request("long", max_tokens=1000)
    long.current_wave = 9
    fe.add(long)
    coord.report(lambda r: stats_of(r).get("num_running_reqs") == 1)
    coord.publish(b"\x10", [9])
    asked = coord.report(lambda r: r[7] is not None)
    assert asked[7] == 10
    state = fe.value("dp_state")
    assert (state["current_wave"], state["engines_running"], state["num_requests"]) == (
        10,
        True,
        1,
    )

    # Elastic scaling utilities, with their call_id -1 notifications.
    reply = fe.call("reconfigure_data_parallel", 1)
    assert "cannot stay in a group of 1" in (reply.failure_message or "")
    notification = None
    reply = fe.call("reconfigure_data_parallel", 3)
    assert reply.result is not None and reply.result.result == 3
    for msg in list(fe.backlog):
        uo = msg.utility_output
        if uo is not None and uo.call_id == -1:
            notification = uo.result.result
            fe.backlog.remove(msg)
    assert notification == ["RECONFIGURE_FINISHED", 1]
    assert fe.value("dp_state")["data_parallel_size"] == 3

    # Retirement: the held request finishes as ABORT, then the notification, then the
    # reply; the process exits cleanly.
    reply = fe.call("shutdown_for_scale_down")
    assert reply.result is not None and reply.result.result == 1
    events = list(fe.backlog)
    fe.backlog.clear()
    aborted = [o for m in events for o in m.outputs if o.request_id == "long"]
    assert aborted and aborted[-1].finish_reason == FinishReason.ABORT
    assert any(m.finished_requests and "long" in m.finished_requests for m in events)
    notes = [m.utility_output.result.result for m in events if m.utility_output is not None]
    assert notes == [["SHUTDOWN_COMPLETE", 1]]
    proc.join(15)
    assert proc.exitcode == 0
