"""Whether an engine's output sockets still have a front-end connected.

A PUSH socket that connects queues its messages whether or not anyone is at the other
end, and closing it waits its whole linger for a peer to take them. With the front-end
reading, that wait is what delivers everything already sent; with the front-end gone
(its PULL closed), it delivers nothing and only holds the exit (5 s a stop). ZeroMQ's
socket monitor says which it is: :class:`PeerWatch` counts each socket's connections
from its CONNECTED and DISCONNECTED events, so the engine lingers only where a peer is
there to take what is queued (docs/protocol.md §7).
"""

from __future__ import annotations

import contextlib
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = ["PeerWatch"]

_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class _Watched:
    __slots__ = ("monitor", "peers", "sock")

    def __init__(self, sock: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> None:
        self.sock = sock
        self.monitor = monitor
        self.peers = 0


class PeerWatch:
    """Connection counts of the sockets :meth:`attach` was given (owned by one thread,
    the one that uses the sockets). :meth:`close` ends the monitoring."""

    def __init__(self) -> None:
        self._watched: dict[zmq.Socket[Any], _Watched] = {}

    def attach(self, sock: zmq.Socket[Any]) -> None:
        """Watch ``sock``; call before it connects, or its first connection goes unseen
        (and a connected socket would be taken for one without a peer)."""
        self._watched[sock] = _Watched(sock, sock.get_monitor_socket(_EVENTS))

    def poll(self) -> None:
        """Apply the events queued so far (cheap when there are none: one option read
        per socket). Call now and then (the engine: whenever its output queue is
        empty), so that the monitor's own queue never fills and drops events."""
        for watched in self._watched.values():
            monitor = watched.monitor
            while monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
                if event == zmq.EVENT_CONNECTED:
                    watched.peers += 1
                elif event == zmq.EVENT_DISCONNECTED:
                    watched.peers = max(0, watched.peers - 1)

    def has_peer(self, sock: zmq.Socket[Any]) -> bool:
        """Whether ``sock`` has a connected peer, as of the events seen now (a socket
        not watched: assumed to have one)."""
        self.poll()
        watched = self._watched.get(sock)
        return watched is None or watched.peers > 0

    def close(self) -> None:
        """Stop monitoring and close the monitor sockets (before the sockets close)."""
        for watched in self._watched.values():
            with contextlib.suppress(zmq.ZMQError):
                watched.sock.disable_monitor()
            watched.monitor.close(linger=0)
        self._watched.clear()
