"""CURVE keys: ``corewire keygen``, pyzmq's authenticator, and the coordinator behind CURVE.

Checks ``docs/protocol.md`` §10 (TCP from other hosts only with CURVE keys) and §8.2.
"""

from __future__ import annotations

import contextlib
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from corewire.coordinator import CoordinatorAddresses, DPCoordinator
from corewire.curve import is_loopback_address, require_curve_for
from corewire.dp_messages import WAVE_COMPLETE
from corewire.keygen import (
    CurveAuthenticator,
    CurveClientKeys,
    CurveServerKeys,
    apply_client,
    apply_server,
)
from dp_support import (
    EnginePeer,
    FrontEndPeer,
    Sockets,
    coordinator_addresses,
    run_keygen,
)
from port_support import retry_port_conflicts, unused_tcp_port


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    assert run_keygen(tmp_path / "keys", 2) == 0
    return tmp_path / "keys"


def test_keygen_layout_and_permissions(keys: Path) -> None:
    server = CurveServerKeys.from_dir(keys / "server")
    clients = [CurveClientKeys.from_dir(keys / f"client-{k}") for k in range(2)]
    assert server.authorized == {c.public for c in clients}
    assert all(c.server_public == server.public for c in clients)
    assert len({server.public, *(c.public for c in clients)}) == 3
    for secret in [keys / "server/server.key_secret", keys / "client-0/client.key_secret"]:
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE((keys / "server").stat().st_mode) == 0o700
    # Public files carry no secret.
    assert "secret-key" not in (keys / "client-1/server.key").read_text()
    # Readable by ZeroMQ's own certificate loader.
    assert zmq.auth.load_certificate(keys / "server/server.key")[0] == server.public


def test_keygen_through_the_corewire_command(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "corewire.cli", "keygen", str(tmp_path / "k"), "--clients", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    server = CurveServerKeys.from_dir(tmp_path / "k/server")
    assert len(server.authorized) == 2


def test_keygen_refuses_to_overwrite(keys: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (keys / "server/server.key_secret").read_bytes()
    assert run_keygen(keys, 1) == 1
    assert "refusing to overwrite" in capsys.readouterr().out
    assert (keys / "server/server.key_secret").read_bytes() == before


def test_keys_round_trip_for_a_child_command_line(keys: Path) -> None:
    client = CurveClientKeys.from_dir(keys / "client-0")
    assert CurveClientKeys.from_wire(client.to_wire()) == client


def test_missing_authorized_keys_is_an_error(keys: Path) -> None:
    for key in (keys / "server/authorized_clients").iterdir():
        key.unlink()
    with pytest.raises(ValueError, match="no authorized client keys"):
        CurveServerKeys.from_dir(keys / "server")


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("ipc:///tmp/x", True),
        ("inproc://x", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.3.4.5:1", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.0.0.1:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://example.com:5555", False),
        ("udp://127.0.0.1:5", False),
    ],
)
def test_loopback_detection(address: str, loopback: bool) -> None:
    assert is_loopback_address(address) is loopback
    if loopback:
        require_curve_for(address, None)
    else:
        with pytest.raises(ValueError, match="corewire keygen"):
            require_curve_for(address, None)
        require_curve_for(address, object())


class CurvePair:
    """A CURVE server PULL behind a CurveAuthenticator, and a factory of client PUSH sockets."""

    def __init__(self, keys: Path) -> None:
        self.server_ctx: zmq.Context[Any] = zmq.Context()
        self.client_ctx: zmq.Context[Any] = zmq.Context()
        self.server_keys = CurveServerKeys.from_dir(keys / "server")
        self.zap = CurveAuthenticator(self.server_ctx, self.server_keys.authorized)
        self.pull = self.server_ctx.socket(zmq.PULL)
        self.pull.linger = 0
        apply_server(self.pull, self.server_keys)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.clients: list[zmq.Socket[Any]] = []

    def client(self, keys: CurveClientKeys) -> zmq.Socket[Any]:
        push = self.client_ctx.socket(zmq.PUSH)
        push.linger = 0
        apply_client(push, keys)
        push.connect(f"tcp://127.0.0.1:{self.port}")
        self.clients.append(push)
        return push

    def received(self, timeout: float, expect: int | None = None) -> list[bytes]:
        """Messages until ``expect`` arrived or none came for ``timeout`` seconds."""
        out: list[bytes] = []
        while (expect is None or len(out) < expect) and self.pull.poll(timeout * 1000):
            out.append(self.pull.recv())
        return out

    def close(self) -> None:
        for sock in self.clients:
            sock.close(linger=0)
        self.pull.close(linger=0)
        self.zap.stop()
        self.server_ctx.term()
        self.client_ctx.term()


@pytest.fixture
def curve_pair(keys: Path) -> Iterator[CurvePair]:
    pair = CurvePair(keys)
    yield pair
    pair.close()


