"""Futures resolved after a delay, all on one thread, with bounded delays and backlog.

A utility that answers later (the reference engine's ``delayed_echo``) is callable by any
client that reaches the engine, so its cost must not grow with what a client asks: one
timer thread per call made 3,000 calls cost 3,000 threads, and a delay of ``1e300``
killed its timer thread with an ``OverflowError`` and left the caller waiting forever.
:class:`DelayedResults` keeps every pending result in one heap served by a single
thread (started on demand, gone once nothing is pending), refuses delays that are not
finite numbers in ``[0, max_delay_s]``, and refuses new work past ``max_pending``.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import threading
import time
from typing import Any

__all__ = ["DelayedResults"]


class DelayedResults:
    """Schedules ``future.set_result(value)`` after a delay, on one thread named
    ``name``; :meth:`close` cancels whatever is pending and stops the thread."""

    def __init__(self, name: str, max_pending: int = 1024, max_delay_s: float = 3600.0) -> None:
        self.name = name
        self.max_pending = max_pending
        self.max_delay_s = max_delay_s
        self._cond = threading.Condition()
        # (deadline, sequence number, future, value): the sequence keeps equal
        # deadlines in call order and never lets heapq compare futures.
        self._heap: list[tuple[float, int, concurrent.futures.Future, Any]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def schedule(self, value: Any, delay: Any) -> concurrent.futures.Future:
        """A future that resolves to ``value`` in ``delay`` seconds. Raises ``ValueError``
        for a delay that is not a finite number in ``[0, max_delay_s]``, when
        ``max_pending`` results are already waiting, or after :meth:`close`."""
        if type(delay) not in (int, float) or not 0 <= delay <= self.max_delay_s:
            # NaN fails the comparison too; bool is not a delay.
            raise ValueError(
                f"delay must be a number of seconds in [0, {self.max_delay_s:g}], got {delay!r}"
            )
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise ValueError(f"{self.name} is closed")
            if len(self._heap) >= self.max_pending:
                raise ValueError(f"too many pending delayed results (limit {self.max_pending})")
            deadline = time.monotonic() + float(delay)
            heapq.heappush(self._heap, (deadline, next(self._seq), future, value))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return future

    def pending(self) -> int:
        """How many results are waiting."""
        with self._cond:
            return len(self._heap)

    def close(self) -> None:
        """Cancel every pending result and wait for the thread to end."""
        with self._cond:
            self._closed = True
            entries, self._heap = self._heap, []
            thread = self._thread
            self._cond.notify()
        for _, _, future, _ in entries:
            future.cancel()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            due: list[tuple[concurrent.futures.Future, Any]] = []
            with self._cond:
                heap = self._heap
                while not due:
                    if self._closed or not heap:
                        # Nothing pending: the thread ends, the next schedule() starts
                        # another (no idle thread kept for the process's life).
                        self._thread = None
                        return
                    now = time.monotonic()
                    while heap and heap[0][0] <= now:
                        _, _, future, value = heapq.heappop(heap)
                        due.append((future, value))
                    if not due:
                        self._cond.wait(heap[0][0] - now)
                        heap = self._heap
            for future, value in due:
                if future.set_running_or_notify_cancel():
                    future.set_result(value)
