"""``scripts/serve``'s engine restarts (:mod:`corewire.vllm.serve.engine_restarts`) with
real child processes: a process that exits is started again, no sooner than the delay
between two starts, and left down once its budget is spent; a stopped watch starts
nothing. (Under ``vllm serve``, where the restarted engine rejoins:
``tests/interop/test_vllm_serve.py``.)"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from corewire.client.engine_loss import RestartBudget
from corewire.vllm.serve import engine_restarts
from corewire.vllm.serve.engine_restarts import EngineRestarts


def _process(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)


def _wait_for(predicate, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_dead_engine_is_started_again_until_its_budget_is_spent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_restarts, "RESTART_DELAY_S", 0.5)
    started: list[float] = []
    procs = [_process("import time; time.sleep(60)"), _process("raise SystemExit(3)")]

    def restart(index: int) -> subprocess.Popen[bytes]:
        assert index == 1  # the live one is left alone
        started.append(time.monotonic())
        return _process("raise SystemExit(3)")  # dies again at once

    watch = EngineRestarts(procs, restart, RestartBudget(limit=2, window_s=60.0))
    watch.start()
    try:
        _wait_for(lambda: watch.given_up == {1})
        assert watch.restarts[1] == 2 and len(started) == 2
        assert started[1] - started[0] >= 0.5  # no sooner than the delay
        assert procs[0].poll() is None
    finally:
        watch.stop()
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_stopped_watch_starts_nothing() -> None:
    procs = [_process("raise SystemExit(0)")]
    watch = EngineRestarts(procs, lambda index: pytest.fail("started after stop"))
    watch.start()
    watch.stop()
    procs[0].wait()
    time.sleep(3 * engine_restarts.POLL_S)
    assert not watch.restarts
