"""The reason an engine sends with an ERROR finish, in ``stop_reason``.

vLLM 0.25.1's engines leave ``stop_reason`` None on an ERROR finish, and its front-end
passes the field through untouched: ``OutputProcessor`` copies it into the finished
``CompletionOutput.stop_reason`` (seen by ``LLM`` / ``AsyncLLM`` callers), while the
OpenAI server's completion and chat endpoints answer any ``finish_reason == "error"``
with their own "Internal server error" and show nothing of it. corewire engines fill it
in with a short reason, so a caller can tell a refused request from an engine fault, on
these terms:

- a request the engine refused (``add_request`` raised ``ValueError`` or ``TypeError``,
  a length limit, a frame that did not decode) gets that text: its first line, file
  paths replaced by ``<path>``, at most :data:`MAX_REASON_CHARS` characters;
- any other exception is an engine fault whose text may hold internals: the reason is
  only :data:`INTERNAL_ERROR_REASON` (the engine log keeps the details).

Wire format: docs/protocol.md §9.3 (errors an engine reports).
"""

from __future__ import annotations

import re

__all__ = ["INTERNAL_ERROR_REASON", "MAX_REASON_CHARS", "reason_for", "safe_reason"]

#: The whole reason sent for an unexpected failure.
INTERNAL_ERROR_REASON = "internal engine error"
#: Longest reason sent.
MAX_REASON_CHARS = 200

# An absolute, home or dot-relative path: a slash-led run of segments not glued to a
# word before it (so "and/or" or "3/4" stay), with an optional ~, . or .. in front.
_PATH = re.compile(r"(?<![\w.~/])(?:~|\.{1,2})?(?:/[^\s/'\"`,;:()\[\]{}<>]+)+/?")


def safe_reason(text: str) -> str:
    """``text`` cut to one line and :data:`MAX_REASON_CHARS`, with paths redacted."""
    lines = text.strip().splitlines()
    line = lines[0].strip() if lines else ""
    line = _PATH.sub("<path>", line)
    if len(line) > MAX_REASON_CHARS:
        line = line[: MAX_REASON_CHARS - 3] + "..."
    return line or INTERNAL_ERROR_REASON


def reason_for(exc: BaseException) -> str:
    """The reason sent for ``exc`` raised while accepting a request."""
    if isinstance(exc, (ValueError, TypeError)):
        return safe_reason(str(exc))
    return INTERNAL_ERROR_REASON
