"""The output thread of an engine core: it owns the PUSH socket(s) connected to each
front-end's PULL (and a DP engine's coordinator link), encodes what the busy loop queues
into reusable buffers and sends it, holds the busy loop back while a front-end takes
nothing (backpressure), and at a stop delivers what is left or gives up on a front-end
that is gone (docs/protocol.md §5, §7)."""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from typing import Any

import zmq

from corewire.codec import Encoder
from corewire.engine.inputs import RESUME, STOP, IOFailed
from corewire.engine.link import connect_socket
from corewire.engine.peer_watch import PeerWatch
from corewire.protocol import ENGINE_CORE_DEAD

__all__ = [
    "OUTPUT_QUEUE_HIGH",
    "OUTPUT_QUEUE_LOW",
    "OUTPUT_SNDHWM",
    "EncodedFrames",
    "OutputThread",
]

logger = logging.getLogger("corewire.engine")

# Payload buffers kept for reuse by the output thread; more are allocated while ZeroMQ
# still holds the ones in flight (slow reader), but only this many are kept afterwards.
_MAX_FREE_BUFFERS = 8
# A buffer that grew past this is dropped instead of being kept for reuse.
_MAX_KEPT_BUFFER_BYTES = 16 << 20
# Backpressure. Output messages queued for the output thread at which the busy loop
# stops stepping (the PUSH blocks because the front-end stopped reading), and at which
# the output thread tells it to go on. A message is one step's outputs: a few queued
# messages are enough to keep the output thread busy while the loop steps.
OUTPUT_QUEUE_HIGH = 8
OUTPUT_QUEUE_LOW = 2
# Messages the PUSH socket queues for a front-end that is not reading (ZeroMQ's send
# high-water mark); a send past it blocks. Small, so that a paused front-end holds the
# engine back soon; a front-end that reads (vLLM's, with an unbounded receive queue)
# never lets it fill.
OUTPUT_SNDHWM = 128
# Once a stop is requested, how long the output thread waits for a front-end that takes
# nothing (it is shutting down without reading) before it drops what is left, and the
# linger of its sockets after it was blocked.
_STOP_SEND_WAIT_S = 0.25
_STOP_LINGER_MS = 250


def _take_buffer(
    in_flight: collections.deque[tuple[zmq.MessageTracker, bytearray, list[Any]]],
    free: list[bytearray],
) -> bytearray:
    """A payload buffer for the output thread: first the buffers ZeroMQ released go back
    to ``free`` (a bounded number, none that grew too big), then one is taken from it."""
    while in_flight and in_flight[0][0].done:
        buf = in_flight.popleft()[1]
        if len(free) < _MAX_FREE_BUFFERS and len(buf) <= _MAX_KEPT_BUFFER_BYTES:
            free.append(buf)
    return free.pop() if free else bytearray()


class _Abandoned(Exception):
    """The front-end took no output for too long after a stop was requested."""


class EncodedFrames:
    """Frames encoded outside the output thread (utility replies); sent as they are."""

    __slots__ = ("frames",)

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames


