"""The fast path of vLLM 0.34.0's streaming ``/v1/chat/completions`` (see
:mod:`corewire.vllm.fast_path`): one sample whose chunks carry content alone (no logprobs,
token ids, echo or continuous usage; on a server with a tool-call parser, a request that
lets the model call no tool, see :func:`parser_refusal`); anything else stays on vLLM's
``chat_completion_stream_generator``.

The role chunk, the content chunks Python renders, the finish and the usage chunk are made
as vLLM makes them, its own ``ChatStreamProcessor`` (with the server's parser, where it has
one) deciding each delta and the finish reason; the content chunks after the first one
written are frames of the native output state, whose tokens the processor is told of
before it counts again.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.chat_completion.serving import _make_prompt_tokens_details
from vllm.entrypoints.openai.chat_completion.stream_processor import ChatStreamProcessor
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.exceptions import GenerationError
from vllm.parser.abstract_parser import DelegatingParser
from vllm.utils.collection_utils import as_list

from corewire.vllm.fast_path.frames import DONE, TEXT_PROBE, Template, split_template, sse
from corewire.vllm.fast_path.shared import Stream, logger, nothing_to_say, route, stream_refusal

__all__ = ["chat_stream", "frame_template", "install", "parser_refusal", "refusal"]

ENDPOINT = "chat completion"
CHUNK_OBJECT = "chat.completion.chunk"

#: The members of vLLM's ``DelegatingParser`` that make a streamed delta: a parser class
#: that keeps them all passes a ``tool_choice: "none"`` request's text through unparsed.
_STREAM_MEMBERS = (
    "parse_delta",
    "_extract_tool_calls_streaming",
    "finalize_generation",
    "_flush_engine_parsers",
)
# Per parser class: why its streams stay on vLLM's path whatever the request (None: a
# request that calls no tool can leave it).
_parser_class_refusals: dict[type, str | None] = {}


def frame_template(request_id: str, created: int, model: str) -> Template | None:
    """The bytes of an unfinished content chunk of the stream around its text and its
    logprobs (``null``), as vLLM 0.34.0's server writes the chunk; None when ambiguous."""
    probe = ChatCompletionStreamResponse(
        id=request_id,
        object=CHUNK_OBJECT,
        created=created,
        choices=[
            ChatCompletionResponseStreamChoice(
                index=0,
                delta=DeltaMessage(content=TEXT_PROBE),
                logprobs=None,
                finish_reason=None,
                token_ids=None,
            )
        ],
        model=model,
        kv_transfer_params=None,
    )
    return split_template(sse(_dump(probe)).encode())


def refusal(serving: Any, request: Any, connection: Any) -> str | None:
    """Why a streaming chat completion stays on vLLM's generator (None: it takes the fast
    path): its chunks would carry more than content, or the server's settings change them
    or the connection."""
    parser_why = parser_refusal(serving.parser_cls, request)
    return stream_refusal(
        serving,
        request,
        connection,
        first=[
            (parser_why, parser_why),
            (serving._include_reasoning_tokens_details, "reasoning token counts"),
        ],
        options=[
            (bool(request.logprobs), "logprobs"),
            (request.return_token_ids, "return_token_ids"),
            (request.return_prompt_text, "return_prompt_text"),
        ],
    )


def parser_refusal(parser_cls: type | None, request: Any) -> str | None:
    """Why the server's parser (vLLM's ``parser_cls``, a tool-call or reasoning parser
    composed by its ``ParserManager``) keeps ``request`` on vLLM's path; None when there
    is none, or when it passes the request's text through as content unparsed.

    vLLM 0.34.0 runs the parser on every streamed output of every request. With a
    tool-call parser alone, of the classic kind (not ``engine_based_streaming``), and a
    request with ``tool_choice: "none"`` (the default of a request without ``tools``),
    its ``DelegatingParser`` makes an output's delta its text as content, and nothing of
    an output with no text: what the native frames write, empty outputs skipped. A
    reasoning parser splits the text, an engine-based tool parser holds markers back and
    drops tool markup, and a parser class of its own streams its own way: those stay on
    vLLM's path, as do requests that may call tools."""
    if parser_cls is None:
        return None
    why = _parser_class_refusals.get(parser_cls, "")
    if why == "":
        why = _parser_class_refusal(parser_cls)
        _parser_class_refusals[parser_cls] = why
    if why is not None:
        return why
    if request.tool_choice != "none":
        return "the request may call tools"
    return None


