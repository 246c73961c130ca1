"""The DP coordinator: wave bookkeeping, and the real process over real sockets.

Checks ``docs/protocol.md`` §8.2 (corewire's coordinator: its messages, waves and
publications) and §4.7 (START_DP_WAVE as the coordinator publishes it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from corewire.codec import Encoder
from corewire.coordinator import CoordinatorState, DPCoordinator
from corewire.dp_messages import (
    WAVE_COMPLETE,
    DPState,
    EngineReport,
    FirstRequest,
    LostNotice,
    ScaleNotice,
    StartWave,
    WaveComplete,
    decode_front_message,
    decode_wave_message,
)
from corewire.errors import ProtocolError
from corewire.protocol import EngineCoreOutputs, EngineCoreRequestType
from dp_support import EnginePeer, FrontEndPeer, Sockets, coordinator_addresses, wait_for
from leak_support import pid_gone, wait_pid_gone

# ---------------------------------------------------------------- bookkeeping, no sockets


def test_state_rejects_an_empty_group() -> None:
    with pytest.raises(ValueError):
        CoordinatorState(0)
    with pytest.raises(ValueError):
        CoordinatorState(2).on_scale(0)


def test_first_request_starts_the_wave_on_the_other_engines() -> None:
    s = CoordinatorState(3)
    assert s.snapshot() == DPState([[0, 0]] * 3, 0, False)
    assert s.on_first_request(1, 0) == [StartWave(0, 1)]
    assert s.engines_running
    # A second notice for a running wave changes nothing.
    assert s.on_first_request(2, 0) == []


def test_stale_notice_wakes_every_engine() -> None:
    s = CoordinatorState(2)
    s.current_wave = 5
    assert s.on_first_request(0, 3) == [StartWave(5, -1)]


def test_wave_ends_when_every_engine_reports_idle() -> None:
    s = CoordinatorState(2)
    s.on_first_request(0, 0)
    s.pending.clear()
    assert s.on_engine_report(0, {"num_waiting_reqs": 2, "num_running_reqs": 1}, None, None) == []
    assert s.on_engine_report(1, {"num_waiting_reqs": 0, "num_running_reqs": 0}, None, None) == []
    assert s.counts == [[2, 1], [0, 0]]
    assert s.on_engine_report(0, {"num_waiting_reqs": 0, "num_running_reqs": 0}, None, None) == [
        WaveComplete(0)
    ]
    assert (s.current_wave, s.engines_running) == (1, False)
    # Idle reports while paused end nothing.
    assert s.on_engine_report(1, {"num_waiting_reqs": 0, "num_running_reqs": 0}, None, None) == []


def test_engine_start_wave_only_for_a_newer_or_paused_wave() -> None:
    s = CoordinatorState(2)
    s.current_wave = 3
    # Paused at wave 3: an engine that got a stale request asks for wave 3.
    assert s.on_engine_report(1, None, 3, None) == [StartWave(3, 1)]
    # Running wave 3: asking again is a no-op; asking for an older wave too.
    assert s.on_engine_report(0, None, 3, None) == []
    assert s.on_engine_report(0, None, 2, None) == []
    # A newer wave moves everyone forward.
    assert s.on_engine_report(0, None, 4, None) == [StartWave(4, 0)]


def test_notified_engine_counts_as_busy_until_it_reports() -> None:
    s = CoordinatorState(2)
    assert s.on_first_request(0, 0, now=10.0) == [StartWave(0, 0)]
    idle = {"num_waiting_reqs": 0, "num_running_reqs": 0}
    # Engine 1 (woken, no work) reports idle before engine 0 got its request: no end.
    assert s.on_engine_report(1, idle, None, None) == []
    assert s.next_deadline() == pytest.approx(10.5)
    assert s.on_tick(10.1) == []
    # Engine 0 reports its request, then finishes it: the wave ends then.
    assert s.on_engine_report(0, {"num_waiting_reqs": 1}, None, None) == []
    assert s.on_engine_report(0, idle, None, None) == [WaveComplete(0)]


def test_pending_engine_that_never_reports_expires() -> None:
    s = CoordinatorState(2)
    s.on_first_request(1, 0, now=5.0)
    assert s.on_engine_report(0, {"num_waiting_reqs": 0}, None, None) == []
    assert s.on_tick(5.49) == []
    assert s.on_tick(5.5) == [WaveComplete(0)]
    assert s.next_deadline() is None


def test_engine_wave_complete_is_honoured() -> None:
    s = CoordinatorState(2)
    s.on_first_request(0, 0)
    s.counts = [[0, 3], [0, 0]]
    assert s.on_engine_report(0, None, None, 0) == [WaveComplete(0)]
    assert (s.current_wave, s.engines_running) == (1, False)
    # An old wave's completion is ignored.
    assert s.on_engine_report(0, None, None, 0) == []


def test_reports_from_engines_outside_the_group_are_ignored() -> None:
    s = CoordinatorState(2)
    s.changed = False
    assert s.on_engine_report(2, {"num_waiting_reqs": 9}, 7, None) == []
    assert s.on_engine_report(-1, {"num_waiting_reqs": 9}, 7, None) == []
    assert not s.changed and s.current_wave == 0


def test_scale_grows_idle_and_shrinks() -> None:
    s = CoordinatorState(2)
    s.counts = [[1, 1], [2, 2]]
    s.on_scale(3)
    assert s.counts == [[1, 1], [2, 2], [0, 0]]
    s.on_scale(1)
    assert s.counts == [[1, 1]]


def test_a_lost_engine_counts_idle_and_can_end_the_wave() -> None:
    s = CoordinatorState(2)
    s.on_first_request(0, 0)
    s.pending.clear()
    s.on_engine_report(1, {"num_waiting_reqs": 3, "num_running_reqs": 4}, None, None)
    s.on_engine_report(0, {"num_waiting_reqs": 0, "num_running_reqs": 0}, None, None)
    assert s.engines_running
    # Engine 1 died holding work: its last counts no longer stand, and the wave is over.
    assert s.on_engine_lost(1) == [WaveComplete(0)]
    assert s.counts == [[0, 0], [0, 0]] and not s.engines_running
    assert s.on_engine_lost(5) == []  # not of this group
    # Its replacement's first report counts again.
    s.on_engine_report(1, {"num_waiting_reqs": 1, "num_running_reqs": 0}, None, None)
    assert s.counts[1] == [1, 0]


# ---------------------------------------------------------------- the messages


def test_messages_encode_as_the_plain_lists_of_the_protocol_page() -> None:
    encode = msgspec.msgpack.encode
    assert DPState([[1, 2]], 3, True).encode() == encode([[[1, 2]], 3, True])
    assert FirstRequest(1, 4).encode() == encode([1, 4])
    assert ScaleNotice(3).encode() == encode(["scale", 3])
    # The frames spelled out byte for byte on purpose (not with the module's constants):
    # the wire the protocol page (§8.2) and vLLM's engines (§4.7) read.
    assert StartWave(3, -1).to_frames() == [b"\x02", bytes.fromhex("9203ff")]
    assert WaveComplete(2).to_frames() == [b"\x10", bytes.fromhex("9102")]
    assert decode_front_message(encode([1, 4])) == FirstRequest(1, 4)
    assert decode_front_message(encode(["scale", 3])) == ScaleNotice(3)
    assert LostNotice(2).encode() == encode(["lost", 2])
    assert decode_front_message(encode(["lost", 2])) == LostNotice(2)
    assert decode_wave_message(StartWave(7, 1).to_frames()) == StartWave(7, 1)
    assert decode_wave_message(WaveComplete(6).to_frames()) == WaveComplete(6)
    assert DPState.decode(encode([None, 2, False])) == DPState(None, 2, False)


@pytest.mark.parametrize(
    "payload",
    [[True, 1], [1], ["scale", "2"], ["SCALE_ELASTIC_EP", 2], {"a": 1}, [1, 2, 3], 7],
)
def test_bad_front_end_messages_are_protocol_errors(payload: object) -> None:
    with pytest.raises(ProtocolError):
        decode_front_message(msgspec.msgpack.encode(payload))


@pytest.mark.parametrize(
    "frames",
    [
        [EngineCoreRequestType.START_DP_WAVE.value, msgspec.msgpack.encode([1])],
        # A nil exclude comes only from vLLM's coordinator.
        [EngineCoreRequestType.START_DP_WAVE.value, msgspec.msgpack.encode([1, None])],
        [WAVE_COMPLETE, msgspec.msgpack.encode(["x"])],
        [b"\x11", msgspec.msgpack.encode([1])],  # no message type
        [EngineCoreRequestType.START_DP_WAVE.value, b"\xc1"],
        [EngineCoreRequestType.START_DP_WAVE.value],
    ],
)
def test_bad_wave_messages_are_protocol_errors(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode_wave_message(frames)


def test_start_wave_takes_nil_exclude_only_where_asked() -> None:
    assert StartWave.from_payload([3, None], nil_excludes_none=True) == StartWave(3, -1)
    with pytest.raises(ProtocolError):
        StartWave.from_payload([3, None])


def test_engine_report_reads_engine_core_outputs_by_its_field_order() -> None:
    """The coordinator's view of an engine report is EngineCoreOutputs, field for field."""
    assert EngineReport.__struct_fields__ == EngineCoreOutputs.__struct_fields__
    sent = EngineCoreOutputs(
        engine_index=3, scheduler_stats={"num_waiting_reqs": 1}, wave_complete=4, start_wave=5
    )
    report = msgspec.msgpack.decode(Encoder().encode(sent)[0], type=EngineReport)
    assert (report.engine_index, report.scheduler_stats) == (3, {"num_waiting_reqs": 1})
    assert (report.wave_complete, report.start_wave) == (4, 5)


