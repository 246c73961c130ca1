"""The SSE frames of the fast path (:mod:`corewire.vllm.fast_path`): an event's text, and
the frame templates, a probe chunk's frame cut around the holes that the native output
state fills per token.

Imports nothing of vLLM, so that the package (which re-exports the templates) imports under
any vLLM release and the templates are tested without a server.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "COMPLETION_TOKENS_PROBE",
    "DONE",
    "TEXT_PROBE",
    "TOTAL_TOKENS_PROBE",
    "StreamEnd",
    "Template",
    "split_template",
    "sse",
]

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

#: The completion tokens and the total a probe chunk's usage carries: counts no prompt
#: or output of a template's stream reaches, marking where a frame writes the running ones.
COMPLETION_TOKENS_PROBE = 987_654_321
TOTAL_TOKENS_PROBE = 987_654_322


class Template(NamedTuple):
    """A chunk's bytes around its holes (see :func:`split_template`): ``head``, the text's
    literal, ``mid``, the logprobs, then where the chunks carry them the token ids
    (``ids_mid`` before them) and the running usage (``usage``: the bytes before its total
    and before its completion tokens, and the prompt's tokens), and ``tail``."""

    head: bytes
    mid: bytes
    tail: bytes
    ids_mid: bytes | None = None
    usage: tuple[bytes, bytes, int] | None = None


def split_template(
    frame: bytes, token_ids: bool = False, prompt_tokens: int | None = None
) -> Template | None:
    """A probe frame (its text :data:`TEXT_PROBE`, its logprobs ``null``) cut around its
    two holes: the text's JSON literal, and the logprobs value; with ``token_ids``, around
    the ``token_ids`` value after them (``null`` in the probe); with ``prompt_tokens`` (the
    count its usage shows), around its usage's total and completion tokens after those
    (:data:`TOTAL_TOKENS_PROBE` and :data:`COMPLETION_TOKENS_PROBE` in the probe). None when
    a hole is ambiguous (a model name that contains the probe's bytes)."""
    if frame.count(_PROBE_LITERAL) != 1:
        return None
    head, after = frame.split(_PROBE_LITERAL)
    mid, tail = _cut(after, b'"logprobs":', b"null")
    if tail is None:
        return None
    ids_mid = None
    if token_ids:
        ids_mid, tail = _cut(tail, b'"token_ids":', b"null")
        if tail is None:
            return None
    usage = None
    if prompt_tokens is not None:
        before_total, tail = _cut(tail, b'"total_tokens":', str(TOTAL_TOKENS_PROBE).encode())
        if tail is None:
            return None
        completion = str(COMPLETION_TOKENS_PROBE).encode()
        before_completion, tail = _cut(tail, b'"completion_tokens":', completion)
        if tail is None:
            return None
        usage = (before_total, before_completion, prompt_tokens)
    return Template(head, mid, tail, ids_mid, usage)


def _cut(frame: bytes, key: bytes, probe: bytes) -> tuple[bytes, bytes | None]:
    # The bytes up to and with ``key`` and those after its ``probe`` value, where the two
    # occur together exactly once (else the tail is None).
    hole = key + probe
    if frame.count(hole) != 1:
        return frame, None
    before, after = frame.split(hole)
    return before + key, after


def sse(data: str) -> str:
    """The SSE event of one chunk's JSON ``data``, as vLLM's server writes it."""
    return f"data: {data}\n\n"
