"""Reading the leading fields of a msgpack array without decoding the rest.

When a request frame fails to decode, the engine still answers the sender if it can
read who that is: the request id and client index of an ADD, or the client index, call
id and method of a UTILITY (docs/protocol.md §4; the engine core takes their positions
from the wire types in :mod:`corewire.protocol`, this module only reads the array's
leading items). A full decode cannot be the fallback, because
the frame may have failed precisely for being nested past the decoder's recursion
limit. :func:`read_head` walks the frame iteratively (a count of items still to skip,
no recursion), so its stack use is constant whatever the nesting, and it stops after a
budget of items, so a large broken frame costs the input thread a bounded time (about
15 ms for the default budget) however many items it holds.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["DEFAULT_BUDGET", "array_length", "read_head"]

_UINT = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q"}
_INT = {0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
_FLOAT = {0xCA: ">f", 0xCB: ">d"}
# Type byte -> (bytes of the length that follows, extra bytes before the data).
_SIZED = {
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0),  # bin
    0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),  # ext (plus its type byte)
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),  # str
}  # fmt: skip
_FIXEXT = {0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}  # type byte + data
_LEN = {1: ">B", 2: ">H", 4: ">I"}


class _Truncated(Exception):
    pass


def _header(buf: memoryview, pos: int) -> tuple[int, int, Any]:
    """One item's header at ``pos``: ``(end of header, children, scalar)``.

    ``children`` is how many items follow inside it (an array's elements, a map's keys
    and values); ``end`` is where the next item starts when it has none. ``scalar`` is
    the decoded value of a nil, bool, int, float or str, else ``_NOT_SCALAR``.
    """
    if pos >= len(buf):
        raise _Truncated
    b = buf[pos]
    pos += 1
    if b <= 0x7F or b >= 0xE0:
        return pos, 0, b if b <= 0x7F else b - 0x100
    if 0x80 <= b <= 0x8F:
        return pos, 2 * (b & 0x0F), _NOT_SCALAR
    if 0x90 <= b <= 0x9F:
        return pos, b & 0x0F, _NOT_SCALAR
    if 0xA0 <= b <= 0xBF:
        end = pos + (b & 0x1F)
        return end, 0, _text(buf, pos, end)
    if b == 0xC0:
        return pos, 0, None
    if b in (0xC2, 0xC3):
        return pos, 0, b == 0xC3
    fmt = _UINT.get(b) or _INT.get(b) or _FLOAT.get(b)
    if fmt is not None:
        end = pos + struct.calcsize(fmt)
        if end > len(buf):
            raise _Truncated
        return end, 0, struct.unpack_from(fmt, buf, pos)[0]
    if b in _SIZED:
        width, extra = _SIZED[b]
        if pos + width > len(buf):
            raise _Truncated
        size = struct.unpack_from(_LEN[width], buf, pos)[0]
        start = pos + width + extra
        end = start + size
        return end, 0, _text(buf, start, end) if b >= 0xD9 else _NOT_SCALAR
    if b in _FIXEXT:
        return pos + _FIXEXT[b], 0, _NOT_SCALAR
    if b in (0xDC, 0xDD, 0xDE, 0xDF):
        width = 2 if b in (0xDC, 0xDE) else 4
        if pos + width > len(buf):
            raise _Truncated
        n = struct.unpack_from(_LEN[width], buf, pos)[0]
        return pos + width, n if b <= 0xDD else 2 * n, _NOT_SCALAR
    raise _Truncated  # 0xC1: never valid


def _text(buf: memoryview, start: int, end: int) -> Any:
    if end > len(buf):
        raise _Truncated
    try:
        return str(buf[start:end], "utf-8")
    except UnicodeDecodeError:
        return _NOT_SCALAR


_NOT_SCALAR: Any = object()

#: Items :func:`read_head` reads at most by default.
DEFAULT_BUDGET = 1 << 15


def _top_items(buf: memoryview, budget: int) -> Iterator[tuple[int, Any, int]]:
    """``(first byte, scalar, children)`` of each item of the top-level array in turn;
    each item's children are skipped (iteratively: each header read consumes one
    pending item and adds its own children) when the consumer asks for the next.
    Raises ``_Truncated`` at a truncation or when ``budget`` items were read."""
    pos, count, _ = _header(buf, 0)
    for _ in range(count):
        if pos >= len(buf):
            raise _Truncated
        first = buf[pos]
        pos, pending, value = _header(buf, pos)
        budget -= 1
        yield first, value, pending
        while pending:
            if pending > len(buf) - pos or budget <= 0:
                raise _Truncated  # every item takes at least one byte
            pos, children, _ = _header(buf, pos)
            budget -= 1
            pending += children - 1
        if pos > len(buf):
            raise _Truncated


def _as_array(payload: Any) -> memoryview | None:
    buf = memoryview(payload).cast("B")
    if not buf or not (0x90 <= buf[0] <= 0x9F or buf[0] in (0xDC, 0xDD)):
        return None
    return buf


def read_head(
    payload: Any, fields: Iterable[int], budget: int = DEFAULT_BUDGET
) -> dict[int, Any] | None:
    """The scalar values at positions ``fields`` of the top-level msgpack array in
    ``payload`` (a bytes-like object), as ``{index: value}``; a field that is absent,
    not a scalar (nil, bool, int, float, str), past a truncation, or past the first
    ``budget`` items read is left out. None when the payload is not a msgpack array."""
    buf = _as_array(payload)
    if buf is None:
        return None
    wanted = set(fields)
    last = max(wanted, default=-1)
    found: dict[int, Any] = {}
    try:
        for index, (_, value, children) in enumerate(_top_items(buf, budget)):
            if index > last:
                break
            if index in wanted and value is not _NOT_SCALAR and children == 0:
                found[index] = value
    except _Truncated:
        pass
    return found


def array_length(payload: Any, field: int, budget: int = DEFAULT_BUDGET) -> int | None:
    """How many elements the array at position ``field`` of the top-level msgpack array
    in ``payload`` declares (read from its header alone, not counted); None when that
    field is not an array or cannot be reached."""
    buf = _as_array(payload)
    if buf is None:
        return None
    try:
        for index, (first, _, children) in enumerate(_top_items(buf, budget)):
            if index == field:
                is_array = 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)
                return children if is_array else None
    except _Truncated:
        pass
    return None