# ---------------------------------------------------------------- the process


@pytest.fixture
def zctx() -> Iterator[Sockets]:
    sockets = Sockets()
    yield sockets
    sockets.close()


@pytest.fixture
def coordinator(ipc_dir: Path) -> Iterator[DPCoordinator]:
    coord = DPCoordinator(2, coordinator_addresses(ipc_dir))
    yield coord
    coord.shutdown()
    assert not coord.is_alive()


def test_publishes_state_to_each_new_subscriber(coordinator: DPCoordinator, zctx: Sockets) -> None:
    first = FrontEndPeer(zctx, coordinator.addresses)
    assert first.recv() == [[[0, 0], [0, 0]], 0, False]
    second = FrontEndPeer(zctx, coordinator.addresses)
    assert second.recv() == [[[0, 0], [0, 0]], 0, False]


def test_full_wave_cycle_over_sockets(coordinator: DPCoordinator, zctx: Sockets) -> None:
    front = FrontEndPeer(zctx, coordinator.addresses)
    front.recv()
    engines = [EnginePeer(zctx, coordinator.addresses, i) for i in range(2)]
    for e in engines:  # late subscribers get the current state: wave 0 not running
        e.recv_until((WAVE_COMPLETE, [-1]))

    front.notice(0, 0)
    for e in engines:
        e.recv_until((EngineCoreRequestType.START_DP_WAVE.value, [0, 0]))
    assert front.recv_until(lambda m: m[2]) == [[[0, 0], [0, 0]], 0, True]

    engines[0].report(waiting=1, running=2, wave=0)
    assert front.recv_until(lambda m: m[0][0] != [0, 0])[0] == [[1, 2], [0, 0]]
    engines[0].report(waiting=0, running=0, wave=0)
    for e in engines:
        e.recv_until((WAVE_COMPLETE, [0]))
    # (Counts too: on a slow machine the notice's grace can lapse before engine 0's
    # first report, ending the wave early with [1, 2] still to come.)
    assert front.recv_until(lambda m: not m[2] and m[0][0] == [0, 0]) == [
        [[0, 0], [0, 0]],
        1,
        False,
    ]

    # An engine that got a request for the finished wave asks for a new one.
    engines[1].report(waiting=0, running=1, wave=1, start_wave=1)
    for e in engines:
        e.recv_until((EngineCoreRequestType.START_DP_WAVE.value, [1, 1]))
    assert front.recv_until(lambda m: m[2]) == [[[0, 0], [0, 1]], 1, True]


