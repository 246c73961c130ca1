"""The SSE frames of the fast path (:mod:`corewire.vllm.fast_path`): an event's text, and
the frame templates, a probe chunk's frame cut around the holes that the native output
state fills per token.

Imports nothing of vLLM, so that the package (which re-exports the templates) imports under
any vLLM release and the templates are tested without a server.
"""

from __future__ import annotations

__all__ = ["DONE", "TEXT_PROBE", "StreamEnd", "Template", "split_template", "sse"]

#: The event that ends every stream, as vLLM's server writes it.
DONE = "data: [DONE]\n\n"


class StreamEnd(str):
    """The end of a stream: every event after the request's final output (its finish, the
    usage chunk, an error) and ``[DONE]``, as one text. The fast path's generators yield it
    last; a direct route sends it as the response's last body message, so that it costs one
    write and one pass through the middleware instead of one per event and one for the
    end. Any other consumer (Starlette's ``StreamingResponse`` where the app's router
    serves) reads it as the plain text it is: the same bytes either way."""

    __slots__ = ()


#: A text no model name or id contains, marking where a probe chunk's text goes.
TEXT_PROBE = "\x00corewire-text-probe\x00"
_PROBE_LITERAL = b'"\\u0000corewire-text-probe\\u0000"'

#: A chunk's bytes around its text and around its logprobs (see :func:`split_template`).
Template = tuple[bytes, bytes, bytes]


def split_template(frame: bytes) -> Template | None:
    """A probe frame (its text :data:`TEXT_PROBE`, its logprobs ``null``) cut around its
    two holes: the text's JSON literal, and the logprobs value; None when either is
    ambiguous (a model name that contains the probe's bytes)."""
    if frame.count(_PROBE_LITERAL) != 1:
        return None
    head, after = frame.split(_PROBE_LITERAL)
    hole = b'"logprobs":null'
    if after.count(hole) != 1:
        return None
    mid, tail = after.split(hole)
    return head, mid + hole[: -len(b"null")], tail


def sse(data: str) -> str:
    """The SSE event of one chunk's JSON ``data``, as vLLM's server writes it."""
    return f"data: {data}\n\n"
