"""When each engine was last heard from, and the health check's rule built on it.

A health check is a cheap utility call; its reply comes through the same ordered links
as everything else. Behind a burst of requests the call waits until the engine has read
every input sent before it, so after 1M requests at once the reply can be many seconds
late from an engine that works flat out. The rule (docs/protocol.md §7.1): an engine
that has not answered counts as hung only once ``timeout`` seconds have passed, since the
check began, **and** since the last message of any kind it sent (outputs, stats, other
replies). An engine working through a burst keeps sending (corewire's engines step at
least every few tens of milliseconds however much input is queued); a stopped one
(SIGSTOP) or one stuck in a step sends nothing, and is found ``timeout`` seconds after
its last message.

Silence is judged on evidence the output link gathered, not on the clock alone: the
client's own process can stall (a full garbage collection over a large heap takes
seconds on a loaded machine), and after a stall the health check may run before the
link has read what the engine sent meanwhile. So an engine is silent only when a pass
of the link that began after the engine's deadline ended without a word from it, or the
link sat idle (the socket drained) while the checker looked twice, :data:`LOOK_GRACE_S`
apart (see :class:`SilenceJudge`).

The output link writes, per pass: :attr:`Liveness.heard` under each message's
``engine_index`` (one dictionary store per message), and when the pass ends,
:attr:`~Liveness.looked`, :attr:`~Liveness.idle` and :attr:`~Liveness.passes`. The
clients' health checks read them through a :class:`SilenceJudge`.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["LOOK_GRACE_S", "Liveness", "SilenceJudge"]

#: The pause between the health check's looks at a link with no proof yet, and the most
#: one look counts for: an idle link (nothing to read) must stay so for two looks before
#: an engine past its deadline counts as silent, ample for the link's thread to take a
#: turn once something is readable (Python switches threads every 5 ms).
LOOK_GRACE_S = 0.05


class Liveness:
    """What the output link saw: last-heard times by engine index, and its passes."""

    __slots__ = ("heard", "idle", "looked", "passes")

    def __init__(self) -> None:
        #: Engine index -> when the output link last received a message from it
        #: (``time.monotonic()`` at the start of the pass that read it).
        self.heard: dict[int, float] = {}
        #: When the link's last completed pass began (``time.monotonic()``).
        self.looked = 0.0
        #: Whether that pass left the socket empty and no pass is under way (the link
        #: waits for the socket); false from the start of a pass to its end.
        self.idle = True
        #: Completed passes.
        self.passes = 0

    def deadline(self, indices: Iterable[int], started: float, timeout: float) -> float:
        """When the first of the engines ``indices`` (those yet to answer) counts as hung:
        ``timeout`` after the later of ``started`` and its last message."""
        heard = self.heard
        return min(max(started, heard.get(i, started)) for i in indices) + timeout


class SilenceJudge:
    """One health check's verdicts: which engines are silent, or when to ask again.

    ``started`` (monotonic) begins the window; :meth:`restart` begins it again (the
    output backlog was full, so silence proves nothing).

    Past an engine's deadline with no proof yet, the judge watches the link: each call
    adds the time since the previous one, but at most :data:`LOOK_GRACE_S` (the pause it
    asks for), so that a stall of the whole process counts as one short look, not as
    seconds of silence. An idle link must stay so for two such looks; a link busy in a
    pass that began before the deadline gets a whole ``timeout`` (after that it is the
    client that is stuck, and waiting longer helps nobody). A pass that ends meanwhile
    begins the watch again; the next one began after the deadline, and decides.
    """

    __slots__ = ("_last", "_liveness", "_passes", "_timeout", "_watched", "started")

    def __init__(self, liveness: Liveness, timeout: float, started: float) -> None:
        self._liveness = liveness
        self._timeout = timeout
        #: When the window began.
        self.started = started
        self._last: float | None = None  # the previous call while an engine was due
        self._passes = -1  # the link's pass count the watch began at
        self._watched = 0.0

    def restart(self, now: float) -> None:
        """Begin the window again at ``now``."""
        self.started = now
        self._last = None

    def judge(self, indices: list[int], now: float) -> tuple[list[int], float]:
        """``(silent, wake_at)``: the engines among ``indices`` (those yet to answer)
        proven silent as of ``now``, and, when none is, when to judge again."""
        liveness, timeout, started = self._liveness, self._timeout, self.started
        heard = liveness.heard
        refs = {i: max(started, heard.get(i, started)) for i in indices}
        due = [i for i, ref in refs.items() if now - ref >= timeout]
        if not due:
            self._last = None
            return [], min(refs.values()) + timeout
        # A pass that began after the deadline ended without a word from them.
        looked = liveness.looked
        proven = [i for i in due if looked >= refs[i] + timeout]
        if proven:
            return proven, now
        last, self._last = self._last, now
        if last is None or self._passes != liveness.passes:
            self._passes = liveness.passes
            self._watched = 0.0
        else:
            self._watched += min(now - last, LOOK_GRACE_S)
        needed = 2 * LOOK_GRACE_S if liveness.idle else timeout
        if self._watched >= needed - 1e-9:
            return due, now
        return [], now + LOOK_GRACE_S