def test_publications_are_rate_limited(coordinator: DPCoordinator, zctx: Sockets) -> None:
    front = FrontEndPeer(zctx, coordinator.addresses)
    front.recv()
    engine = EnginePeer(zctx, coordinator.addresses, 0)
    start = time.monotonic()
    for i in range(1, 61):  # 60 changes over ~300 ms
        engine.report(waiting=i, running=0)
        time.sleep(0.005)
    received = []
    while True:
        msg = front.recv(timeout=1.0)
        received.append(msg)
        if msg[0][0] == [60, 0]:
            break
    elapsed = time.monotonic() - start
    # Every change reached the coordinator, but at most one publication per 100 ms
    # (plus the one that may go out at once) reached the front-end.
    # (Bounded by the time taken, not by a constant: a slow machine stretches the sends.)
    assert len(received) <= elapsed / 0.1 + 1


def test_no_publication_when_nothing_changed(coordinator: DPCoordinator, zctx: Sockets) -> None:
    front = FrontEndPeer(zctx, coordinator.addresses)
    front.recv()
    engine = EnginePeer(zctx, coordinator.addresses, 1)
    engine.report(waiting=0, running=0)  # same counts as before: not a change
    with pytest.raises(AssertionError):
        front.recv(timeout=0.4)


def test_scale_changes_the_published_group(coordinator: DPCoordinator, zctx: Sockets) -> None:
    front = FrontEndPeer(zctx, coordinator.addresses)
    front.recv()
    front.send_raw(msgspec.msgpack.encode(["scale", 3]))
    assert front.recv_until(lambda m: len(m[0]) == 3)[0] == [[0, 0]] * 3
    EnginePeer(zctx, coordinator.addresses, 2).report(waiting=4, running=0)
    assert front.recv_until(lambda m: m[0][2] == [4, 0])
    front.send_raw(msgspec.msgpack.encode(["scale", 1]))
    assert front.recv_until(lambda m: len(m[0]) == 1)[0] == [[0, 0]]


