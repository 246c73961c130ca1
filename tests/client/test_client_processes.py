"""ProcessGroup with real processes: engines by index, retiring, the monitor, stopping."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time

from corewire.client._owned import OwnedThreads
from corewire.client.processes import ProcessGroup, stop_processes
from leak_support import no_leaks, wait_pid_gone


def _sleeper(name: str) -> multiprocessing.process.BaseProcess:
    proc = multiprocessing.get_context("spawn").Process(
        target=time.sleep, args=(60,), name=name, daemon=True
    )
    proc.start()
    return proc


def test_engines_are_held_by_index_and_stopped_together() -> None:
    with no_leaks():
        group = ProcessGroup()
        procs = {i: _sleeper(f"engine-{i}") for i in (2, 0, 1)}
        for index, proc in procs.items():
            group.add_engine(index, proc)
        coordinator = _sleeper("coordinator")
        group.set_coordinator(coordinator)
        pids = [procs[i].pid for i in (0, 1, 2)]
        assert group.engine_pids == pids  # index order, the coordinator apart
        assert group.handles() == [procs[0], procs[1], procs[2], coordinator]
        (retired,) = group.retire_engines([1, 7])  # an unknown index is no error
        assert retired is procs[1]
        assert group.engine_pids == [pids[0], pids[2]]
        stop_processes([retired], grace=2.0)
        coordinator_pid = coordinator.pid
        group.terminate_grace = 2.0
        group.stop()
        assert group.handles() == []
        for pid in [*pids, coordinator_pid]:
            assert pid is not None and wait_pid_gone(pid, 5)


def test_the_monitor_reports_a_death_but_not_a_retired_engine() -> None:
    with no_leaks():
        group = ProcessGroup()
        threads = OwnedThreads()
        deaths: queue.Queue[str] = queue.Queue()
        procs = [_sleeper(f"engine-{i}") for i in range(2)]
        for index, proc in enumerate(procs):
            group.add_engine(index, proc)
        try:
            group.start_monitor(threads.start, deaths.put)
            (retired,) = group.retire_engines([0])
            assert retired.pid is not None
            os.kill(retired.pid, signal.SIGKILL)
            retired.join(5)
            assert deaths.empty()
            assert procs[1].pid is not None
            os.kill(procs[1].pid, signal.SIGKILL)
            reason = deaths.get(timeout=10)
            assert "engine-1" in reason and "died unexpectedly" in reason
            assert deaths.empty()
        finally:
            threads.close()
            stop_processes([procs[0]], grace=1.0)
            group.stop()
