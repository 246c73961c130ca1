"""Which of a server's parsers the chat fast path (:mod:`corewire.vllm.fast_path.chat`)
can write the chunks of natively, and of what kind.

vLLM 0.34.0 runs the server's parser (``--tool-call-parser`` with
``--enable-auto-tool-choice``, ``--reasoning-parser``; one class composed by its
``ParserManager``) on every streamed chat output, tools or not. Between the outputs where
its delta changes kind, the parsers of two common kinds make each output's delta its text,
under one field:

- a classic tool-call parser (not ``engine_based_streaming``) with a request whose
  ``tool_choice`` is ``"none"`` (the default without ``tools``): vLLM's
  ``DelegatingParser`` passes the text through as ``content`` and sends nothing for an
  output without text;
- a reasoning parser of start and end marker tokens (``<think>`` ... ``</think>``: vLLM's
  ``BaseThinkingReasoningParser``, splitting deltas its way or DeepSeek-R1's), classic
  too: ``reasoning`` until the end marker, ``content`` after it (with a tool-call parser
  too, as the first kind after it).

So Python renders the outputs that carry a marker token, and any output whose delta is not
of one field; after one that is, the native frames write the next outputs' text under the
same field (:func:`native_frames`), handing any output with a marker back to Python.
Every other parser (engine-based ones hold marker text back and drop tool markup; some
classes stream their own way), and a request that may call tools or hides reasoning, stays
on vLLM's path. ``tests/interop/test_fast_path_parsers.py`` holds every parser vLLM
registers to this, against vLLM's own ``ChatStreamProcessor``.
"""

from __future__ import annotations

from typing import Any

from vllm.parser.abstract_parser import DelegatingParser
from vllm.reasoning.basic_parsers import BaseThinkingReasoningParser
from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser

__all__ = ["markers", "native_frames", "parser_refusal"]

#: The members of vLLM's ``DelegatingParser`` that make a streamed delta.
_STREAM_MEMBERS = (
    "parse_delta",
    "_extract_tool_calls_streaming",
    "finalize_generation",
    "_flush_engine_parsers",
)
#: The members of ``BaseThinkingReasoningParser`` that decide where reasoning ends and
#: count its tokens (a subclass may split a delta as :data:`_SPLITS` allow, and change
#: nothing of these).
_THINKING_MEMBERS = (
    "is_reasoning_end",
    "is_reasoning_end_streaming",
    "extract_content_ids",
    "count_reasoning_tokens",
    "adjust_initial_state_from_prompt",
)
#: How a marker parser may split a streamed delta: the base class's way, or DeepSeek-R1's
#: (reasoning until the end marker even without a start marker). Others treat more tokens
#: apart (ERNIE 4.5's response markers send nothing).
_SPLITS = (
    BaseThinkingReasoningParser.extract_reasoning_streaming,
    DeepSeekR1ReasoningParser.extract_reasoning_streaming,
)
# Per parser class: why its streams stay on vLLM's path whatever the request (None: a
# request can leave it).
_class_refusals: dict[type, str | None] = {}


def parser_refusal(parser_cls: type | None, request: Any) -> str | None:
    """Why the server's parser (vLLM's ``parser_cls``) keeps the streaming chat
    ``request`` on vLLM's path; None when there is none, or when it is of the kinds the
    native frames follow (see the module doc) and the request calls no tool and shows
    its reasoning."""
    if parser_cls is None:
        return None
    why = _class_refusals.get(parser_cls, "")
    if why == "":
        why = _class_refusal(parser_cls)
        _class_refusals[parser_cls] = why
    if why is not None:
        return why
    if parser_cls.tool_parser_cls is not None and request.tool_choice != "none":  # type: ignore[attr-defined]
        return "the request may call tools"
    if parser_cls.reasoning_parser_cls is not None and not request.include_reasoning:  # type: ignore[attr-defined]
        return "include_reasoning is false"
    return None


def native_frames(
    parser: Any, delta: Any, token_ids: Any
) -> tuple[str, bool, tuple[str, ...]] | None:
    """The field the native frames write the next outputs' text under (``"content"`` or
    ``"reasoning"``), whether an output without text gets no frame, and the delta's fields
    that every frame shows as ``null``, after Python rendered ``delta`` for an output with
    new ``token_ids`` under the stream's ``parser`` (None: the server has none); None when
    Python renders the next output too (the delta changed kind there, or is not of one
    field)."""
    if parser is None:
        return "content", False, ()
    marks = markers(parser)
    if marks and any(token in marks for token in token_ids):
        return None
    if delta.tool_calls:
        return None
    fields = [name for name in ("content", "reasoning") if getattr(delta, name) is not None]
    # vLLM's private stream state: where it is missing, Python keeps rendering.
    state = getattr(parser, "_stream_state", None)
    if len(fields) != 1 or not getattr(state, "prompt_reasoning_checked", False):
        return None
    # In the tool-call phase (reasoning over), an output without text says nothing.
    skip_empty = parser.tool_parser is not None and bool(state.reasoning_ended)
    # Fields the parser set to None stay in vLLM's chunk as null (``reasoning`` where the
    # request hides it): the frames show them so; any other value is Python's to render.
    nulls = tuple(sorted(delta.model_fields_set - {fields[0]}))
    if any(getattr(delta, name) is not None for name in nulls):
        return None
    return fields[0], skip_empty, nulls


def markers(parser: Any) -> list[int]:
    """The token ids where the stream's ``parser`` changes the kind of its delta: its
    reasoning parser's start and end markers (none without one)."""
    reasoning = parser.reasoning_parser if parser is not None else None
    if reasoning is None:
        return []
    return [reasoning.start_token_id, reasoning.end_token_id]


def _class_refusal(parser_cls: type) -> str | None:
    # Why every stream of this parser class stays on vLLM's path (None: see
    # parser_refusal).
    tool_cls = getattr(parser_cls, "tool_parser_cls", None)
    reasoning_cls = getattr(parser_cls, "reasoning_parser_cls", None)
    if tool_cls is not None and getattr(tool_cls, "engine_based_streaming", True):
        return "an engine-based tool-call parser"
    if reasoning_cls is not None:
        if getattr(reasoning_cls, "engine_based_streaming", True):
            return "an engine-based reasoning parser"
        thinking = (
            isinstance(reasoning_cls, type)
            and issubclass(reasoning_cls, BaseThinkingReasoningParser)
            and not hasattr(reasoning_cls, "get_streaming_fallback_content")
            and all(
                getattr(reasoning_cls, name) is getattr(BaseThinkingReasoningParser, name)
                for name in _THINKING_MEMBERS
            )
            and reasoning_cls.extract_reasoning_streaming in _SPLITS
        )
        if not thinking:
            return f"the reasoning parser {reasoning_cls.__name__} is not of start and end markers"
    own = (
        (tool_cls is None and reasoning_cls is None)
        or not issubclass(parser_cls, DelegatingParser)
        or any(
            getattr(parser_cls, name) is not getattr(DelegatingParser, name)
            for name in _STREAM_MEMBERS
        )
    )
    if own:
        return f"the parser {parser_cls.__name__} streams its own way"
    return None
