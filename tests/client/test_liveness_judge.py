"""The health check's silence rule on the output link's evidence
(:mod:`corewire.client.liveness`), with the clock and the link's passes driven by hand.

The end-to-end checks (bursts, SIGSTOP, a loaded machine) are in
``test_faults_death.py``; these pin the rule's edges, which real processes reach only
by chance: a stall of the client's own process, a pass under way at the deadline.
"""

from __future__ import annotations

import pytest

from corewire.client.liveness import LOOK_GRACE_S, Liveness, SilenceJudge

TIMEOUT = 1.0


def _pass(liveness: Liveness, began: float, heard: dict[int, float], idle: bool) -> None:
    """What the output link writes for one pass that began at ``began``."""
    for index in heard:
        liveness.heard[index] = began
    liveness.looked = began
    liveness.idle = idle
    liveness.passes += 1


def test_an_engine_heard_within_the_window_is_not_due() -> None:
    liveness = Liveness()
    judge = SilenceJudge(liveness, TIMEOUT, started=100.0)
    _pass(liveness, 100.6, {0: 0.0}, idle=True)
    silent, wake_at = judge.judge([0], 101.2)
    assert silent == []
    assert wake_at == pytest.approx(101.6)  # a timeout after its last message


def test_an_idle_link_past_the_deadline_is_silent_after_two_looks() -> None:
    liveness = Liveness()
    _pass(liveness, 99.0, {}, idle=True)  # drained before the check began
    judge = SilenceJudge(liveness, TIMEOUT, started=100.0)
    now = 101.0
    silent, wake_at = judge.judge([0], now)
    assert silent == [] and wake_at == pytest.approx(now + LOOK_GRACE_S)
    silent, wake_at = judge.judge([0], wake_at)
    assert silent == []
    silent, _ = judge.judge([0], wake_at)
    assert silent == [0]


def test_a_stall_of_the_client_counts_as_one_short_look() -> None:
    """After the whole process stalled for seconds, the checker may run before the
    link: the stall must not count as seconds of silence."""
    liveness = Liveness()
    _pass(liveness, 99.0, {}, idle=True)
    judge = SilenceJudge(liveness, TIMEOUT, started=100.0)
    assert judge.judge([0], 101.0)[0] == []
    # Stalled 3 s; the checker runs first, the link not yet.
    assert judge.judge([0], 104.0)[0] == []
    # Then the link reads what the engine sent meanwhile: alive.
    _pass(liveness, 104.01, {0: 0.0}, idle=True)
    silent, wake_at = judge.judge([0], 104.02)
    assert silent == [] and wake_at == pytest.approx(105.01)


def test_a_pass_begun_after_the_deadline_without_the_engine_proves_silence() -> None:
    """With several engines on one link, another engine's messages keep the link
    busy; one pass that began after engine 0's deadline and did not hear it decides."""
    liveness = Liveness()
    judge = SilenceJudge(liveness, TIMEOUT, started=100.0)
    _pass(liveness, 100.5, {0: 0.0, 1: 0.0}, idle=False)
    assert judge.judge([0], 101.4)[0] == []
    _pass(liveness, 101.6, {1: 0.0}, idle=False)  # began after 0's deadline (101.5)
    silent, _ = judge.judge([0], 101.7)
    assert silent == [0]


def test_a_link_busy_in_an_old_pass_gets_a_whole_timeout_then_the_check_fails() -> None:
    liveness = Liveness()
    _pass(liveness, 99.0, {}, idle=True)
    judge = SilenceJudge(liveness, TIMEOUT, started=100.0)
    liveness.idle = False  # a pass began before the deadline and has not ended
    now, verdicts = 101.0, []
    while now < 103.0:
        silent, wake_at = judge.judge([0], now)
        verdicts.append((now, silent))
        if silent:
            break
        now = wake_at
    ended_at, silent = verdicts[-1]
    assert silent == [0]
    assert 101.0 + TIMEOUT - 1e-6 <= ended_at <= 101.0 + TIMEOUT + 2 * LOOK_GRACE_S


def test_restart_begins_the_window_again() -> None:
    liveness = Liveness()
    _pass(liveness, 99.0, {}, idle=True)
    judge = SilenceJudge(liveness, TIMEOUT, started=100.0)
    judge.judge([0], 101.0)
    judge.restart(101.2)  # the output backlog was full
    silent, wake_at = judge.judge([0], 101.25)
    assert silent == [] and wake_at == pytest.approx(102.2)
