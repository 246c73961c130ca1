"""What each engine loss of a chaos run cost (:mod:`corewire_devtools.chaos`).

A :class:`LossRecord` per ``kill`` or ``stop_hang`` fault: the requests that failed (and
how many of them another engine held), how long until the client saw the loss and until
the rank served again, and the throughput around it, read from a :class:`Timeline` of
completed requests' tokens. :func:`summarize` reduces a run's records to the figures the
report prints and :func:`print_comparison` sets several policies' side by side.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["WINDOW_S", "LossRecord", "Timeline", "describe", "print_comparison", "summarize"]

#: Seconds of the throughput windows before and after a loss.
WINDOW_S = 5.0


class Timeline:
    """Tokens of completed requests by the time they completed (seconds since the
    timeline began), for throughput over any window."""

    def __init__(self) -> None:
        self._origin = time.monotonic()
        self._times: list[float] = []
        # Running totals: the tokens of a window are two lookups.
        self._totals: list[int] = []

    def now(self) -> float:
        """Seconds since the timeline began."""
        return time.monotonic() - self._origin

    def add(self, tokens: int) -> None:
        """A request that generated ``tokens`` completed now."""
        self._times.append(self.now())
        self._totals.append((self._totals[-1] if self._totals else 0) + tokens)

    def tokens_per_s(self, start: float, end: float) -> float | None:
        """Tokens completed per second in ``[start, end)``; None for an empty window."""
        if end <= start:
            return None
        return (self._total_before(end) - self._total_before(start)) / (end - start)

    def _total_before(self, at: float) -> int:
        index = bisect.bisect_left(self._times, at)
        return self._totals[index - 1] if index else 0


@dataclass
class LossRecord:
    """One engine lost on purpose, and what it cost."""

    #: The fault: ``"kill"`` (SIGKILL) or ``"stop_hang"`` (SIGSTOP until found hung).
    kind: str
    rank: int
    #: Seconds since the run began, when the signal was sent.
    fault_at: float
    #: The group died with it (``engine_loss="fail"``, or no other engine served).
    whole_group: bool = False
    #: Seconds from the fault until the client saw it (the rank out of routing, or the
    #: group dead); None when it never did.
    seen_s: float | None = None
    #: Seconds from the fault until the rank served again (its replacement routed to, or
    #: a new group serving); None when it did not (isolated, given up, or the run ended).
    serving_again_s: float | None = None
    #: Requests the loss ended (an error output, or ``EngineDeadError``).
    failed: int = 0
    #: Of those, requests another engine held: 0 unless the whole group died.
    failed_elsewhere: int = 0
    #: Tokens of completed requests per second: the :data:`WINDOW_S` before the fault,
    #: from the fault until the rank served again (:data:`WINDOW_S` when it did not), and
    #: the :data:`WINDOW_S` after it served again.
    tokens_per_s_before: float | None = None
    tokens_per_s_during: float | None = None
    tokens_per_s_after: float | None = None

    def measure(self, timeline: Timeline) -> None:
        """Fill in the throughput windows from ``timeline`` (once the run is over)."""
        start = self.fault_at
        self.tokens_per_s_before = timeline.tokens_per_s(max(0.0, start - WINDOW_S), start)
        if self.serving_again_s is None:
            self.tokens_per_s_during = timeline.tokens_per_s(start, start + WINDOW_S)
            return
        back = start + self.serving_again_s
        # A rank back within a few ms has no window of its own: the first 50 ms stand in.
        self.tokens_per_s_during = timeline.tokens_per_s(start, max(back, start + 0.05))
        self.tokens_per_s_after = timeline.tokens_per_s(back, back + WINDOW_S)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _max(values: Sequence[float | None]) -> float | None:
    return max((v for v in values if v is not None), default=None)


def summarize(records: Sequence[LossRecord]) -> dict[str, Any]:
    """A run's losses in a few figures (medians over the losses, and the worst)."""
    failed = [r.failed for r in records]
    return {
        "losses": len(records),
        "whole_group": sum(r.whole_group for r in records),
        "failed_mean": statistics.fmean(failed) if failed else 0.0,
        "failed_max": max(failed, default=0),
        "failed_elsewhere": sum(r.failed_elsewhere for r in records),
        "seen_median_s": _median([r.seen_s for r in records]),
        "seen_max_s": _max([r.seen_s for r in records]),
        "serving_again": sum(r.serving_again_s is not None for r in records),
        "serving_again_median_s": _median([r.serving_again_s for r in records]),
        "serving_again_max_s": _max([r.serving_again_s for r in records]),
        "tokens_per_s_before": _median([r.tokens_per_s_before for r in records]),
        "tokens_per_s_during": _median([r.tokens_per_s_during for r in records]),
        "tokens_per_s_after": _median([r.tokens_per_s_after for r in records]),
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def describe(summary: dict[str, Any]) -> list[str]:
    """The report's lines for one run's :func:`summarize`."""
    s = summary
    return [
        f"engine losses: {s['losses']} ({s['whole_group']} took the group with them); "
        f"requests failed per loss: mean {s['failed_mean']:.1f}, max {s['failed_max']}; "
        f"failed on another engine: {s['failed_elsewhere']}",
        f"  seen after: median {_seconds(s['seen_median_s'])}, max {_seconds(s['seen_max_s'])}; "
        f"serving again ({s['serving_again']} of {s['losses']}) after: median "
        f"{_seconds(s['serving_again_median_s'])}, max {_seconds(s['serving_again_max_s'])}",
        f"  tokens/s (medians): {_rate(s['tokens_per_s_before'])} in the {WINDOW_S:g} s before, "
        f"{_rate(s['tokens_per_s_during'])} until serving again, "
        f"{_rate(s['tokens_per_s_after'])} in the {WINDOW_S:g} s after",
    ]


def print_comparison(rows: Sequence[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
    """Policies side by side: each row is (policy, its :func:`summarize`, its counts:
    ``sent``, ``completed``, ``failed``, ``groups``)."""
    print("policy    losses  failed/loss  on other engines  serving again (median)  "
          "tokens/s before/during/after  completed/sent  groups")  # fmt: skip
    for policy, s, counts in rows:
        windows = ("tokens_per_s_before", "tokens_per_s_during", "tokens_per_s_after")
        rates = "/".join(_rate(s[k]) for k in windows)
        print(
            f"{policy:<9} {s['losses']:>6}  {s['failed_mean']:>11.1f}  "
            f"{s['failed_elsewhere']:>16}  "
            f"{_seconds(s['serving_again_median_s']):>22}  {rates:>28}  "
            f"{counts['completed']:>6}/{counts['sent']:<7}  {counts['groups']:>6}"
        )
