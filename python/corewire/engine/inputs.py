"""What the engine core's busy loop takes from its input queue: one named type per kind.

The input thread (and the DP coordinator's subscriptions) put these on
``EngineCoreProc.input_queue``; the busy loop dispatches on their type. START_DP_WAVE
and WAVE_COMPLETE arrive as :class:`~corewire.dp_messages.StartWave` and
:class:`~corewire.dp_messages.WaveComplete` themselves, UTILITY as
:class:`~corewire.protocol.UtilityCall` (the payload's own type).

Wire format: docs/protocol.md §4 (the request types these stand for).
"""

from __future__ import annotations

from typing import NamedTuple

from corewire.dp_messages import StartWave, WaveComplete
from corewire.protocol import EngineCoreRequest, UtilityCall

__all__ = [
    "RESUME",
    "STOP",
    "AbortRequests",
    "AddRefused",
    "AddRequest",
    "IOFailed",
    "InputItem",
]


class AddRequest(NamedTuple):
    """ADD: a decoded request for the engine."""

    request: EngineCoreRequest


class AbortRequests(NamedTuple):
    """ABORT: the requests to abort."""

    request_ids: list[str]


class AddRefused(NamedTuple):
    """An ADD refused undecoded (broken, or its prompt too long) whose id was readable."""

    request_id: str
    client_index: int
    reason: str


class IOFailed(NamedTuple):
    """An I/O thread hit a fatal error; the busy loop must go down."""

    error: BaseException


class _Signal:
    """A control item; compared by identity."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: :meth:`~corewire.engine.core.EngineCoreProc.request_stop`: leave the busy loop.
STOP = _Signal("STOP")
#: From the output thread: the output backlog fell to its low-water mark.
RESUME = _Signal("RESUME")

#: Anything on the input queue.
InputItem = (
    AddRequest
    | AbortRequests
    | UtilityCall
    | StartWave
    | WaveComplete
    | AddRefused
    | IOFailed
    | _Signal
)
