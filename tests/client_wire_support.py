"""Raw peers of a real client, driven by the test: engines and a DP coordinator.

A :class:`EnginePeer` is what an engine is to a client on the wire (a DEALER on the
request link with the engine's identity, a PUSH on the output link), with nothing
behind it: the test reads the exact frames the client sends and pushes the exact frames
it wants the client to read (made by corewire or by vLLM's own encoder). A
:class:`CoordinatorPeer` binds a DP coordinator's front-end publisher: it publishes what
the test gives it and records what the front-end sends.

Peers connect before the client binds (ZeroMQ queues the ready message meanwhile), so
a client built after them finds every engine ready. :func:`client_and_peer` builds the
commonest pair: one client, one engine peer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq

from corewire.coordinator import CoordinatorAddresses
from corewire.protocol import REQUEST_ADD, engine_identity
from dp_support import Sockets


def client_addresses(ipc_dir: Path) -> dict[str, str]:
    """Request and output addresses for a client inside the test's private directory."""
    return {"input_address": f"ipc://{ipc_dir}/in", "output_address": f"ipc://{ipc_dir}/out"}


@contextlib.contextmanager
def client_and_peer(
    ipc_dir: Path, sockets: Sockets, client_class: Any, **kwargs: Any
) -> Iterator[tuple[Any, EnginePeer]]:
    """A client of ``client_class`` (``kwargs`` besides its addresses; a 10 s ready
    timeout) in front of one :class:`EnginePeer`; the client shut down on leaving."""
    addresses = client_addresses(ipc_dir)
    peer = EnginePeer(sockets, addresses)
    client = client_class(client_addresses=addresses, ready_timeout=10, **kwargs)
    try:
        yield client, peer
    finally:
        client.shutdown()


class EnginePeer:
    """Engine ``index`` of a client at ``addresses``, as raw sockets; sends its ready
    message (an empty payload, which clients accept) at once."""

    def __init__(self, sockets: Sockets, addresses: dict[str, str], index: int = 0) -> None:
        self.index = index
        self.requests = sockets.socket(zmq.DEALER)
        self.requests.setsockopt(zmq.IDENTITY, engine_identity(index))
        self.requests.connect(addresses["input_address"])
        self.outputs = sockets.socket(zmq.PUSH)
        self.outputs.connect(addresses["output_address"])
        self.requests.send(b"")

    def recv(self, timeout: float = 10.0) -> list[bytes]:
        """The next message from the client: ``[request_type, payload, *aux]``."""
        if not self.requests.poll(int(timeout * 1000)):
            raise AssertionError(f"engine {self.index}: nothing from the client in {timeout} s")
        return self.requests.recv_multipart()

    def nothing_for(self, seconds: float) -> bool:
        """Whether the client sends nothing for ``seconds``."""
        return not self.requests.poll(int(seconds * 1000))

    def recv_utility(self, timeout: float = 10.0) -> list[Any]:
        """The next utility call, decoded: ``[client_index, call_id, method, args]``."""
        frames = self.recv(timeout)
        assert frames[0] == b"\x03", frames[0]
        return msgspec.msgpack.decode(frames[1])

    def recv_add(self, timeout: float = 10.0) -> list[bytes]:
        """The next message, which must be an ADD: its frames after the type
        (``[payload, *aux]``)."""
        frames = self.recv(timeout)
        assert frames[0] == REQUEST_ADD, frames[0]
        return frames[1:]

    def send(self, frames: Sequence[Any]) -> None:
        """Push one output message (``[payload, *aux]``) to the client."""
        self.outputs.send_multipart([bytes(f) for f in frames])


class CoordinatorPeer:
    """The front-end publisher of a DP coordinator at ``addresses`` (an XPUB)."""

    def __init__(self, sockets: Sockets, addresses: CoordinatorAddresses) -> None:
        self.front = sockets.socket(zmq.XPUB)
        self.front.bind(addresses.front_publish)
        #: Everything a front-end sent but its subscription.
        self.received: list[bytes] = []
        self.subscribed = False

    def _drain(self, timeout: float) -> None:
        while self.front.poll(int(timeout * 1000)):
            msg = self.front.recv()
            if msg == b"\x01":
                self.subscribed = True
            else:
                self.received.append(msg)
            timeout = 0

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Until a front-end subscribed."""
        deadline = time.monotonic() + timeout
        while not self.subscribed:
            if time.monotonic() > deadline:
                raise AssertionError("no front-end subscribed to the coordinator")
            self._drain(0.05)

    def publish(self, payload: bytes) -> None:
        """Send one publication frame to the subscribed front-ends."""
        self.front.send(payload)

    def messages(self, settle: float = 0.3) -> list[bytes]:
        """What front-ends sent (subscriptions aside), after ``settle`` seconds."""
        self._drain(settle)
        return list(self.received)