def test_authorized_client_gets_through(keys: Path, curve_pair: CurvePair) -> None:
    push = curve_pair.client(CurveClientKeys.from_dir(keys / "client-1"))
    push.send(b"hello")
    assert curve_pair.received(timeout=5, expect=1) == [b"hello"]


def test_wrong_client_key_is_refused(keys: Path, curve_pair: CurvePair, tmp_path: Path) -> None:
    # A well-formed key pair that knows the server's public key but is not authorized.
    assert run_keygen(tmp_path / "other", 1) == 0
    intruder = CurveClientKeys.from_dir(tmp_path / "other/client-0")
    intruder = CurveClientKeys(intruder.public, intruder.secret, curve_pair.server_keys.public)
    # A refused peer may not even get a pipe to queue into (zmq.Again): refused either way.
    with contextlib.suppress(zmq.Again):
        curve_pair.client(intruder).send(b"injected", zmq.NOBLOCK)
    # A plain (no CURVE) peer is refused by the handshake too.
    plain = curve_pair.client_ctx.socket(zmq.PUSH)
    plain.linger = 0
    curve_pair.clients.append(plain)
    plain.connect(f"tcp://127.0.0.1:{curve_pair.port}")
    with contextlib.suppress(zmq.Again):
        plain.send(b"plain", zmq.NOBLOCK)
    assert curve_pair.received(timeout=1.0) == []
    # The intruder was refused by the handler (the plain peer fails earlier, in the
    # handshake: mechanisms differ, so the handler never hears of it).
    assert intruder.public in curve_pair.zap.refused
    # The server still serves authorized clients afterwards.
    curve_pair.client(CurveClientKeys.from_dir(keys / "client-0")).send(b"ok")
    assert curve_pair.received(timeout=5, expect=1) == [b"ok"]


def test_wrong_server_key_is_refused(keys: Path, curve_pair: CurvePair, tmp_path: Path) -> None:
    assert run_keygen(tmp_path / "other", 0) == 0
    good = CurveClientKeys.from_dir(keys / "client-0")
    other_server_public = zmq.auth.load_certificate(tmp_path / "other/server/server.key")[0]
    misdirected = curve_pair.client(CurveClientKeys(good.public, good.secret, other_server_public))
    with contextlib.suppress(zmq.Again):
        misdirected.send(b"misdirected", zmq.NOBLOCK)
    assert curve_pair.received(timeout=1.0) == []


def test_authenticator_stops_on_collection(keys: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    handler = CurveAuthenticator(ctx, frozenset())
    thread = handler.thread
    assert thread.name == "corewire-zap" and thread.is_alive()
    del handler
    thread.join(timeout=5)
    assert not thread.is_alive()
    ctx.term()


@retry_port_conflicts
def test_coordinator_behind_curve(keys: Path, ipc_dir: Path) -> None:
    addresses = coordinator_addresses(ipc_dir).with_remote(
        f"tcp://127.0.0.1:{unused_tcp_port()}", f"tcp://127.0.0.1:{unused_tcp_port()}"
    )
    coord = DPCoordinator(2, addresses, curve_server_dir=keys / "server")
    sockets = Sockets()
    remote = CoordinatorAddresses(*addresses.for_engine(remote=True))
    try:
        front = FrontEndPeer(sockets, addresses)
        assert front.recv() == [[[0, 0], [0, 0]], 0, False]
        good = EnginePeer(sockets, remote, 0, curve=CurveClientKeys.from_dir(keys / "client-0"))
        # The wave state for a new subscriber: it got through.
        assert good.recv()[0] == WAVE_COMPLETE
        server_public = CurveClientKeys.from_dir(keys / "client-1").server_public
        public, secret = zmq.curve_keypair()  # a key pair the server never authorized
        bad = EnginePeer(sockets, remote, 1, curve=CurveClientKeys(public, secret, server_public))
        plain = EnginePeer(sockets, remote, 1)  # no CURVE at all
        bad.report(waiting=7, running=7)
        plain.report(waiting=8, running=8)
        good.report(waiting=1, running=0)
        # Local (ipc) engines need no keys.
        EnginePeer(sockets, addresses, 1).report(waiting=0, running=2)
        msg = front.recv_until(lambda m: m[0] == [[1, 0], [0, 2]])
        assert msg[0] == [[1, 0], [0, 2]]  # the refused engines' reports never arrived
        with pytest.raises(AssertionError):
            bad.recv(timeout=0.3)
    finally:
        sockets.close()
        coord.shutdown()


@retry_port_conflicts
def test_remote_listening_needs_keys_unless_loopback(ipc_dir: Path) -> None:
    exposed = coordinator_addresses(ipc_dir).with_remote("tcp://10.1.2.3:1", "tcp://10.1.2.3:2")
    with pytest.raises(ValueError, match="CURVE"):
        DPCoordinator(1, exposed)
    loopback = coordinator_addresses(ipc_dir).with_remote(
        f"tcp://127.0.0.1:{unused_tcp_port()}", f"tcp://127.0.0.1:{unused_tcp_port()}"
    )
    DPCoordinator(1, loopback).shutdown()
