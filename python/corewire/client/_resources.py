"""What a client owns: sockets, tasks, threads, engine processes, the ipc directory.

:class:`ClientResources` holds every resource of one client in three pieces that each
release their own part (:class:`~corewire.client._owned.LoopSide`,
:class:`~corewire.client._owned.OwnedThreads`,
:class:`~corewire.client.processes.ProcessGroup`), plus the client's lifecycle state
(dead, then closed). It has no reference back to the client, so
``weakref.finalize(client, resources.close)`` can release everything when the client is
collected, and the engine monitor, the output task and the health watchdog can share it
without keeping the client alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from corewire._native import CallRegistry, SendTracker
from corewire.client._owned import LoopSide, OwnedThreads
from corewire.client.futures import complete_future
from corewire.client.input_backlog import InputBacklog
from corewire.client.liveness import Liveness
from corewire.client.processes import TERMINATE_GRACE_S, ProcessGroup
from corewire.engine.logthrottle import ThrottledWarning
from corewire.errors import EngineDeadError
from corewire.logtext import bounded

if TYPE_CHECKING:
    from corewire.client.engine_loss import LossHook
    from corewire.metrics import ClientMetrics

__all__ = ["TERMINATE_GRACE_S", "ClientResources"]

logger = logging.getLogger("corewire.client")


class ClientResources:
    """Every resource of one client, released by :meth:`close` exactly once.

    Thread rules: ``close`` may run on any thread (the caller's, the engine monitor's,
    the garbage collector's). Whatever belongs to an event loop (asyncio sockets, tasks,
    futures) is released on that loop's thread: directly when ``close`` runs there or
    the loop is not running, else by ``call_soon_threadsafe``.
    """

    #: The class of the death errors this client raises; a front-end that catches its
    #: own class (vLLM's serving code) sets a subclass of both here.
    dead_error_class: type[EngineDeadError] = EngineDeadError

    def __init__(self, ctx: zmq.Context) -> None:
        # The pieces, each releasing its own part.
        #: The ZeroMQ context, sockets, tasks and loop readers (released on the owner
        #: thread).
        self.loop_side = LoopSide(ctx)
        #: Threads (output thread, engine monitor, CURVE authenticator).
        self.threads = OwnedThreads()
        #: Processes: engines by index, the coordinator.
        self.processes = ProcessGroup()
        # What the client's hot paths read directly.
        #: Call id -> pending utility future.
        self.registry = CallRegistry()
        #: Objects behind zero-copy frames still being sent.
        self.tracker = SendTracker()
        self.loop_side.before_close.append(self.tracker.clear)
        #: Engine identity -> bytes queued toward it, and the callers waiting for room.
        self.input_backlogs: dict[bytes, InputBacklog] = {}
        #: The output task of an async client, once started.
        self.output_task: asyncio.Task[Any] | None = None
        #: The event loop the client is bound to (async clients), set on first use.
        self.loop: asyncio.AbstractEventLoop | None = None
        #: Private directory of the ipc:// endpoints, removed on close.
        self.ipc_dir: str | None = None
        #: This client's metrics (:mod:`corewire.metrics`); None when they are off.
        self.metrics: ClientMetrics | None = None
        #: Called once the processes are stopped, in order (e.g. a Ray placement group
        #: released after its engines ended).
        self.after_processes: list[Callable[[], None]] = []
        # Lifecycle: dead (calls raise), then closed (everything released).
        #: Set when the engine died or the client was shut down; calls then raise.
        self.engine_dead = False
        #: What killed the engine, for the error message of later calls.
        self.dead_reason = "Engine core died unexpectedly."
        #: Whether the owner shut the client down while its engines were alive (no
        #: death: the calls still raise, but an embedding front-end may stay quiet).
        self.shut_down = False
        #: Called on the owning thread with the death error: wakes queue waiters.
        self.fail_queue: Callable[[BaseException], None] | None = None
        #: Engine frames that broke the protocol (each failed alone: docs/protocol.md
        #: §9.2), logged at most 10 per 10 s with their text bounded.
        self.bad_frames = ThrottledWarning(logger, "bad engine frame")
        #: When each engine was last heard from (written by the output link).
        self.liveness = Liveness()
        #: A client that may lose one engine and serve on sets its hook here (read by the
        #: engine monitor and the health watchdog at each death): see
        #: :mod:`corewire.client.engine_loss`. None: any death is the client's.
        self.engine_loss: LossHook | None = None
        self._closing = threading.Lock()
        self._closed_event = threading.Event()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` began (no thread starts from then on)."""
        return self.threads.closed

    @property
    def ctx(self) -> zmq.Context | None:
        """The client's ZeroMQ context (None once released)."""
        return self.loop_side.ctx

    # -- death -----------------------------------------------------------------------

    def dead_error(self, reason: str | None = None) -> EngineDeadError:
        """A fresh :attr:`dead_error_class` error with ``reason`` (default: the recorded
        reason of the death)."""
        return self.dead_error_class(reason or self.dead_reason, suppress_context=True)

    def mark_dead(self, reason: str) -> None:
        """Record the engine's death and fail every waiter; may run on any thread.

        Pending utility calls, ``get_output`` waiters and callers waiting for room in an
        input backlog get :class:`EngineDeadError`;
        later calls raise it at once. Resources stay open until :meth:`close`.
        """
        if self.engine_dead:
            return
        self.dead_reason = reason
        # Set before looking at the loop: a caller that registers after this line sees
        # the flag (or the closed registry), one that registered before is drained.
        self.engine_dead = True
        if self.metrics is not None:
            self.metrics.engine_died()
        self.run_on_owner(self._fail_waiters)

    def _fail_waiters(self) -> None:
        for future in self.registry.drain(close=True):
            complete_future(future, exc=self.dead_error())
        if self.fail_queue is not None:
            self.fail_queue(self.dead_error())
        for backlog in list(self.input_backlogs.values()):
            backlog.fail(self.dead_error())

    def set_fail_queue(self, fail: Callable[[BaseException], None]) -> None:
        """Make ``fail`` the output queue's death signal (see :attr:`fail_queue`).

        The monitor starts before a subclass has its queue: a death it recorded in
        between found no queue to fail, so it is delivered here.
        """
        self.fail_queue = fail
        if self.engine_dead:  # read after the write above: mark_dead sets it first
            self.run_on_owner(lambda: fail(self.dead_error()))

    def run_on_owner(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the thread that owns the loop-bound resources."""
        loop = self.loop
        if loop is None or loop.is_closed() or not loop.is_running() or _in_loop(loop):
            fn()
            return
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop closed in between
            fn()

    # -- processes ---------------------------------------------------------------

    def start_monitor(self) -> None:
        """Watch the processes; a death marks the client dead and closes it."""
        self.processes.start_monitor(
            self.threads.start, self._process_died, lambda: self.engine_loss
        )

    def _process_died(self, reason: str) -> None:
        if self.closed:
            return  # stopped by the shutdown under way, not a death
        logger.error("%s Shutting down the client.", bounded(reason))
        self.mark_dead(reason)
        self.close()

    # -- closing ---------------------------------------------------------------------

    def __call__(self) -> None:
        """The finalizer: same as :meth:`close`."""
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Release everything; idempotent, safe from any thread and from a finalizer.

        A second caller waits (up to ``timeout``) for the first to finish, so that
        ``shutdown()`` returning always means the processes are gone.
        """
        if not self._closing.acquire(blocking=False):
            # An owned thread (the monitor) must not wait: the first closer joins it.
            if not self.threads.owns(threading.current_thread()):
                self._closed_event.wait(timeout)
            if self._closed_event.is_set():
                # The first closer ran on another thread and left the loop's part to the
                # loop; on the loop's thread, do it now rather than later.
                self.run_on_owner(self._close_loop_side)
            return
        try:
            self._close()
        finally:
            self._closed_event.set()

    def _close(self) -> None:
        if not self.engine_dead:
            self.dead_reason = "The client was shut down."
            self.shut_down = True
        self.engine_dead = True
        if self.metrics is not None:
            self.metrics.close()
        # Threads first: a sync client's output thread polls the output socket, which
        # must not be closed under it.
        self.threads.close()
        # Engines before sockets: an engine told to stop sends what it still has queued
        # and exits at once while this side's sockets are open (ZeroMQ queues on our side
        # without a reader); with them closed first it would wait out its linger.
        self.processes.stop()
        for release in self.after_processes:
            try:
                release()
            except Exception:  # one failed release must not keep the others
                logger.exception("releasing %r failed", release)
        self.after_processes.clear()
        self.run_on_owner(self._close_loop_side)
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None

    def _close_loop_side(self) -> None:
        """Fail waiters, then release the loop side (owner thread)."""
        if self.loop_side.closed:
            return
        with contextlib.suppress(Exception):
            self._fail_waiters()
        self.loop_side.close()


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