def _parser_class_refusal(parser_cls: type) -> str | None:
    # Why every stream of this parser class stays on vLLM's path (None: see
    # parser_refusal).
    if getattr(parser_cls, "reasoning_parser_cls", None) is not None:
        return "a reasoning parser"
    tool_parser_cls = getattr(parser_cls, "tool_parser_cls", None)
    if tool_parser_cls is not None and getattr(tool_parser_cls, "engine_based_streaming", True):
        return "an engine-based tool-call parser"
    own = (
        tool_parser_cls is None
        or not issubclass(parser_cls, DelegatingParser)
        or any(
            getattr(parser_cls, name) is not getattr(DelegatingParser, name)
            for name in _STREAM_MEMBERS
        )
    )
    if own:
        return f"the parser {parser_cls.__name__} streams its own way"
    return None


def install(serving_class: Any) -> None:
    """Routes ``serving_class.chat_completion_stream_generator`` (vLLM's
    ``OpenAIServingChat``) through :func:`chat_stream` for the requests it covers."""
    route(serving_class, "chat_completion_stream_generator", ENDPOINT, _take)


def _take(
    serving: Any,
    connection: Any,
    request: Any,
    result_generator: AsyncIterator[Any],
    request_id: str,
    model_name: str,
    conversation: Any,
    tokenizer: Any,
    request_metadata: Any,
    chat_template_kwargs: dict[str, Any] | None = None,
    mm_token_counts: dict[str, int] | None = None,
) -> AsyncGenerator[str, None] | str:
    # The fast stream of a request the fast path covers (vLLM's generator's arguments),
    # else why it stays on vLLM's.
    why = refusal(serving, request, connection)
    if why is not None:
        return why
    return chat_stream(
        serving,
        request,
        result_generator,
        request_id,
        model_name,
        request_metadata,
        connection,
        mm_token_counts,
        tokenizer,
        chat_template_kwargs,
    )


def _stream_parser(
    serving: Any, request: Any, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None
) -> Any:
    # vLLM's stream generator's parser for the request: None without one on the server.
    if serving.parser_cls is None:
        return None
    if tokenizer is None:
        raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    return serving._make_parser(request, tokenizer, chat_template_kwargs)


def _passes_through(parser: Any) -> bool:
    # Whether the parser (one parser_refusal lets through) now makes each delta the
    # output's text: it is in its tool-call phase, which it enters on seeing the prompt
    # (vLLM's private stream state; where it is missing, Python keeps rendering).
    if parser is None:
        return True
    state = getattr(parser, "_stream_state", None)
    return bool(getattr(state, "reasoning_ended", False))


def _dump(chunk: Any) -> str:
    # As vLLM's chat stream serializes a chunk: None fields dropped only from choice-less
    # chunks (the usage chunk).
    if isinstance(chunk, ErrorResponse):
        return chunk.model_dump_json()
    return chunk.model_dump_json(exclude_unset=True, exclude_none=not chunk.choices)


