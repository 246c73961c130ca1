"""The engine side of its links: socket set-up, the receiving loop, output stamping.

Every engine-side socket is made by :func:`connect_socket`; the engine core's receiving
thread (its request links and coordinator subscriptions) drains its sockets through
:class:`Receiver` (the replay engine, which receives and steps on one thread, does not:
see :class:`corewire.engine.replay.EngineLink`); and every ``EngineCoreOutputs`` an
engine sends is built by :func:`engine_outputs`, which
stamps it with the engine's index and the time (:func:`stamp_unstamped` for messages a
test engine built itself).

Wire format: docs/protocol.md §2 (sockets and identities) and §5.2 (``engine_index``,
``timestamp``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from corewire.protocol import EngineCoreOutputs

__all__ = ["Receiver", "connect_socket", "engine_outputs", "stamp_unstamped"]

#: How often a receiving loop that waits looks at its stop flag (milliseconds).
POLL_INTERVAL_MS = 200
#: Messages a receiving loop takes from one socket before it looks at the others.
DRAIN_BUDGET = 64


def engine_outputs(engine_index: int, **fields: Any) -> EngineCoreOutputs:
    """An ``EngineCoreOutputs`` from engine ``engine_index``, stamped now
    (``time.monotonic()``, as vLLM's engines stamp theirs); ``fields`` are the others."""
    return EngineCoreOutputs(engine_index=engine_index, timestamp=time.monotonic(), **fields)


def stamp_unstamped(outputs: EngineCoreOutputs) -> EngineCoreOutputs:
    """``outputs`` built without :func:`engine_outputs` (by a test engine), stamped now
    if they carry no timestamp: vLLM's front-end takes a 0.0 for a missing one and uses
    its own clock."""
    if not outputs.timestamp:
        outputs.timestamp = time.monotonic()
    return outputs


def connect_socket(
    ctx: zmq.Context[Any],
    socket_type: int,
    address: str,
    *,
    linger_ms: int = 0,
    identity: bytes | None = None,
    options: Iterable[tuple[int, int | bytes]] = (),
    configure: Callable[[zmq.Socket[Any], str], None] | None = None,
) -> zmq.Socket[Any]:
    """A new socket connected to ``address``: ``identity`` and the ZeroMQ ``options``
    set, then ``configure(sock, address)`` (e.g. CURVE keys) run, before the connect.
    The socket is closed again if any step fails."""
    sock = ctx.socket(socket_type)
    try:
        sock.setsockopt(zmq.LINGER, linger_ms)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        for option, value in options:
            sock.setsockopt(option, value)
        if configure is not None:
            configure(sock, address)
        sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


class Receiver:
    """Sockets polled by one thread, each with the function that handles its messages.

    :meth:`run` drains every readable socket before polling again (ZeroMQ's readiness is
    edge-triggered) until ``stop`` is set; :meth:`close` closes the sockets.
    """

    def __init__(self) -> None:
        self._handlers: dict[zmq.Socket[Any], Callable[[list[zmq.Frame]], None]] = {}
        self._poller = zmq.Poller()

    def add(self, sock: zmq.Socket[Any], handler: Callable[[list[zmq.Frame]], None]) -> None:
        """Poll ``sock`` too; each message (its frames, not copied) goes to ``handler``."""
        self._handlers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def run(self, stop: threading.Event, on_wake: Callable[[], None] | None = None) -> None:
        """Receive until ``stop`` is set; ``on_wake`` runs before each poll."""
        handlers = self._handlers
        poll = self._poller.poll
        while not stop.is_set():
            if on_wake is not None:
                on_wake()
            for sock, _ in poll(POLL_INTERVAL_MS):
                handler = handlers[sock]
                # At most a budget per socket and round: a flood on one socket (requests)
                # must not hold back the others (the DP wave subscription) or the stop
                # check. The poll is level-triggered, so what is left is seen next round.
                for _ in range(DRAIN_BUDGET):
                    try:
                        frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    handler(frames)

    def close(self) -> None:
        """Close every socket added (no linger: unread input is dropped)."""
        for sock in self._handlers:
            sock.close(linger=0)
        self._handlers.clear()
