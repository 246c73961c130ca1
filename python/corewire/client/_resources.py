"""What a client owns: sockets, tasks, threads, engine processes, the ipc directory.

:class:`ClientResources` holds every resource of one client and no reference back to it,
so ``weakref.finalize(client, resources.close)`` can release everything when the client
is collected, and the engine monitor, the output task and the health watchdog can share
it without keeping the client alive.
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
from corewire.client.processes import TERMINATE_GRACE_S, ProcessGroup
from corewire.errors import EngineDeadError

if TYPE_CHECKING:
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
        self.ctx: zmq.Context | None = ctx
        #: Call id -> pending utility future.
        self.registry = CallRegistry()
        #: Objects behind zero-copy frames still being sent.
        self.tracker = SendTracker()
        #: Sockets closed on the loop thread (asyncio sockets) or by ``close``.
        self.sockets: list[Any] = []
        #: The output task of an async client, once started.
        self.output_task: asyncio.Task[Any] | None = None
        #: Called on the owner thread before the sockets close (loop readers).
        self.before_close: list[Callable[[], None]] = []
        #: Tasks cancelled on close.
        self.tasks: set[asyncio.Task[Any]] = set()
        #: (thread, stop) pairs; ``stop()`` asks the thread to end, ``close`` joins it.
        self.threads: list[tuple[threading.Thread, Callable[[], None]]] = []
        #: Processes this client started: engines by index, the coordinator.
        self.processes = ProcessGroup()
        #: Private directory of the ipc:// endpoints, removed on close.
        self.ipc_dir: str | None = None
        #: The event loop the client is bound to (async clients), set on first use.
        self.loop: asyncio.AbstractEventLoop | None = None
        #: Serialises sends with the closing of the input socket (sync clients).
        self.send_lock = threading.Lock()
        #: Set when the engine died or the client was shut down; calls then raise.
        self.engine_dead = False
        #: What killed the engine, for the error message of later calls.
        self.dead_reason = "Engine core died unexpectedly."
        self.closed = False
        #: Called on the owning thread with the death error: wakes queue waiters.
        self.fail_queue: Callable[[BaseException], None] | None = None
        self._closing = threading.Lock()
        self._threads_lock = threading.Lock()
        self._closed_event = threading.Event()
        self._loop_side_closed = False
        #: This client's metrics (:mod:`corewire.metrics`); None when they are off.
        self.metrics: ClientMetrics | None = None

    # -- death -----------------------------------------------------------------------

    def dead_error(self, reason: str | None = None) -> EngineDeadError:
        """A fresh :attr:`dead_error_class` error with ``reason`` (default: the recorded
        reason of the death)."""
        return self.dead_error_class(reason or self.dead_reason, suppress_context=True)

    def mark_dead(self, reason: str) -> None:
        """Record the engine's death and fail every waiter; may run on any thread.

        Pending utility calls and ``get_output`` waiters get :class:`EngineDeadError`;
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
            _fail_future(future, self.dead_error())
        if self.fail_queue is not None:
            self.fail_queue(self.dead_error())

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

    # -- ownership -------------------------------------------------------------------

    def add_task(self, task: asyncio.Task[Any]) -> None:
        """Own ``task``: it is cancelled on close, and forgotten when it ends."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def add_thread(self, thread: threading.Thread, stop: Callable[[], None]) -> None:
        """Own a started ``thread``; ``stop()`` must make it end soon."""
        with self._threads_lock:
            self.threads.append((thread, stop))

    def start_thread(self, thread: threading.Thread, stop: Callable[[], None]) -> bool:
        """Own and start ``thread``; ``stop()`` must make it end soon.

        Once the client is closed (the engine monitor may close it at any moment), the
        thread is not started, ``stop()`` is called instead, and this returns False.
        """
        with self._threads_lock:
            if not self.closed:
                self.threads.append((thread, stop))
                thread.start()
                return True
        with contextlib.suppress(Exception):
            stop()
        return False

    def start_monitor(self) -> None:
        """Watch the processes; a death marks the client dead and closes it."""
        self.processes.start_monitor(self.start_thread, self._process_died)

    def _process_died(self, reason: str) -> None:
        if self.closed:
            return  # stopped by the shutdown under way, not a death
        logger.error("%s Shutting down the client.", reason)
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
            if threading.current_thread() not in {t for t, _ in self.threads}:
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
        self.engine_dead = True
        if self.metrics is not None:
            self.metrics.close()
        with self._threads_lock:  # no thread starts after this
            self.closed = True
            threads = list(self.threads)
        # Threads first: a sync client's output thread polls the output socket, which
        # must not be closed under it.
        current = threading.current_thread()
        for _, stop in threads:
            with contextlib.suppress(Exception):
                stop()
        for thread, _ in threads:
            if thread is not current and thread.ident is not None:
                thread.join(timeout=5.0)
                if thread.is_alive():
                    logger.warning("thread %s did not stop within 5 s", thread.name)
        with self._threads_lock:
            self.threads.clear()
        # Engines before sockets: an engine told to stop sends what it still has queued
        # and exits at once while this side's sockets are open (ZeroMQ queues on our side
        # without a reader); with them closed first it would wait out its linger.
        self.processes.stop()
        self.run_on_owner(self._close_loop_side)
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None

    def _close_loop_side(self) -> None:
        """Fail waiters, cancel tasks, close sockets, end the context (owner thread)."""
        if self._loop_side_closed:
            return
        self._loop_side_closed = True
        with contextlib.suppress(Exception):
            self._fail_waiters()
        for task in list(self.tasks):
            if not task.done():
                with contextlib.suppress(Exception):
                    task.cancel()
        self.tasks.clear()
        for callback in self.before_close:
            with contextlib.suppress(Exception):
                callback()
        self.before_close.clear()
        self.tracker.clear()
        with self.send_lock:
            for sock in self.sockets:
                with contextlib.suppress(Exception):
                    sock.close(linger=0)
            self.sockets.clear()
        ctx, self.ctx = self.ctx, None
        if ctx is not None:
            # destroy() also closes sockets a subclass made but did not register; term()
            # would hang on them. Threads that used those sockets are stopped by now
            # or never existed.
            with contextlib.suppress(Exception):
                ctx.destroy(linger=0)


def _fail_future(future: Any, exc: BaseException) -> None:
    """Set ``exc`` on a pending asyncio or concurrent future; ignore finished ones."""
    if future.done():
        return
    # Cancelled between the check and here (a caller gave up).
    with contextlib.suppress(asyncio.InvalidStateError, Exception):
        future.set_exception(exc)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