async def chat_stream(
    serving: Any,
    request: Any,
    result_generator: AsyncIterator[Any],
    request_id: str,
    model_name: str,
    request_metadata: Any,
    connection: Any,
    mm_token_counts: dict[str, int] | None,
    tokenizer: Any = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> AsyncGenerator[str, None]:
    """vLLM 0.34.0's ``chat_completion_stream_generator`` for a request :func:`refusal`
    lets through, with the unfinished content chunks after the first written natively.
    Same chunks, same usage, same errors."""
    created = int(time.time())
    try:
        # The server's parser, made per stream as vLLM makes it (its state is the stream's).
        parser = _stream_parser(serving, request, tokenizer, chat_template_kwargs)
    except Exception as e:
        logger.exception("Error in parser creation.")
        yield sse(_dump(serving.create_error_response(e)))
        yield DONE
        return
    template = frame_template(request_id, created, model_name)
    stream = Stream(
        serving, request, connection, ENDPOINT, (request_id, created, model_name), template
    )
    step = ChatStreamProcessor(
        request,
        parser,
        enable_auto_tools=serving.enable_auto_tools,
        parser_cls=serving.parser_cls if parser is not None else None,
    )
    finished = False
    # The native frames' tokens the step processor has been told of.
    counted = 0

    def chunk(choice: Any, res: Any = None) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=request_id,
            object=CHUNK_OBJECT,
            created=created,
            choices=[choice],
            model=model_name,
            kv_transfer_params=res.kv_transfer_params if res is not None else None,
        )

    try:
        async for res in result_generator:
            if stream.seen(res, encoder_prompt=True):
                role = ChatCompletionResponseStreamChoice(
                    index=0,
                    delta=DeltaMessage(role=serving.get_chat_request_role(request), content=""),
                    logprobs=None,
                    finish_reason=None,
                )
                first = ChatCompletionStreamResponse(
                    id=request_id,
                    object=CHUNK_OBJECT,
                    created=created,
                    choices=[role],
                    model=model_name,
                    prompt_token_ids=None,
                    prompt_text=None,
                )
                stream.chunks += 1
                yield sse(_dump(first))
            output = res.outputs[0]
            if finished:
                continue
            serving._raise_if_error(output.finish_reason, request_id)
            # The processor counts the native frames' tokens before this output's.
            step.num_output_tokens += stream.streamed - counted
            counted = stream.streamed
            if nothing_to_say(output, step.num_output_tokens):
                continue
            delta, finish_reason = step.step(
                output.text,
                as_list(output.token_ids),
                output.finish_reason,
                res.prompt_token_ids,
            )
            if delta is None:
                if output.finish_reason is None:
                    continue
                delta = DeltaMessage()
            if output.finish_reason is None:
                choice = ChatCompletionResponseStreamChoice(
                    index=0, delta=delta, logprobs=None, finish_reason=None, token_ids=None
                )
                stream.chunks += 1
                yield sse(_dump(chunk(choice)))
                # With a parser, the native frames take over once it passes text through
                # (after its first look at the prompt), skipping empty outputs as it does.
                wanted = step.num_output_tokens and _passes_through(parser)
                if stream.attach_after_chunk(request_id, wanted, skip_empty=parser is not None):
                    counted = stream.streamed
                continue
            finished = True
            choice = ChatCompletionResponseStreamChoice(
                index=0,
                delta=delta,
                logprobs=None,
                finish_reason=finish_reason,
                stop_reason=output.stop_reason,
                token_ids=None,
                weight_versions=None,
            )
            last = chunk(choice, res)
            if stream.finish_fingerprint is not None:
                last.system_fingerprint = stream.finish_fingerprint
            yield sse(_dump(last))
        step.num_output_tokens += stream.streamed - counted
        completion_tokens = step.num_output_tokens
        if stream.include_usage:
            usage = stream.usage(completion_tokens, completion_tokens_details=None)
            usage.prompt_tokens_details = _make_prompt_tokens_details(
                serving.enable_prompt_tokens_details,
                stream.num_cached_tokens,
                stream.num_cache_creation_tokens,
                mm_token_counts,
            )
            usage_chunk = stream.usage_chunk(
                ChatCompletionStreamResponse, usage, completion_tokens, object=CHUNK_OBJECT
            )
            yield sse(_dump(usage_chunk))
        # What vLLM's middleware reports as the request's usage.
        request_metadata.final_usage_info = stream.usage(
            completion_tokens, completion_tokens_details=None
        )
    except GenerationError as e:
        error = serving.create_error_response(
            str(e), err_type="InternalServerError", status_code=e.status_code
        )
        yield sse(_dump(error))
    except Exception as e:
        logger.exception("Error in chat completion stream generator.")
        yield sse(_dump(serving.create_error_response(e)))
    finally:
        stream.close()
    yield DONE