def test_bad_messages_are_ignored(coordinator: DPCoordinator, zctx: Sockets) -> None:
    front = FrontEndPeer(zctx, coordinator.addresses)
    front.recv()
    engine = EnginePeer(zctx, coordinator.addresses, 0)
    for junk in (b"\xc1", b"\x92\xa1x\xa1y", msgspec.msgpack.encode({"a": 1}), b"\x93\x01\x02"):
        front.send_raw(junk)
        engine.push.send(junk)
    engine.push.send(msgspec.msgpack.encode([0, [], "not a map"]))
    front.send_raw(msgspec.msgpack.encode(["scale", 0]))
    # Still serving, state untouched by the junk.
    engine.report(waiting=3, running=0)
    assert front.recv_until(lambda m: m[0][0] == [3, 0]) == [[[3, 0], [0, 0]], 0, False]
    assert coordinator.is_alive()


def test_shutdown_is_idempotent_and_quick(ipc_dir: Path) -> None:
    coord = DPCoordinator(1, coordinator_addresses(ipc_dir))
    start = time.monotonic()
    coord.shutdown()
    coord.shutdown()
    assert time.monotonic() - start < 5
    assert not coord.is_alive()


def test_collected_owner_stops_the_process_and_removes_its_files() -> None:
    coord = DPCoordinator(1)  # its own private ipc directory
    pid = coord.pid
    directory = Path(coord.addresses.front_publish.removeprefix("ipc://")).parent
    assert directory.is_dir() and (directory.stat().st_mode & 0o777) == 0o700
    del coord
    assert wait_pid_gone(pid, timeout=10), "the collected coordinator did not exit"
    assert not directory.exists()


def test_quacks_like_a_process_for_the_engine_monitor(ipc_dir: Path) -> None:
    import multiprocessing.connection

    coord = DPCoordinator(1, coordinator_addresses(ipc_dir))
    try:
        assert coord.is_alive() and coord.exitcode is None and coord.name
        assert multiprocessing.connection.wait([coord.sentinel], timeout=0.2) == []
        os.kill(coord.pid, signal.SIGKILL)
        assert multiprocessing.connection.wait([coord.sentinel], timeout=5) == [coord.sentinel]
        coord.join(5)
        assert coord.exitcode == -signal.SIGKILL and not coord.is_alive()
    finally:
        coord.close()


def test_sigterm_stops_the_process(ipc_dir: Path) -> None:
    coord = DPCoordinator(1, coordinator_addresses(ipc_dir))
    os.kill(coord.pid, signal.SIGTERM)
    wait_for(lambda: not coord.is_alive(), what="coordinator exit on SIGTERM")
    coord.shutdown()


def test_coordinator_exits_when_its_owner_process_dies(ipc_dir: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path[:0] = {sys.path!r}
        from corewire.coordinator import DPCoordinator, CoordinatorAddresses
        c = DPCoordinator(1, CoordinatorAddresses(
            "ipc://{ipc_dir}/f", "ipc://{ipc_dir}/s", "ipc://{ipc_dir}/w"))
        print(c.pid, flush=True)
        time.sleep(60)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        assert not pid_gone(pid)
        owner.kill()
        owner.wait()
        assert wait_pid_gone(pid, timeout=5), "the orphaned coordinator did not exit"
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


def test_bind_failure_is_a_clear_error(ipc_dir: Path) -> None:
    addresses = coordinator_addresses(ipc_dir)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = type(addresses)(
            addresses.front_publish, f"tcp://127.0.0.1:{port}", addresses.engine_publish
        )
        with pytest.raises(RuntimeError, match=r"failed to start.*Address already in use"):
            DPCoordinator(1, busy)


def test_non_loopback_tcp_without_keys_is_refused(ipc_dir: Path) -> None:
    addresses = coordinator_addresses(ipc_dir)
    exposed = type(addresses)("tcp://0.0.0.0:0", addresses.engine_stats, addresses.engine_publish)
    with pytest.raises(ValueError, match="CURVE"):
        DPCoordinator(1, exposed)
