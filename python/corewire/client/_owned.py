"""Two of the pieces a client's :class:`~corewire.client._resources.ClientResources`
holds: its threads (:class:`OwnedThreads`) and what belongs to its owner thread, the
event loop's for an async client (:class:`LoopSide`). Neither refers to the client."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

__all__ = ["LoopSide", "OwnedThreads"]

logger = logging.getLogger("corewire.client")

#: Seconds :meth:`OwnedThreads.close` waits for each thread.
THREAD_JOIN_S = 5.0


class OwnedThreads:
    """Threads a client owns, each with a ``stop()`` that makes it end soon; once
    :meth:`close` began, none starts."""

    def __init__(self) -> None:
        self._items: list[tuple[threading.Thread, Callable[[], None]]] = []
        self._lock = threading.Lock()
        #: Set (under the lock) when :meth:`close` began.
        self.closed = False

    def add(self, thread: threading.Thread, stop: Callable[[], None]) -> None:
        """Own a started ``thread``."""
        with self._lock:
            self._items.append((thread, stop))

    def start(self, thread: threading.Thread, stop: Callable[[], None]) -> bool:
        """Own and start ``thread``; once closed, call ``stop()`` instead and return
        False."""
        with self._lock:
            if not self.closed:
                self._items.append((thread, stop))
                thread.start()
                return True
        with contextlib.suppress(Exception):
            stop()
        return False

    def owns(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` is one of these."""
        return any(t is thread for t, _ in list(self._items))

    def close(self) -> None:
        """Stop every thread and join it (not the caller, when it is one of them)."""
        with self._lock:  # no thread starts after this
            self.closed = True
            items = list(self._items)
        current = threading.current_thread()
        for _, stop in items:
            with contextlib.suppress(Exception):
                stop()
        for thread, _ in items:
            if thread is not current and thread.ident is not None:
                thread.join(timeout=THREAD_JOIN_S)
                if thread.is_alive():
                    logger.warning("thread %s did not stop within 5 s", thread.name)
        with self._lock:
            self._items.clear()


class LoopSide:
    """What is released on the owner thread: the ZeroMQ context and its sockets, the
    tasks, and the callbacks that must run before the sockets close (loop readers)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx: zmq.Context | None = ctx
        #: Sockets closed by :meth:`close` (asyncio sockets on their loop's thread).
        self.sockets: list[Any] = []
        #: Tasks cancelled by :meth:`close`.
        self.tasks: set[asyncio.Task[Any]] = set()
        #: Called by :meth:`close` before the sockets close.
        self.before_close: list[Callable[[], None]] = []
        #: Serialises sends with the closing of the sockets (sync clients).
        self.send_lock = threading.Lock()
        self.closed = False

    def add_task(self, task: asyncio.Task[Any]) -> None:
        """Own ``task``: it is cancelled on close, and forgotten when it ends."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def close(self) -> None:
        """Cancel the tasks, run the callbacks, close the sockets and end the context;
        once (later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        for task in list(self.tasks):
            if not task.done():
                with contextlib.suppress(Exception):
                    task.cancel()
        self.tasks.clear()
        for callback in self.before_close:
            with contextlib.suppress(Exception):
                callback()
        self.before_close.clear()
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
