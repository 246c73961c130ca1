"""The output link: the one path from a client's output socket to its output queue.

Every client (async with a plain or an async ``process_engine_outputs`` hook, sync, DP,
and through them vLLM's adapters) reads its engines' frames through one
:class:`OutputLink`, which does, per message: receive -> ENGINE_CORE_DEAD check ->
decode -> utility reply / notification routing -> hook -> queue. What differs between the
clients is only what drives it (a loop reader callback, an asyncio task, a thread) and
how it waits (for the descriptor, for the consumer); :meth:`OutputLink.pump` returns what
the driver must do next.

One budget rule for every driver: a pass handles at most :data:`DRAIN_BUDGET` messages
or :data:`OUTPUT_BUDGET` outputs, then returns :data:`MORE` so that the driver lets the
consumer run before the next pass (a fast engine cannot starve it).

Decisions where the clients used to differ (one behaviour now):

- A message with neither outputs nor scheduler stats (e.g. only ``finished_requests``)
  goes to the hook and, for async clients, not to the queue: it carries nothing their
  consumers read, and waking the consumer for it costs a queue hand-off (vLLM's
  AsyncMPClient, whose behaviour the vLLM front-end sees, drops it too). The DP hook reads
  ``finished_requests`` there. Sync clients queue it (``queue_empty``), as vLLM's
  SyncMPClient does: a blocking caller may wait for the ``finished_requests`` that
  confirm an abort.
- Utility replies resolve their future through
  :func:`~corewire.client.futures.complete_future` (as every other path that completes
  one): a death on another thread (the engine monitor of a sync client) may fail the
  future between a ``done()`` test and the set.
- A reply with call id :data:`~corewire.protocol.EEP_NOTIFICATION_CALL_ID` that no call
  waits for is a notification: it goes to the client's notification handler when it has
  one, and is dropped otherwise (sync clients have none).
- A reply with call id :data:`~corewire.wire.layouts.FT_STATUS_CALL_ID` (-2, vLLM 0.33.0's
  engine status) goes to the client's status handler before any call is looked up, and
  never completes a call (:mod:`corewire.client.ft_status`).

Wire format: docs/protocol.md §5 (engine to front-end), §7 (ENGINE_CORE_DEAD) and §9.2
(a bad frame fails alone).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import zmq

from corewire.client.core import resolve_utility_output
from corewire.client.salvage import fail_undecodable
from corewire.errors import ProtocolError
from corewire.protocol import EEP_NOTIFICATION_CALL_ID, ENGINE_CORE_DEAD
from corewire.wire.layouts import FT_STATUS_CALL_ID

if TYPE_CHECKING:
    from corewire.client._resources import ClientResources
    from corewire.client.liveness import Liveness

__all__ = [
    "DRAIN_BUDGET",
    "EMPTY",
    "MORE",
    "OUTPUT_BUDGET",
    "PAUSED",
    "STOPPED",
    "OutputLink",
]

logger = logging.getLogger("corewire.client")

#: Messages one pass handles before the driver lets other work (the consumer) run.
DRAIN_BUDGET = 64
#: Outputs after which a pass ends too. Bounding the backlog by outputs keeps the number
#: of decoded objects alive at once small: under the default garbage collector, objects
#: that wait in a long backlog survive into the older generations and set off full
#: collections, which cost more than the decoding, and a backlog past the CPU caches
#: makes the consumer's reads slower. Each hand-off costs a loop iteration (a few µs),
#: so the budget must not be small either: 1024 (four frames of 256 outputs) measured
#: about 1.3 µs per such frame cheaper than 512 in benches/client.py, and 4096 slower.
OUTPUT_BUDGET = 1024


class _Status:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: :meth:`OutputLink.pump` results. EMPTY: nothing is queued (wait for the descriptor).
EMPTY: Any = _Status("EMPTY")
#: The budget ran out with messages maybe left: let the consumer run, then pump again.
MORE: Any = _Status("MORE")
#: The queue's backlog reached its high-water mark: wait for the consumer to take it down.
PAUSED: Any = _Status("PAUSED")
#: The link ended (engine dead, client collected, or the link failed): stop driving it.
STOPPED: Any = _Status("STOPPED")

_DEAD_LEN = len(ENGINE_CORE_DEAD)
# Module globals: cheaper to read in the per-message path than zmq's attributes; plain
# ints, because ``&`` on zmq's flag enums runs Python-level enum code (about 0.5 µs).
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)
_Again = zmq.Again
_monotonic = time.monotonic
_FIRST = DRAIN_BUDGET - 1  # what ``left`` is after a pass's first message


def _ended(liveness: Liveness, began: float, status: Any) -> Any:
    """Note a pass that began at ``began`` and ended with ``status`` (EMPTY: the socket
    is drained, the link idles) for the health check; return ``status``."""
    liveness.looked = began
    liveness.idle = status is EMPTY
    liveness.passes += 1
    return status


class OutputLink:
    """Reads one client's output socket into its output queue (see the module docstring).

    ``queue`` needs ``put_nowait(item)`` (outputs or exceptions), ``held`` (the backlog
    count, updated by ``put_nowait``), ``high`` (its high-water mark, None: unbounded)
    and ``full()`` (True when the producer must wait; it counts the pause).

    ``hook(client, outputs)`` sees every output message before the queue; with
    ``hook_is_async`` it is a coroutine function the driver awaits: :meth:`pump` then
    returns each such message, and the driver passes it back to the next :meth:`pump`
    after the hook. ``notify(utility)`` gets the notifications. The client is referenced
    only through ``client_ref`` (for the hook), so the link never keeps it alive.
    ``status(engine_index, utility)`` gets the engine status replies (call id -2; dropped
    when None).

    ZeroMQ's descriptor is edge-triggered: messages are received with ``NOBLOCK`` until
    ``Again``, or until ``EVENTS`` shows none queued (either re-arms it).
    """

    __slots__ = (
        "_client_ref",
        "_decode",
        "_events",
        "_heard",
        "_high",
        "_hook",
        "_left",
        "_liveness",
        "_metrics",
        "_name",
        "_notify",
        "_pop",
        "_put",
        "_queue",
        "_queue_empty",
        "_recv",
        "_resources",
        "_status",
        "_work",
        "async_hook",
        "fd",
    )

    def __init__(
        self,
        socket: Any,
        decoder: Any,
        resources: ClientResources,
        queue: Any,
        *,
        name: str,
        client_ref: Callable[[], Any] | None = None,
        hook: Callable[..., Any] | None = None,
        hook_is_async: bool = False,
        notify: Callable[[Any], None] | None = None,
        status: Callable[[int, Any], None] | None = None,
        queue_empty: bool = False,
    ) -> None:
        # A blocking view of the socket: a direct non-blocking receive costs a fraction of
        # pyzmq's asyncio receive, whose machinery is not needed to wait on the descriptor.
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        self._recv = raw.recv
        self._events = cast("Callable[[int], int]", raw.get)
        #: The socket's descriptor (edge-triggered: readable after each change of state).
        self.fd = cast(int, raw.getsockopt(zmq.FD))
        metrics = self._metrics = resources.metrics
        # Metrics on: a decoder that times and counts each message; off: the plain one.
        self._decode = decoder.decode if metrics is None else metrics.wrap_decode(decoder.decode)
        self._pop = resources.registry.pop
        # Engine index -> when last heard from, and the link's passes: the health
        # check's evidence of life (corewire.client.liveness).
        self._liveness = resources.liveness
        self._heard = resources.liveness.heard
        self._resources = resources
        self._queue = queue
        self._put = queue.put_nowait
        # Checked after each queued message; the queue's own test counts the pause.
        self._high = queue.high if queue.high is not None else 1 << 62
        self._name = name
        self._client_ref = client_ref
        self._hook = hook
        #: Whether :meth:`pump` hands output messages to the driver for an async hook.
        self.async_hook = hook is not None and hook_is_async
        self._notify = notify
        self._status = status
        #: Whether messages with neither outputs nor stats are queued too (sync clients).
        self._queue_empty = queue_empty
        self._left = DRAIN_BUDGET
        self._work = 0

    def pump(self, hooked: Any = None) -> Any:
        """Run (or go on with) one pass of the budget rule.

        Returns :data:`EMPTY`, :data:`MORE`, :data:`PAUSED` or :data:`STOPPED` (what the
        driver does next), or, with an async hook, an output message for the hook, which
        the driver passes back as ``hooked`` once the hook is done.
        """
        if self._resources.closed:
            # A resumption scheduled before the client closed: its socket is gone.
            return STOPPED
        recv, decode, put, hook = self._recv, self._decode, self._put, self._hook
        queue, high, heard = self._queue, self._high, self._heard
        # One clock read a pass: the health check needs when, to within a pass.
        now = _monotonic()
        liveness = self._liveness
        liveness.idle = False
        # A pass starts afresh unless it goes on after an async hook.
        left, work = (DRAIN_BUDGET, 0) if hooked is None else (self._left, self._work)
        outputs = hooked
        try:
            while True:
                if outputs is None:
                    if not left:
                        break
                    left -= 1
                    try:
                        first = recv(_NOBLOCK, copy=False)
                    except _Again:
                        return _ended(liveness, now, EMPTY)
                    frames = [first]
                    while first.more:
                        first = recv(copy=False)
                        frames.append(first)
                    if len(first) == _DEAD_LEN and len(frames) == 1 and self._dead(first):
                        return STOPPED
                    try:
                        outputs = decode(frames)
                    except ProtocolError as exc:
                        self._bad_frame(exc, frames)
                    else:
                        heard[outputs.engine_index] = now
                        if outputs.utility_output is not None:
                            self._route_utility(outputs)
                            outputs = None
                        elif hook is not None:
                            if self.async_hook:
                                return self._hold(outputs, left, work)
                            if (client := self._client_ref()) is None:  # type: ignore[misc]
                                return STOPPED
                            hook(client, outputs)
                if outputs is not None:
                    if outputs.outputs or outputs.scheduler_stats or self._queue_empty:
                        put(outputs)
                        if queue.held >= high and queue.full():
                            return PAUSED
                        work += len(outputs.outputs)
                        if work >= OUTPUT_BUDGET:
                            break
                    outputs = None
                # At low load one message comes per wake-up: asking whether more are
                # queued costs less than a receive that raises Again.
                if left == _FIRST and not self._events(_EVENTS) & _POLLIN:
                    return _ended(liveness, now, EMPTY)
            return STOPPED if self._resources.closed else _ended(liveness, now, MORE)
        except Exception as exc:
            self.fail(exc)
            return STOPPED

    def _hold(self, outputs: Any, left: int, work: int) -> Any:
        # The pass goes on after the async hook, with what is left of its budget.
        self._left, self._work = left, work
        return outputs

    def _dead(self, frame: Any) -> bool:
        if frame.bytes != ENGINE_CORE_DEAD:
            return False
        self._resources.mark_dead("Engine core sent ENGINE_CORE_DEAD (fatal error).")
        return True

    def _bad_frame(self, exc: ProtocolError, frames: list[Any]) -> None:
        # One bad frame fails alone; the requests in other frames go on. Only a frame
        # that names requests reaches the consumer: whoever reads outputs must end them.
        fate = fail_undecodable(exc, frames, self._pop, self._metrics)
        request_ids = exc.request_ids  # type: ignore[attr-defined]
        self._resources.bad_frames.warning("engine frame broke the protocol (%s); %s", exc, fate)
        if request_ids:
            self._put(exc)

    def _route_utility(self, outputs: Any) -> None:
        """Complete the call that ``outputs``' utility reply answers, or hand a
        notification or an engine status on."""
        utility = outputs.utility_output
        if utility.call_id == FT_STATUS_CALL_ID:
            # Checked first, as vLLM does: a status never completes a call.
            if self._status is not None:
                self._status(outputs.engine_index, utility)
            return
        future = self._pop(utility.call_id)
        if future is not None:
            resolve_utility_output(future, utility)
        elif utility.call_id == EEP_NOTIFICATION_CALL_ID and self._notify is not None:
            self._notify(utility)

    def fail(self, exc: Exception) -> None:
        """The link broke (not a protocol error): hand ``exc`` to the consumer and mark
        the engine dead, unless the client is closed (then shutdown closed the socket
        under the link, and nothing is wrong)."""
        resources = self._resources
        if not resources.closed:
            logger.exception("corewire %s failed", self._name, exc_info=exc)
            self._put(exc)
            resources.mark_dead(f"The client's {self._name} failed: {exc!r}")
