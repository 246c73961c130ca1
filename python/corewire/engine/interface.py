"""The :class:`Engine` interface: what a user implements to run inside an engine process."""

from __future__ import annotations

import abc
from typing import Any

from corewire.protocol import EngineCoreOutput, EngineCoreRequest

__all__ = ["INTERFACE_METHODS", "Engine"]


class Engine(abc.ABC):
    """An inference engine driven by :class:`corewire.engine.EngineCoreProc`.

    Every method runs on the engine process's busy-loop thread, one at a time, so an
    implementation needs no locking of its own. The loop calls :meth:`step` whenever
    :meth:`has_unfinished_requests` is true and blocks on input otherwise.

    Utility calls: any other public method (a name without a leading underscore) can be
    called by a front-end with positional arguments (``call_utility("echo", 1)``). Its
    return value must be plain msgpack data (None, bool, int, float, str, bytes, lists,
    dicts). A method may return a :class:`concurrent.futures.Future`; the reply is sent
    when the future completes (from whatever thread completes it). An exception becomes
    the failure text ``Call to <method> method failed: <error>`` and the engine lives on.

    An exception raised by :meth:`step` (or by the other interface methods that the loop
    cannot attribute to one request) is fatal: the process sends ``ENGINE_CORE_DEAD`` and
    exits with a non-zero status.
    """

    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a new request.

        Raise ``ValueError`` for a request that cannot run (bad token ids, bad sampling
        parameters): the process then finishes that request alone with
        ``FinishReason.ERROR`` and the engine keeps serving the others.
        """

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop these requests; ids the engine does not hold are ignored."""

    @abc.abstractmethod
    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduling step and return the outputs it produced (may be empty)."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether :meth:`step` can make progress now.

        Return False while the engine is paused or asleep even if requests are queued,
        so that the busy loop waits for input instead of spinning.
        """

    def scheduler_stats(self) -> dict[str, Any] | None:
        """Counters sent with every batch of outputs (``num_running_reqs``,
        ``num_waiting_reqs``, ...), or None to send none."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional hook, empty on purpose
        """Release resources; called once when the process stops."""


#: Interface methods that are never callable as utility methods: calling them outside
#: the busy loop's own order would lose outputs or tear the engine down under it.
INTERFACE_METHODS = frozenset(
    {
        "add_request",
        "abort_requests",
        "step",
        "has_unfinished_requests",
        "scheduler_stats",
        "shutdown",
    }
)
