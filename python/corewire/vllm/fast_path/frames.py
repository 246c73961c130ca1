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

#: A chunk's bytes around its holes (see :func:`split_template`): ``(head, mid, tail)``
#: around its text and its logprobs, or ``(head, mid, ids_mid, tail)`` with its token ids
#: after the logprobs.
Template = tuple[bytes, ...]


def split_template(frame: bytes, token_ids: bool = False) -> Template | None:
    """A probe frame (its text :data:`TEXT_PROBE`, its logprobs ``null``) cut around its
    two holes: the text's JSON literal, and the logprobs value; with ``token_ids``, around
    a third after them, the ``token_ids`` value (``null`` in the probe). None when a hole
    is ambiguous (a model name that contains the probe's bytes)."""
    if frame.count(_PROBE_LITERAL) != 1:
        return None
    head, after = frame.split(_PROBE_LITERAL)
    hole = b'"logprobs":null'
    if after.count(hole) != 1:
        return None
    mid, tail = after.split(hole)
    mid += hole[: -len(b"null")]
    if not token_ids:
        return head, mid, tail
    ids_hole = b'"token_ids":null'
    if tail.count(ids_hole) != 1:
        return None
    ids_mid, tail = tail.split(ids_hole)
    return head, mid, ids_mid + ids_hole[: -len(b"null")], tail


def sse(data: str) -> str:
    """The SSE event of one chunk's JSON ``data``, as vLLM's server writes it."""
    return f"data: {data}\n\n"
