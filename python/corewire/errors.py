"""Exception types raised by corewire.

Wire format: docs/protocol.md §9 (error rules).
"""

from __future__ import annotations

__all__ = [
    "EngineDeadError",
    "EngineLostError",
    "InputBacklogTimeout",
    "ProtocolError",
    "UtilityError",
]

try:
    # The Rust decoder raises the very same class, so `except ProtocolError` catches both.
    from corewire._native import ProtocolError
except ImportError:  # pragma: no cover - only while the extension is not built

    class ProtocolError(ValueError):  # type: ignore[no-redef]
        """A frame that does not follow the wire protocol."""


class EngineDeadError(RuntimeError):
    """The engine core died or stopped answering; no further output will arrive."""

    def __init__(
        self, message: str = "Engine core died unexpectedly.", *, suppress_context: bool = False
    ) -> None:
        super().__init__(message)
        # When raised from the output task, the original cause is noise for the caller.
        self.__suppress_context__ = suppress_context


class EngineLostError(RuntimeError):
    """One engine of a data-parallel group died while the group serves on (the client's
    ``engine_loss`` is ``"isolate"`` or ``"replace"``): what was waiting on that engine
    alone (a call to it, room in its input backlog) fails with this; the other engines'
    work goes on. ``rank`` is the engine's index in the group.

    Not an :class:`EngineDeadError`: a front-end that treats that as the end of the whole
    client (vLLM's) must not stop serving over one engine. Requests the engine held end
    as outputs instead (``FinishReason.ERROR``; with vLLM 0.33.0's layouts on, with an
    ``error`` whose ``code`` is ``"engine_lost"``, ``retryable``)."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"engine {rank} was lost: {reason}")
        #: The lost engine's index in the group.
        self.rank = rank
        #: What happened to it.
        self.reason = reason


class UtilityError(RuntimeError):
    """A utility call failed inside the engine; ``message`` is the engine's text."""

    def __init__(self, message: str, method: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.method = method


class InputBacklogTimeout(TimeoutError):
    """A blocking ``add_request`` found no room under the engine's input backlog bound
    (``max_input_backlog``) within its timeout; nothing of the request was sent.

    The engine reads its input slower than requests come (stopped, or overloaded): the
    caller may retry, shed the request, or declare the engine dead."""

    def __init__(self, message: str, *, engine_index: int | None = None) -> None:
        super().__init__(message)
        #: The engine whose backlog was full.
        self.engine_index = engine_index
