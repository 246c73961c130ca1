"""What can still be read from an output frame that failed to decode.

A frame that breaks the protocol fails alone (:class:`corewire.ProtocolError`), but the
callers whose answers it carried must not wait forever: when the frame is still plain
msgpack, the utility call id and the request ids are read from their places and those
callers are failed with the frame's error (the call's future) or told which requests it
concerned (``ProtocolError.request_ids``). This runs only on the error path.

Wire format: docs/protocol.md §9.2 (a bad frame fails alone) and §5.2, §5.3, §5.6 (the
field positions read).
"""

from __future__ import annotations

from typing import Any

import msgspec

from corewire.client.futures import complete_future
from corewire.protocol import EngineCoreOutput, EngineCoreOutputs, UtilityOutput, field_position

__all__ = ["fail_undecodable", "readable_ids"]

# Where the ids sit in the payload arrays, read from the wire types' field order.
_OUTPUTS = field_position(EngineCoreOutputs, "outputs")
_UTILITY_OUTPUT = field_position(EngineCoreOutputs, "utility_output")
_REQUEST_ID = field_position(EngineCoreOutput, "request_id")
_CALL_ID = field_position(UtilityOutput, "call_id")


def readable_ids(frames: list[Any]) -> tuple[int | None, tuple[str, ...]]:
    """The utility call id and the request ids of an undecodable message, as far as
    they can be read (``(None, ())`` when the payload is not even generic msgpack)."""
    payload = frames[0]
    buffer = getattr(payload, "buffer", payload)
    try:
        message = msgspec.msgpack.decode(buffer)
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError):
        return None, ()
    if not isinstance(message, list):
        return None, ()
    request_ids: list[str] = []
    outputs = message[_OUTPUTS] if len(message) > _OUTPUTS else None
    if isinstance(outputs, list):
        for output in outputs:
            if isinstance(output, list) and output and isinstance(output[_REQUEST_ID], str):
                request_ids.append(output[_REQUEST_ID])
    call_id = None
    utility = message[_UTILITY_OUTPUT] if len(message) > _UTILITY_OUTPUT else None
    if isinstance(utility, list) and utility and type(utility[_CALL_ID]) is int:
        call_id = utility[_CALL_ID]
    return call_id, tuple(request_ids)


def fail_undecodable(exc: BaseException, frames: list[Any], pop: Any, metrics: Any = None) -> str:
    """Fail the utility caller a bad frame was meant for and note its request ids on
    ``exc`` (``exc.request_ids``: the output consumer must end those requests; none:
    the frame concerns no one else). Returns what became of the frame, for the log.
    ``metrics`` (the client's :class:`corewire.metrics.ClientMetrics`, if on) counts
    the frame."""
    if metrics is not None:
        metrics.protocol_error()
    call_id, request_ids = readable_ids(frames)
    exc.request_ids = request_ids  # type: ignore[attr-defined]
    future = pop(call_id) if call_id is not None else None
    fates = []
    if future is not None:
        complete_future(future, exc=exc)
        fates.append(f"utility call {call_id} failed with it")
    if request_ids:
        fates.append(f"{len(request_ids)} request(s) in it end with an error")
    return "; ".join(fates) or "it named no request or call: dropped"