class OutputThread:
    """The output thread's part of :class:`~corewire.engine.core.EngineCoreProc` (a mixin:
    its queues, addresses and stop state are the engine core's)."""

    def _output_thread_main(self) -> None:
        sockets: list[zmq.Socket] = []
        linger = self.linger_ms
        hwm = ((zmq.SNDHWM, OUTPUT_SNDHWM),)
        peers = PeerWatch()

        def configure(sock: zmq.Socket[Any], address: str) -> None:
            self.configure_socket(sock, address)
            peers.attach(sock)  # before the connect, so that no connection goes unseen

        try:
            for address in self.output_addresses:
                sockets.append(
                    connect_socket(
                        self._ctx,
                        zmq.PUSH,
                        address,
                        linger_ms=self.linger_ms,
                        options=hwm,
                        configure=configure,
                    )
                )
            if self.coordinator_output is not None:
                # No linger: load reports are disposable, and a coordinator that is gone
                # must not hold this process at exit.
                sockets.append(self._connect(zmq.PUSH, self.coordinator_output, options=hwm))
            self._output_loop(sockets, peers)
            if time.monotonic() - self._output_blocked_at < 1.0:
                # The front-end was not reading lately: what ZeroMQ still queues may
                # never be taken, and must not hold the exit for the whole linger.
                linger = min(linger, _STOP_LINGER_MS)
        except _Abandoned:
            logger.warning(
                "engine %d stopping: the front-end took no output for %.1f s; dropping "
                "%d unsent message(s)",
                self.engine_index,
                _STOP_SEND_WAIT_S,
                self.output_queue.qsize(),
            )
            linger = 0
        except Exception as exc:
            logger.exception("engine output thread failed")
            with self._dead_lock:
                first = not self._dead_sent
                self._dead_sent = True
            if first:
                for sock in sockets[: len(self.output_addresses)]:
                    with contextlib.suppress(zmq.ZMQError):
                        sock.send(ENGINE_CORE_DEAD, flags=zmq.NOBLOCK)
            self.input_queue.put(IOFailed(exc))
        finally:
            clients = len(self.output_addresses)
            # Lingering delivers what is queued to a front-end still there; for one that
            # has gone it would only hold the exit (docs/protocol.md §7).
            gone = [not peers.has_peer(sock) for sock in sockets[:clients]]
            peers.close()
            if any(gone) and linger > 0:
                logger.info(
                    "engine %d stopping: no front-end connected on %d output link(s); "
                    "not waiting to deliver what is left there",
                    self.engine_index,
                    sum(gone),
                )
            for sock, no_peer in zip(sockets[:clients], gone, strict=True):
                sock.close(linger=0 if no_peer else min(linger, self.linger_ms))
            for sock in sockets[clients:]:
                # close(linger=) would override the coordinator socket's LINGER of 0.
                sock.close(linger=0)

    def _output_loop(self, sockets: list[zmq.Socket], peers: PeerWatch) -> None:
        """Encode and send until the stop sentinel (``peers``: polled whenever the queue
        is empty).

        Payloads are encoded into reusable bytearrays. ZeroMQ sends large frames without
        copying, so a buffer is reused only once its tracker says ZeroMQ released it;
        until then it waits in ``in_flight`` together with its frames (which keep the
        aux arrays alive too).
        """
        encoder = Encoder(release=self.release)
        to_wire = self._to_wire
        free: list[bytearray] = []
        in_flight: collections.deque[tuple[zmq.MessageTracker, bytearray, list[Any]]] = (
            collections.deque()
        )
        num_clients = len(self.output_addresses)
        output_queue = self.output_queue
        get = output_queue.get
        qsize = output_queue.qsize
        wait = self._wait_writable
        SNDMORE = zmq.SNDMORE
        NOBLOCK = zmq.NOBLOCK
        Again = zmq.Again
        while True:
            if self._output_paused and qsize() <= OUTPUT_QUEUE_LOW:
                self._output_paused = False
                self.input_queue.put(RESUME)
            if not qsize():
                peers.poll()
            item = get()
            if item is STOP:
                return
            index, message = item
            if message is ENGINE_CORE_DEAD:
                self._send_dead(sockets[:num_clients])
                continue
            sock = sockets[index] if -len(sockets) <= index < len(sockets) else sockets[0]
            if isinstance(message, EncodedFrames):
                wait(sock)
                sock.send_multipart(message.frames, copy=False)
                continue
            if to_wire is not None:
                message = to_wire(message)
            buf = _take_buffer(in_flight, free)
            frames = encoder.encode_into(message, buf)
            # The payload's own tracker decides when `buf` is free again: the one
            # send_multipart returns belongs to the last frame, which for a small aux
            # frame (copied) is done at once while ZeroMQ still holds the payload.
            last = len(frames) - 1
            # Only a message's first part can block (ZeroMQ takes the rest once it took
            # the first): when the front-end stopped reading, wait for room.
            try:
                tracker = sock.send(buf, (SNDMORE if last else 0) | NOBLOCK, copy=False, track=True)
            except Again:
                wait(sock)
                tracker = sock.send(buf, SNDMORE if last else 0, copy=False, track=True)
            for i in range(1, last + 1):
                sock.send(frames[i], SNDMORE if i < last else 0, copy=False)
            if not isinstance(tracker, zmq.MessageTracker) or tracker.done:
                free.append(buf)
            else:
                in_flight.append((tracker, buf, frames))

    def _send_dead(self, client_sockets: list[zmq.Socket]) -> None:
        """ENGINE_CORE_DEAD to every client (output thread)."""
        for sock in client_sockets:
            self._wait_writable(sock)
            sock.send(ENGINE_CORE_DEAD)

    def _wait_writable(self, sock: zmq.Socket) -> None:
        """Return once ``sock`` takes a message; raise :class:`_Abandoned` when a stop
        was requested and the front-end took nothing for ``_STOP_SEND_WAIT_S``."""
        if sock.poll(0, zmq.POLLOUT):
            return
        deadline = None
        self._output_blocked_at = time.monotonic()
        while not sock.poll(50, zmq.POLLOUT):
            now = self._output_blocked_at = time.monotonic()
            if self._stop_requested:
                if deadline is None:
                    deadline = now + _STOP_SEND_WAIT_S
                elif now > deadline:
                    raise _Abandoned
