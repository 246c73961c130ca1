"""The ready handshake: wait until every engine has sent its ready message.

One implementation (:class:`ReadyWait`) for the client's start-up, which blocks, and for
a DP client's scale-up, which waits on its event loop: both read the ROUTER the same way,
fail the same way when an engine process exits first (with the reason the process
reported, see :mod:`corewire.engine.startup`) or when the time is up; only the way they
wait between two reads differs.

Wire format: docs/protocol.md §2 (identities) and §3.1 (the ready response).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import msgspec
import zmq

from corewire.engine.startup import read_startup_error
from corewire.errors import ProtocolError
from corewire.logtext import bounded
from corewire.protocol import READY_STATUS, engine_index_of

__all__ = ["ReadyWait", "parse_ready"]

logger = logging.getLogger("corewire.client")

#: How often a wait on the event loop looks at the socket and the processes.
ASYNC_POLL_S = 0.02


def parse_ready(identity: bytes, payload: bytes) -> dict[str, Any]:
    """An engine's ready map (empty when it sent none); raises ``ProtocolError`` for
    malformed msgpack and ``RuntimeError`` when the engine did not report READY."""
    if not payload:
        return {}
    try:
        msg = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"engine {identity!r} sent a malformed ready message") from exc
    if not isinstance(msg, dict) or msg.get("status", READY_STATUS) != READY_STATUS:
        raise RuntimeError(f"engine {identity!r} did not report READY: {msg!r:.200}")
    return msg


class ReadyWait:
    """Waits for the ready messages of the engines ``identities`` on ``socket`` (the
    client's ROUTER, asyncio or not), watching ``processes`` (local engines and the
    like: one that exits first fails the wait).

    ``report_path(process_name)`` is where a process reports why it failed to start
    (None: nowhere). ``address`` names the socket in the timeout error.
    ``on_unexpected(identity, ready_map)`` is given the ready message of an engine not
    waited for (one that rejoined meanwhile); without it, such a message is logged.
    """

    def __init__(
        self,
        socket: Any,
        identities: Iterable[bytes],
        processes: Iterable[Any],
        timeout: float,
        *,
        address: str,
        report_path: Callable[[str], str | None],
        on_unexpected: Callable[[bytes, dict[str, Any]], None] | None = None,
    ) -> None:
        # A blocking view of the ROUTER (the client's own socket may be an asyncio one,
        # on which nothing waits: a direct read takes no wake-up from anyone).
        self._sock: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        self._missing = set(identities)
        self._processes = list(processes)
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._address = address
        self._report_path = report_path
        self._on_unexpected = on_unexpected
        #: Ready message of each engine that sent one (identity -> map).
        self.info: dict[bytes, dict[str, Any]] = {}

    def wait(self) -> dict[bytes, dict[str, Any]]:
        """Block until every engine is ready; returns :attr:`info`."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        sentinels = {p.sentinel: p for p in self._processes}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        while not self._step():
            left = self._deadline - time.monotonic()
            for fd, _ in poller.poll(int(max(left, 0.0) * 1000) + 1):
                if fd in sentinels:
                    # The sentinel closes just before the exit status is ready.
                    sentinels[fd].join(1.0)
        return self.info

    async def wait_async(self, check: Callable[[], None]) -> dict[bytes, dict[str, Any]]:
        """Wait on the running event loop until every engine is ready, calling
        ``check()`` (which raises to give up, e.g. once the client died) between reads;
        returns :attr:`info`."""
        while True:
            check()
            if self._step():
                return self.info
            await asyncio.sleep(ASYNC_POLL_S)

    def _step(self) -> bool:
        """Read what came; returns True once every engine is ready, raises
        ``RuntimeError`` when a process exited and ``TimeoutError`` when the time is up."""
        sock = self._sock
        while cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
            identity, *rest = sock.recv_multipart()
            info = parse_ready(identity, rest[-1] if rest else b"")
            if identity in self._missing:
                self.info[identity] = info
                self._missing.discard(identity)
            elif self._on_unexpected is not None:
                self._on_unexpected(identity, info)
            else:
                self.info[identity] = info
                logger.warning("ready message from unexpected engine %r", bounded(identity))
        if not self._missing:
            return True
        for proc in self._processes:
            if not proc.is_alive():
                # A Ray actor's handle carries its error; a local process wrote a file.
                cause = (
                    getattr(proc, "startup_error", None)
                    or getattr(proc, "death_detail", None)
                    or read_startup_error(self._report_path(proc.name))
                )
                raise RuntimeError(
                    f"engine process {proc.name} exited with code {proc.exitcode} before it "
                    + (f"was ready: {cause}" if cause else "was ready; its error is logged above")
                )
        if time.monotonic() >= self._deadline:
            names = sorted(engine_index_of(i) for i in self._missing)
            raise TimeoutError(
                f"engine(s) {names} sent no ready message within {self._timeout:g} s on "
                f"{self._address}"
            )
        return False
