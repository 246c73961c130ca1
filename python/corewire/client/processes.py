"""The processes a client owns: engines by index, at most one coordinator, one monitor.

:class:`ProcessGroup` holds each process as what it is (an engine under its index, the
DP coordinator in its own place), watches them all from one monitor thread, and stops
them with one routine (:func:`stop_processes`). It holds no reference to the client:
the monitor reports a death through the ``on_death`` callback it is started with.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

__all__ = ["TERMINATE_GRACE_S", "ProcessGroup", "ProcessHandle", "stop_processes"]

logger = logging.getLogger("corewire.client")

#: How long processes get to exit after SIGTERM before they are killed.
TERMINATE_GRACE_S = 4.0


class ProcessHandle(Protocol):
    """What the group needs of a process: ``multiprocessing.Process`` has it, and so
    does :class:`corewire.coordinator.DPCoordinator` (a ``subprocess`` underneath)."""

    name: str

    @property
    def sentinel(self) -> int: ...  # readable once the process has exited

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


def _first(item: tuple[int, Any]) -> int:
    return item[0]


class ProcessGroup:
    """The engine processes (engine index -> process) and the coordinator of one client.

    Changes come from the client's thread; the monitor thread reads a snapshot after
    each change (:meth:`_changed` wakes it).
    """

    def __init__(self) -> None:
        #: Engine index -> its process (engines this client started), watched.
        self.engines: dict[int, ProcessHandle] = {}
        #: Engines still joining (a scale-up before their ready message): owned and stopped
        #: with the group, but not watched - a failed start fails the scale-up, whose
        #: ready wait watches them, not the whole client.
        self.joining: dict[int, ProcessHandle] = {}
        #: The DP coordinator this client started (or that vLLM started for it), if any.
        self.coordinator: ProcessHandle | None = None
        #: Seconds processes get between SIGTERM and SIGKILL when the group stops.
        self.terminate_grace = TERMINATE_GRACE_S
        #: ``id()`` of the handles another owner releases (vLLM's launcher: its finalizer
        #: still reads them after corewire stopped them), stopped here but left open.
        self._borrowed: set[int] = set()
        self._monitor: _Monitor | None = None

    def add_engine(
        self, index: int, proc: ProcessHandle, *, joining: bool = False, borrowed: bool = False
    ) -> None:
        """Own engine ``index``'s process: watched from now on, or, ``joining``, from
        :meth:`admit` on. ``borrowed``: stopped with the group but never closed (the
        handle's maker closes it)."""
        if borrowed:
            self._borrowed.add(id(proc))
        if joining:
            self.joining[index] = proc
            return
        self.engines[index] = proc
        self._changed()

    def admit(self, indices: Iterable[int]) -> None:
        """The joining engines at ``indices`` are ready: watch them from now on."""
        for index in indices:
            proc = self.joining.pop(index, None)
            if proc is not None:
                self.engines[index] = proc
        self._changed()

    def set_coordinator(self, proc: ProcessHandle, *, borrowed: bool = False) -> None:
        """Own the coordinator process (watched from now on); ``borrowed`` as in
        :meth:`add_engine`."""
        if borrowed:
            self._borrowed.add(id(proc))
        self.coordinator = proc
        self._changed()

    def retire_engines(self, indices: Iterable[int]) -> list[ProcessHandle]:
        """Stop watching the engines at ``indices`` (their exit is expected now) and
        return their processes, for :func:`stop_processes`."""
        retired = [
            proc
            for i in indices
            if (proc := self.engines.pop(i, None) or self.joining.pop(i, None)) is not None
        ]
        # No longer held here: an id left behind could name a later object.
        self._borrowed.difference_update(id(proc) for proc in retired)
        self._changed()
        return retired

    def handles(self) -> list[ProcessHandle]:
        """Every process of the group: the engines in index order, then the coordinator."""
        # One snapshot of the dict: the monitor thread calls this while the loop thread
        # may retire engines (a lookup by key could miss one popped meanwhile).
        procs = [proc for _, proc in sorted(list(self.engines.items()), key=_first)]
        if self.coordinator is not None:
            procs.append(self.coordinator)
        return procs

    @property
    def engine_pids(self) -> list[int]:
        """Process ids of the engines, in index order."""
        return [p.pid for i in sorted(self.engines) if (p := self.engines[i]).pid is not None]

    def index_of(self, proc: ProcessHandle) -> int | None:
        """The index of watched engine ``proc``, or None (the coordinator, or unknown)."""
        for index, engine in list(self.engines.items()):
            if engine is proc:
                return index
        return None

    def kill_engine(self, index: int) -> bool:
        """SIGKILL engine ``index`` alone (hung); the monitor then reports its death.
        False when this group holds no process for it."""
        proc = self.engines.get(index)
        if proc is None:
            return False
        with contextlib.suppress(Exception):
            proc.kill()
        return True

    def release_lost(self, index: int) -> None:
        """Engine ``index`` died and the client serves on: stop watching it, reap it, and
        release its handle (unless another owner releases it)."""
        procs = [p for p in (self.engines.pop(index, None),) if p is not None]
        borrowed = [p for p in procs if id(p) in self._borrowed]
        self._borrowed.difference_update(id(p) for p in procs)
        self._changed()
        stop_processes(procs, grace=1.0, keep_open=borrowed)

    def kill(self) -> None:
        """SIGKILL every process (a hung group); the monitor then reports the death."""
        for proc in [*self.handles(), *self.joining.values()]:
            with contextlib.suppress(Exception):
                proc.kill()

    def start_monitor(
        self,
        start_thread: Callable[[threading.Thread, Callable[[], None]], bool],
        on_death: Any,
        loss_hook: Callable[[], Any] | None = None,
    ) -> None:
        """Watch the processes from a thread (started by ``start_thread(thread, stop)``);
        the first unexpected exit calls ``on_death(reason)`` on that thread, and the
        thread ends (``on_death`` ignores a death during shutdown). An engine whose loss
        the client takes alone (``loss_hook()``, asked at each death, returns a
        :class:`~corewire.client.engine_loss.LossHook` that claims it) is released and
        reported to that hook instead, and the watch goes on."""
        if self._monitor is None and self.handles():
            self._monitor = _Monitor(self, on_death, loss_hook)
            start_thread(self._monitor.thread, self._monitor.stop)

    def stop(self) -> None:
        """Stop every process (see :func:`stop_processes`) and forget them; the monitor
        must be stopped first (its death reports would be false)."""
        if self._monitor is not None:
            self._monitor.release()
        procs = [*self.handles(), *self.joining.values()]
        self.engines.clear()
        self.joining.clear()
        self.coordinator = None
        borrowed = [proc for proc in procs if id(proc) in self._borrowed]
        self._borrowed.clear()
        stop_processes(procs, self.terminate_grace, keep_open=borrowed)

    def _changed(self) -> None:
        if self._monitor is not None:
            self._monitor.rescan()


def stop_processes(
    processes: Iterable[Any], grace: float = TERMINATE_GRACE_S, keep_open: Iterable[Any] = ()
) -> None:
    """The one stop routine: SIGTERM the live processes, SIGKILL those still alive after
    ``grace`` seconds, reap them all and release their handles, except those in
    ``keep_open`` (another owner still reads them: closing would make it raise)."""
    processes = list(processes)
    leave_open = {id(proc) for proc in keep_open}
    for proc in processes:
        if proc.is_alive():
            with contextlib.suppress(Exception):
                proc.terminate()
    deadline = time.monotonic() + grace
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            logger.warning("process %s did not exit after SIGTERM; killing it", proc.name)
            with contextlib.suppress(Exception):
                proc.kill()
            proc.join(5.0)
    for proc in processes:
        if id(proc) in leave_open:
            continue
        with contextlib.suppress(Exception):
            proc.close()  # frees the sentinel fd now, not at garbage collection


class _Monitor:
    """Thread waiting on the group's sentinels and a wake-up pipe."""

    def __init__(
        self,
        group: ProcessGroup,
        on_death: Callable[[str], None],
        loss_hook: Callable[[], Any] | None = None,
    ) -> None:
        self._group = group
        self._on_death = on_death
        self._loss_hook = loss_hook
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self.thread = threading.Thread(
            target=self._guarded_run, name="corewire-engine-monitor", daemon=True
        )

    def rescan(self) -> None:
        """Make the thread re-read the process list."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"r")

    def stop(self) -> None:
        """Make the thread end."""
        self._stopping = True
        self.rescan()

    def release(self) -> None:
        """Close the pipe once the thread has ended (or is the caller, about to end)."""
        if not self.thread.is_alive() or self.thread is threading.current_thread():
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def _guarded_run(self) -> None:
        # Without this thread no engine death would reach the callers: if it fails, the
        # client is told it can no longer watch its engines.
        try:
            self._run()
        except Exception as exc:
            if not self._stopping:
                logger.exception("the engine monitor failed")
                self._on_death(f"The engine monitor failed: {exc!r}.")

    def _run(self) -> None:
        while not self._stopping:
            procs = {p.sentinel: p for p in self._group.handles()}
            ready = multiprocessing.connection.wait([self._wake_r, *procs])
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
                continue
            died = [procs[s] for s in ready if s in procs]
            if self._stopping or not died:
                continue
            proc = died[0]
            proc.join(1.0)  # the sentinel closes just before the exit status is ready
            reason = (
                f"Engine core process {proc.name} (pid {proc.pid}) died unexpectedly "
                f"(exit code {proc.exitcode})."
            )
            detail = getattr(proc, "death_detail", None)  # a Ray actor's: Ray's notice
            if detail:
                reason = f"{reason[:-1]}: {detail}"
            index = self._group.index_of(proc)
            hook = None if self._loss_hook is None or index is None else self._loss_hook()
            if hook is not None and index is not None and hook.claim(index, reason):
                # The client serves on without it: release it and keep watching the rest.
                self._group.release_lost(index)
                hook.lost(index)
                continue
            self._on_death(reason)
            return
