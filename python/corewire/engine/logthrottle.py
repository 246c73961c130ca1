"""Rate-limited warnings for input an engine drops or refuses.

A network-facing engine logs each malformed frame or refused request so an operator can
see it, but a peer that floods bad input must not turn the log into the flood (20,000
frames once made 3.2 MB of log). :class:`ThrottledWarning` logs the first ``burst``
occurrences of each interval, counts the rest, and says how many it left out: in one
summary line once the interval is over (at the next occurrence, or at :meth:`flush`,
which the engine calls while idle and when it stops). Each line is bounded in bytes too:
every argument passes through :func:`corewire.logtext.bounded`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from corewire.logtext import bounded

__all__ = ["ThrottledWarning"]


class ThrottledWarning:
    """Logs at most ``burst`` warnings per ``interval_s`` seconds for one kind of event
    (``what``, e.g. "malformed request"), then a summary of those it left out.

    :attr:`total` counts every occurrence, logged or not; :attr:`suppressed` those not
    logged. Safe to call from several threads.
    """

    def __init__(
        self, logger: logging.Logger, what: str, burst: int = 10, interval_s: float = 10.0
    ) -> None:
        self._logger = logger
        self._what = what
        self._burst = burst
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._in_window = 0
        self._unreported = 0
        #: Every occurrence so far.
        self.total = 0
        #: Occurrences that got no log line of their own.
        self.suppressed = 0

    def warning(self, msg: str, *args: Any) -> None:
        """Count one occurrence; log it unless this interval's burst is used up."""
        with self._lock:
            self.total += 1
            now = time.monotonic()
            if now - self._window_start >= self._interval_s:
                self._summarize(now)
            if self._in_window >= self._burst:
                self._unreported += 1
                self.suppressed += 1
                return
            self._in_window += 1
        # Every argument is the peer's input, or quotes it: bounded (corewire.logtext).
        self._logger.warning(msg, *map(bounded, args))

    def flush(self) -> None:
        """Log the summary of occurrences left out, if the interval is over (or at once
        with :meth:`close`)."""
        with self._lock:
            now = time.monotonic()
            if self._unreported and now - self._window_start >= self._interval_s:
                self._summarize(now)

    def close(self) -> None:
        """Log the summary of whatever was left out, now."""
        with self._lock:
            self._summarize(time.monotonic())

    def _summarize(self, now: float) -> None:
        if self._unreported:
            self._logger.warning(
                "%d more %s warning(s) not logged in the last %.0f s (%d in total)",
                self._unreported,
                self._what,
                now - self._window_start,
                self.total,
            )
        self._unreported = 0
        self._in_window = 0
        self._window_start = now
