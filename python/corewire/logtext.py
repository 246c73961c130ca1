"""Caller-supplied values in log lines, bounded in bytes.

Request ids, utility names and error texts come from peers: one request id of 1 MB,
logged whole, is a 1 MB log line, and a few bad requests fill a disk. Every log line
that carries such a value passes it through :func:`bounded` (or logs through a
:class:`~corewire.engine.logthrottle.ThrottledWarning`, which does so for each
argument): at most :data:`MAX_VALUE_BYTES` of it are shown, followed by its full
length, e.g. ``'aaaa…'... (1048576 chars)``.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_TRACEBACK_BYTES",
    "MAX_VALUE_BYTES",
    "Bounded",
    "LineLimit",
    "bounded",
    "cut",
]

MAX_VALUE_BYTES = 200
"""The most bytes (UTF-8) of one caller-supplied value a log line shows."""


def cut(text: str, limit: int = MAX_VALUE_BYTES, size: str | None = None) -> str:
    """``text`` if its UTF-8 form fits in ``limit`` bytes, else its first ``limit``
    bytes (never half a character) followed by ``... (SIZE)``; ``size`` defaults to
    the text's own length in characters."""
    if len(text) <= limit // 4:
        return text  # fits whatever its characters: none takes more than 4 bytes
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    head = data[:limit].decode("utf-8", "ignore")
    return f"{head}... ({size or f'{len(text)} chars'})"


def _size(value: Any) -> str | None:
    if isinstance(value, str):
        return f"{len(value)} chars"
    if isinstance(value, bytes | bytearray | memoryview):
        return f"{len(value)} bytes"
    return None


class Bounded:
    """A value whose ``str`` and ``repr`` are bounded with :func:`cut` (computed only
    when a log line is written: a suppressed line costs nothing)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        value = self.value
        # A str or bytes value is sliced before it is turned into text: a 1 MB id costs
        # no 1 MB copy to log.
        if isinstance(value, str):
            return cut(value[: MAX_VALUE_BYTES + 1], size=_size(value))
        if isinstance(value, bytes | bytearray):
            return repr(self)  # str() of bytes is their repr
        return cut(str(value))

    def __repr__(self) -> str:
        value = self.value
        if isinstance(value, str | bytes | bytearray) and len(value) > MAX_VALUE_BYTES:
            return cut(repr(value[: MAX_VALUE_BYTES + 1]), size=_size(value))
        return cut(repr(value), size=_size(value))


def bounded(value: Any) -> Any:
    """``value`` for a log argument: numbers and None as they are (always short), all
    else wrapped in :class:`Bounded`."""
    if value is None or isinstance(value, bool | int | float):
        return value
    return Bounded(value)


MAX_LINE_BYTES = 8192
"""The most bytes of one log message a :class:`LineLimit` lets through (a traceback
attached to it gets :data:`MAX_TRACEBACK_BYTES` more)."""

MAX_TRACEBACK_BYTES = 16384
"""The most bytes of a traceback a :class:`LineLimit` lets through."""


class LineLimit(logging.Filter):
    """A handler filter that bounds every record it passes: the message to
    :data:`MAX_LINE_BYTES`, its traceback to :data:`MAX_TRACEBACK_BYTES`.

    The net under :func:`bounded`: a value logged without it (an exception's text that
    quotes a peer's input, in a traceback) still cannot make a line of any size. The
    engine's own logging (``corewire engine``, engines a client starts) installs it.
    """

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > MAX_LINE_BYTES // 4:
            cut_message = cut(message, MAX_LINE_BYTES, size=f"{len(message)} chars")
            if cut_message is not message:
                record.msg, record.args = cut_message, None
        if record.exc_info and not record.exc_text:
            text = self._formatter.formatException(record.exc_info)
            record.exc_text = cut(text, MAX_TRACEBACK_BYTES, size=f"{len(text)} chars")
        return True
