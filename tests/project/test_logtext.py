"""corewire.logtext: caller-supplied values in log lines, bounded in bytes (the engine's
own log under 1 MB ids is checked in test_engine_hardening)."""

from __future__ import annotations

import logging
import sys

from corewire.logtext import (
    MAX_LINE_BYTES,
    MAX_TRACEBACK_BYTES,
    MAX_VALUE_BYTES,
    LineLimit,
    bounded,
    cut,
)


def test_short_values_are_shown_whole() -> None:
    assert cut("abc") == "abc"
    assert repr(bounded("req-1")) == "'req-1'"
    assert str(bounded(ValueError("bad"))) == "bad"
    assert bounded(7) == 7 and bounded(None) is None  # %d and %s still work


def test_long_values_are_cut_in_bytes_with_their_length() -> None:
    text = repr(bounded("x" * 1_000_000))
    assert text.startswith("'xxx") and text.endswith("... (1000000 chars)")
    assert len(text.encode()) <= MAX_VALUE_BYTES + 30
    assert str(bounded(b"\x00" * 5000)).endswith("... (5000 bytes)")
    assert repr(bounded(b"\x00" * 5000)).endswith("... (5000 bytes)")


def test_multibyte_text_is_cut_on_a_character_boundary() -> None:
    text = cut("é" * 1000)  # two bytes each
    head = text.split("...")[0]
    assert head == "é" * (MAX_VALUE_BYTES // 2)
    assert text.endswith("(1000 chars)")


def test_line_limit_bounds_the_message_and_the_traceback() -> None:
    try:
        raise RuntimeError("t" * 100_000)
    except RuntimeError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "id %s", ("i" * 50_000,), exc_info)
    assert LineLimit().filter(record)
    line = logging.Formatter().format(record)
    assert len(line.encode()) <= MAX_LINE_BYTES + MAX_TRACEBACK_BYTES + 100
    assert "(50003 chars)" in line and "RuntimeError" in line
    short = logging.LogRecord("x", logging.INFO, __file__, 1, "ok %d", (3,), None)
    assert LineLimit().filter(short) and short.getMessage() == "ok 3"
