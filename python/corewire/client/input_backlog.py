"""Input-side backpressure: the bytes queued toward one engine, and the callers waiting
for room below their bound (the twin of the output backlog, ``max_output_backlog``).

What is counted: the bytes of the messages sent toward the engine that this process's
ZeroMQ has not released yet. The ROUTER's queue is unbounded (a full one would drop
requests silently), so whatever the engine does not read piles up there, in this process:
libzmq's copies of small frames and the caller's buffers behind zero-copy ones. ZeroMQ
releases a message once its I/O thread wrote it to the connection, which happens only as
fast as the engine reads (its own receive limit and the kernel's socket buffer in
between are small and fixed). So "sent, not released" is exactly the memory a flood
costs this process, and bounding it bounds that memory. The number of requests would
not: one request can be 40 bytes or 40 MB.

How it is counted cheaply: ZeroMQ releases the messages of one peer in the order they
were sent, so one tracked message (a *marker*) tells that every message before it is
released too. A message is tracked once ``mark_every`` bytes (1/16 of the bound) went
out since the last marker; the count may overstate what is held by less than that,
never understate it. Untracked sends cost an addition.

Each message counts :data:`MESSAGE_OVERHEAD` bytes on top of its frames (libzmq's
per-part bookkeeping), so a flood of tiny messages is bounded too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from corewire.errors import InputBacklogTimeout

__all__ = [
    "DEFAULT_MAX_INPUT_BACKLOG",
    "ENV",
    "FROM_ENVIRONMENT",
    "MESSAGE_OVERHEAD",
    "InputBacklog",
    "message_bytes",
    "resolve_max_input_backlog",
    "total_held",
]

#: Default ``max_input_backlog`` (bytes per engine): 64 MiB holds about 200k small
#: requests or 2,000 of 8k prompt tokens, seconds of any engine's intake, so a front-end
#: absorbing a spike never waits on it while its engine keeps reading; a stopped or
#: overloaded engine costs this process at most that much per engine.
DEFAULT_MAX_INPUT_BACKLOG = 64 << 20
#: The environment variable that sets the default bound (bytes, or ``none``/``0`` for
#: unbounded): a front-end built by another program (vLLM's ``AsyncLLM`` with corewire's
#: client) takes no constructor argument of ours.
ENV = "COREWIRE_MAX_INPUT_BACKLOG"
#: ``max_input_backlog``'s default: read :data:`ENV`, else :data:`DEFAULT_MAX_INPUT_BACKLOG`.
FROM_ENVIRONMENT: Any = "environment"
#: Smallest bound: below a few messages' worth, every send would be tracked.
MIN_INPUT_BACKLOG = 4096
#: Bytes counted per message over its frames: libzmq keeps a 64-byte ``zmq_msg_t`` per
#: part (identity, request type, payload).
MESSAGE_OVERHEAD = 3 * 64
#: Markers per bound: the count overstates what is held by less than 1/MARKS of it.
MARKS = 16
#: Seconds between looks at the oldest marker while callers wait (ZeroMQ signals a
#: released message to its garbage-collector thread only; nothing wakes the loop).
POLL_S = 0.001
#: Seconds a blocked sync caller waits on a marker before it looks whether the engine
#: died or the client closed.
SYNC_SLICE_S = 0.005


def resolve_max_input_backlog(value: Any) -> int | None:
    """The bound a client uses for ``max_input_backlog=value`` (``ValueError`` for a bad
    one, the environment's included, before anything starts)."""
    source = "max_input_backlog"
    if value is FROM_ENVIRONMENT:
        text = os.environ.get(ENV, "").strip()
        if not text:
            return DEFAULT_MAX_INPUT_BACKLOG
        if text.lower() in ("none", "0", "off", "unbounded"):
            return None
        source = ENV
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{ENV} must be a number of bytes or 'none', got {text!r}") from None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_INPUT_BACKLOG:
        raise ValueError(
            f"{source} must be None or an int >= {MIN_INPUT_BACKLOG} (bytes), got {value!r}"
        )
    return value


def message_bytes(frames: Sequence[Any]) -> int:
    """Bytes one message of ``frames`` counts (its frames plus :data:`MESSAGE_OVERHEAD`)."""
    size = MESSAGE_OVERHEAD
    for frame in frames:
        size += len(frame) if type(frame) is bytes else memoryview(frame).nbytes
    return size


class InputBacklog:
    """Bytes sent toward one engine and not yet released by ZeroMQ, with their bound.

    The send path calls :meth:`note` before each message (True: send it tracked and hand
    the tracker to :meth:`marked`). A caller that finds :meth:`full` (or others already
    waiting: first come, first sent) waits for room: :meth:`wait_async` on the event loop,
    :meth:`wait_blocking` on a thread. A woken async caller sends, then calls
    :meth:`pass_on`. :meth:`fail` ends every wait with the client's death error.
    A message is admitted while what is held is under the bound, so one larger than the
    bound still goes (alone): nothing is refused for its size.
    """

    __slots__ = (
        "_polling",
        "error",
        "high",
        "mark_every",
        "markers",
        "next_mark",
        "pauses",
        "released",
        "sent",
        "waiters",
    )

    def __init__(self, high: int | None) -> None:
        #: The bound in bytes (None: unbounded, nothing tracked).
        self.high = high
        self.mark_every = 1 << 62 if high is None else max(1, high // MARKS)
        #: Bytes sent and bytes known released, since the start (monotonic counters).
        self.sent = 0
        self.released = 0
        self.next_mark = self.mark_every
        #: (tracker, value of :attr:`sent` after its message), oldest first.
        self.markers: deque[tuple[Any, int]] = deque()
        #: Async callers waiting for room, first come first.
        self.waiters: deque[asyncio.Future[None]] = deque()
        #: The death error once :meth:`fail` ran (every later wait raises it).
        self.error: BaseException | None = None
        #: Times a caller found the bound reached.
        self.pauses = 0
        self._polling = False

    # -- counting (send path) --------------------------------------------------------

    def note(self, size: int) -> bool:
        """Count a message of ``size`` bytes about to be sent; whether to track it."""
        sent = self.sent = self.sent + size
        if sent < self.next_mark:
            return False
        self.next_mark = sent + self.mark_every
        return True

    def marked(self, tracker: Any) -> None:
        """Record the tracker of the message :meth:`note` asked to track."""
        self.reap()  # keeps the deque to the markers still in flight
        self.markers.append((tracker, self.sent))

    def reap(self) -> None:
        """Move :attr:`released` past every marker ZeroMQ is done with."""
        markers = self.markers
        while markers and markers[0][0].done:
            self.released = markers.popleft()[1]

    @property
    def held(self) -> int:
        """Bytes sent and not known released (at most ``mark_every`` too many)."""
        self.reap()
        return self.sent - self.released

    def held_now(self) -> int:
        """:attr:`held` without changing anything: safe from another thread (a metrics
        scrape) while the owner sends."""
        released = self.released
        for tracker, sent in list(self.markers):  # a copy: the owner may pop meanwhile
            if not tracker.done:
                break
            released = max(released, sent)
        return self.sent - released

    def full(self) -> bool:
        """Whether the bound is reached (a new message must wait)."""
        high = self.high
        if high is None or self.sent - self.released < high:
            return False
        self.reap()
        # Never True without a marker in flight: the bytes after the last marker are
        # fewer than mark_every < high, so a wait always has a marker to end it.
        return self.sent - self.released >= high

    # -- waiting, asyncio ------------------------------------------------------------

    def must_wait(self) -> bool:
        """Whether a new async caller waits: the bound is reached or others wait."""
        if self.waiters or self.full():
            self.pauses += 1
            return True
        return False

    async def wait_async(self) -> None:
        """Wait (first come, first served) until this caller may send; then it must send
        and call :meth:`pass_on`. Raises the death error once :meth:`fail` ran. A
        cancelled caller leaves nothing behind (a wake-up it got is passed on)."""
        if self.error is not None:
            raise self.error
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self.waiters.append(waiter)
        if len(self.waiters) == 1:
            self._wake(loop)  # the bound may have cleared meanwhile; else polls
        try:
            await waiter
        except BaseException:
            with contextlib.suppress(ValueError):
                self.waiters.remove(waiter)
            if waiter.done() and not waiter.cancelled():
                if waiter.exception() is None:
                    self.pass_on()  # woken, then cancelled: the next one goes instead
            else:
                waiter.cancel()
            raise

    def pass_on(self) -> None:
        """After a woken caller sent (or gave up): wake the next one if there is room."""
        if self.waiters:
            self._wake(asyncio.get_running_loop())

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        waiters = self.waiters
        while waiters and waiters[0].done():
            waiters.popleft()  # cancelled
        if not waiters or self.error is not None:
            return
        if self.full():
            if not self._polling:
                self._polling = True
                loop.call_later(POLL_S, self._poll, loop)
            return
        waiters.popleft().set_result(None)

    def _poll(self, loop: asyncio.AbstractEventLoop) -> None:
        self._polling = False
        self._wake(loop)

    def fail(self, exc: BaseException) -> None:
        """End every wait with ``exc`` (the engine died, or the client closed): the
        owner thread of the loop calls it."""
        if self.error is None:
            self.error = exc
        waiters, self.waiters = self.waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(exc)

    # -- waiting, blocking -----------------------------------------------------------

    def wait_blocking(
        self,
        timeout: float | None,
        dead_error: Callable[[], BaseException | None],
        engine_index: int,
    ) -> None:
        """Block until the bound clears. Raises ``dead_error()`` (when it returns one:
        the engine died or the client closed) within :data:`SYNC_SLICE_S`, and
        :class:`InputBacklogTimeout` after ``timeout`` seconds (None: no limit)."""
        if not self.full():
            return
        self.pauses += 1
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.full():
            error = dead_error()
            if error is not None:
                raise error
            wait_s = SYNC_SLICE_S
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise InputBacklogTimeout(
                        f"engine {engine_index}'s input backlog stayed at its bound "
                        f"(max_input_backlog={self.high} bytes, {self.sent - self.released} "
                        f"held) for {timeout:g} s: the engine reads slower than requests "
                        "come, or not at all; nothing of this request was sent",
                        engine_index=engine_index,
                    )
                wait_s = min(wait_s, left)
            markers = self.markers
            if markers:
                with contextlib.suppress(zmq.NotDone):
                    markers[0][0].wait(wait_s)
            else:  # pragma: no cover - full() implies a marker in flight
                time.sleep(wait_s)


def total_held(backlogs: dict[bytes, InputBacklog]) -> Callable[[], int]:
    """A reader of the bytes held toward all of ``backlogs``' engines (the metrics gauge;
    it references the dict, not the client)."""

    def held() -> int:
        return sum(backlog.held_now() for backlog in list(backlogs.values()))

    return held
