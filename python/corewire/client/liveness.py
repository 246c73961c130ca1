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

The output link writes the time of the pass that received a message into
:attr:`Liveness.heard` under the message's ``engine_index`` (one dictionary store per
message); the clients' health checks read it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Liveness"]


class Liveness:
    """Last-heard times (``time.monotonic()``) by engine index."""

    __slots__ = ("heard",)

    def __init__(self) -> None:
        #: Engine index -> when the output link last received a message from it.
        self.heard: dict[int, float] = {}

    def deadline(self, indices: Iterable[int], started: float, timeout: float) -> float:
        """When the first of the engines ``indices`` (those yet to answer) counts as hung:
        ``timeout`` after the later of ``started`` and its last message."""
        heard = self.heard
        return min(max(started, heard.get(i, started)) for i in indices) + timeout

    def silent(
        self, indices: Iterable[int], started: float, timeout: float, now: float
    ) -> list[int]:
        """The engines among ``indices`` silent for ``timeout`` seconds as of ``now``
        (nothing heard since ``started``, or since their last message)."""
        heard = self.heard
        return [i for i in indices if now - max(started, heard.get(i, started)) >= timeout]
