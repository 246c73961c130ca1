"""The fast path of vLLM 0.33.0's and 0.34.0's streaming ``/v1/chat/completions`` (see
:mod:`corewire.vllm.fast_path`): any number of samples, each written by its own native
state, whose chunks carry text, logprobs, token ids and running usage (not beside a
reasoning parser's reasoning token count; on a server with a parser, deltas the native
frames can follow:
:mod:`corewire.vllm.fast_path.parsers`); anything else stays on vLLM's
``chat_completion_stream_generator``.

The role chunk, the chunks Python renders, the finish and the usage chunk are made as
vLLM makes them, its own ``ChatStreamProcessor`` (with the server's parser, where it has
one) deciding each delta and the finish reason; after a chunk of one field (``content``,
or a reasoning parser's ``reasoning``), the next chunks are frames of the native output
state under that field, up to an output that changes the field, whose tokens the
processor (and vLLM's reasoning token count) are told of before they count again.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import vllm
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.generate.base.serving import chat_top_logprobs_limit
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.chat_completion.serving import (
    _make_completion_tokens_details,
    _make_prompt_tokens_details,
)
from vllm.entrypoints.openai.chat_completion.stream_processor import ChatStreamProcessor
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, UsageInfo
from vllm.entrypoints.serve.utils.api_utils import should_include_usage
from vllm.exceptions import GenerationError
from vllm.utils.collection_utils import as_list

from corewire import releases
from corewire.vllm.fast_path.frames import (
    COMPLETION_TOKENS_PROBE,
    DONE,
    TEXT_PROBE,
    TOTAL_TOKENS_PROBE,
    StreamEnd,
    Template,
    split_template,
    sse,
)
from corewire.vllm.fast_path.parsers import markers, native_frames, parser_refusal
from corewire.vllm.fast_path.shared import Stream, logger, nothing_to_say, route, stream_refusal

__all__ = ["chat_stream", "frame_template", "install", "refusal"]

ENDPOINT = "chat completion"
#: Whether the installed release's role chunk shows the prompt's token details in its
#: running usage (0.34.0 on; 0.33.0's leaves them out).
_ROLE_USAGE_DETAILS = releases.installed(vllm).chat_role_usage_details
CHUNK_OBJECT = "chat.completion.chunk"


def frame_template(
    request_id: str,
    created: int,
    model: str,
    field: str = "content",
    index: int = 0,
    token_ids: bool = False,
    nulls: tuple[str, ...] = (),
    prompt_tokens: int | None = None,
) -> Template | None:
    """The bytes of an unfinished chunk of the stream's sample ``index`` around its text
    (its delta's ``field``: ``content`` or ``reasoning``; the delta's fields ``nulls``
    set to None beside it), its logprobs (``null``), with ``token_ids`` its token ids, and
    with ``prompt_tokens`` its running usage's counts, as vLLM 0.34.0's server writes the
    chunk; None when ambiguous."""
    probe = ChatCompletionStreamResponse(
        id=request_id,
        object=CHUNK_OBJECT,
        created=created,
        choices=[
            ChatCompletionResponseStreamChoice(
                index=index,
                delta=DeltaMessage(**{field: TEXT_PROBE, **dict.fromkeys(nulls)}),
                logprobs=None,
                finish_reason=None,
                token_ids=None,
            )
        ],
        model=model,
        kv_transfer_params=None,
    )
    if prompt_tokens is not None:
        probe.usage = _running_usage(prompt_tokens, COMPLETION_TOKENS_PROBE, TOTAL_TOKENS_PROBE)
    return split_template(sse(_dump(probe)).encode(), token_ids, prompt_tokens)


def refusal(serving: Any, request: Any, connection: Any) -> str | None:
    """Why a streaming chat completion stays on vLLM's generator (None: it takes the fast
    path): its chunks would carry more than content, or the server's settings change them
    or the connection."""
    parser_why = parser_refusal(serving.parser_cls, request)
    return stream_refusal(
        serving,
        request,
        connection,
        first=[(parser_why, parser_why)],
        options=[
            # vLLM drops a chunk's logprobs behind a parser where reasoning is hidden (its
            # stream processor's hide_metadata). Elsewhere behind a parser, an output the
            # parser says nothing of still gets a chunk for its logprobs: the native
            # state hands such outputs to Python (attach_stream's skip_empty).
            (
                request.logprobs
                and serving.parser_cls is not None
                and not request.include_reasoning,
                "logprobs behind a parser with include_reasoning false",
            ),
            (bool(request.logprob_token_ids), "logprob_token_ids"),
            (
                bool(request.return_tokens_as_token_ids or serving.return_tokens_as_token_ids),
                "return_tokens_as_token_ids",
            ),
            (request.return_prompt_text, "return_prompt_text"),
            # Beside a reasoning parser, the running usage counts the reasoning tokens.
            (
                serving._include_reasoning_tokens_details
                and should_include_usage(
                    request.stream_options, serving.enable_force_include_usage
                )[1],
                "continuous_usage_stats with a reasoning parser",
            ),
        ],
    )


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
    if why is None and request.echo and conversation:
        content = conversation[-1].get("content")
        if content is not None and not isinstance(content, str):
            why = "echo of a message that is not text"
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
        conversation,
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


def _echoed(request: Any, conversation: Any, role: str) -> str:
    # What vLLM's stream echoes after the role chunk: with echo, the last message's
    # content where that message is in the answer's role.
    if not request.echo or not conversation:
        return ""
    last = conversation[-1]
    if "content" not in last or last.get("role") != role:
        return ""
    return last["content"] or ""


def _running_usage(prompt_tokens: int, completion_tokens: int, total_tokens: int) -> UsageInfo:
    # A chunk's running usage as vLLM's chat stream makes it on a server without a
    # reasoning parser (the only kind whose streams carry it on the fast path).
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=total_tokens,
        completion_tokens_details=None,
    )


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
    conversation: Any = None,
) -> AsyncGenerator[str, None]:
    """vLLM 0.34.0's ``chat_completion_stream_generator`` for a request :func:`refusal`
    lets through, with the unfinished content chunks after the first written natively.
    Same chunks, same usage, same errors."""
    created = int(time.time())
    samples = request.n or 1
    try:
        # The server's parser, made per sample as vLLM makes it (its state is the
        # sample's stream's).
        parsers = [
            _stream_parser(serving, request, tokenizer, chat_template_kwargs)
            for _ in range(samples)
        ]
    except Exception as e:
        logger.exception("Error in parser creation.")
        yield sse(_dump(serving.create_error_response(e)))
        yield DONE
        return
    names = (request_id, created, model_name)
    # The frame templates, per field (with the delta's null fields) and sample, made when
    # first needed.
    templates: dict[tuple[str, tuple[str, ...], int], Template | None] = {}
    stream = Stream(serving, request, connection, ENDPOINT, names, None)
    steps = [
        ChatStreamProcessor(
            request,
            parser,
            enable_auto_tools=serving.enable_auto_tools,
            parser_cls=serving.parser_cls if parser is not None else None,
        )
        for parser in parsers
    ]
    release_ids = markers(parsers[0])
    # Whether the chunks carry their token ids: asked for, and not hidden behind a parser
    # that hides the reasoning (vLLM's stream processor's hide_metadata: the ids would
    # show it).
    include_ids = bool(request.return_token_ids) and not steps[0].hide_metadata
    # How many candidates a native chunk shows per position (-1: all), with logprobs.
    logprobs_limit = None
    if request.logprobs:
        shown = chat_top_logprobs_limit(request.top_logprobs)
        logprobs_limit = -1 if shown is None else shown
    finished = [False] * samples
    # Each sample's native frames' tokens its step processor has been told of.
    counted = [0] * samples
    # vLLM's reasoning token count reads every output token id; the native frames' ones
    # stand in as -1 (never a marker: the frames hand any marker to Python).
    count_reasoning = parsers[0] is not None and serving._include_reasoning_tokens_details
    generated: list[list[int]] = [[] for _ in range(samples)]
    # The events after the request's final output, sent with the stream's end.
    end: list[str] = []
    # The role (and echo) chunks of the first output, sent with the next chunk of the
    # same output: one body message, one write.
    opening: list[str] = []

    def opened(event: str) -> str:
        # ``event`` after the opening chunks still held, in one body message.
        text = "".join((*opening, event))
        opening.clear()
        return text

    def ending(event: str) -> None:
        # ``event`` goes with the stream's end, after the opening chunks still held.
        end.extend(opening)
        opening.clear()
        end.append(event)

    def chunk(choice: Any, completion_tokens: int, res: Any = None) -> ChatCompletionStreamResponse:
        # The chunk of an output of ``choice``'s sample, whose tokens so far the running
        # usage (if any) shows.
        made = ChatCompletionStreamResponse(
            id=request_id,
            object=CHUNK_OBJECT,
            created=created,
            choices=[choice],
            model=model_name,
            kv_transfer_params=res.kv_transfer_params if res is not None else None,
        )
        if stream.continuous_usage:
            prompt_tokens = stream.num_prompt_tokens
            made.usage = _running_usage(
                prompt_tokens, completion_tokens, prompt_tokens + completion_tokens
            )
        return made

    def catch_up(i: int) -> None:
        # Tells sample i's processor (and its reasoning count) of its native frames'
        # tokens.
        native = stream.streamed_of(i) - counted[i]
        steps[i].num_output_tokens += native
        if count_reasoning:
            generated[i].extend([-1] * native)
        counted[i] += native

    def usage(completion_tokens: int) -> Any:
        details = None
        if serving._include_reasoning_tokens_details:
            reasoning = sum(
                parser.count_reasoning_tokens(tuple(ids))
                for parser, ids in zip(parsers, generated, strict=True)
                if parser is not None and ids
            )
            details = _make_completion_tokens_details(reasoning)
        return stream.usage(completion_tokens, completion_tokens_details=details)

    try:
        async for res in result_generator:
            if stream.seen(res, encoder_prompt=True):
                role_name = serving.get_chat_request_role(request)
                for i in range(samples):
                    role = ChatCompletionResponseStreamChoice(
                        index=i,
                        delta=DeltaMessage(role=role_name, content=""),
                        logprobs=None,
                        finish_reason=None,
                    )
                    first = ChatCompletionStreamResponse(
                        id=request_id,
                        object=CHUNK_OBJECT,
                        created=created,
                        choices=[role],
                        model=model_name,
                        # Each sample's first chunk carries the prompt's token ids.
                        prompt_token_ids=(
                            res.prompt_token_ids if request.return_token_ids else None
                        ),
                        prompt_text=None,
                    )
                    if stream.continuous_usage:
                        first.usage = _running_usage(
                            stream.num_prompt_tokens, 0, stream.num_prompt_tokens
                        )
                        if _ROLE_USAGE_DETAILS:
                            first.usage.prompt_tokens_details = _make_prompt_tokens_details(
                                serving.enable_prompt_tokens_details,
                                stream.num_cached_tokens,
                                stream.num_cache_creation_tokens,
                                mm_token_counts,
                            )
                    opening.append(sse(_dump(first)))
                echoed = _echoed(request, conversation, role_name)
                for i in range(samples if echoed else 0):
                    # The last message, continued in the answer's role, comes back first.
                    echo = ChatCompletionResponseStreamChoice(
                        index=i,
                        delta=DeltaMessage(content=echoed),
                        logprobs=None,
                        finish_reason=None,
                    )
                    echo_chunk = ChatCompletionStreamResponse(
                        id=request_id,
                        object=CHUNK_OBJECT,
                        created=created,
                        choices=[echo],
                        model=model_name,
                    )
                    if stream.continuous_usage:
                        echo_chunk.usage = _running_usage(
                            stream.num_prompt_tokens, 0, stream.num_prompt_tokens
                        )
                    opening.append(sse(_dump(echo_chunk)))
            for output in res.outputs:
                i = output.index
                step = steps[i]
                if finished[i]:
                    continue
                serving._raise_if_error(output.finish_reason, request_id)
                # The processor counts the native frames' tokens before this output's.
                catch_up(i)
                if nothing_to_say(output, step.num_output_tokens):
                    continue
                logprobs = None
                if request.logprobs:
                    logprobs = serving._create_chat_logprobs(
                        token_ids=output.token_ids,
                        top_logprobs=output.logprobs,
                        tokenizer=tokenizer,
                        num_output_top_logprobs=request.top_logprobs,
                        logprob_token_ids=request.logprob_token_ids,
                        return_as_token_id=request.return_tokens_as_token_ids,
                    )
                token_ids = as_list(output.token_ids)
                delta, finish_reason = step.step(
                    output.text, token_ids, output.finish_reason, res.prompt_token_ids
                )
                if count_reasoning:
                    generated[i].extend(token_ids)
                if delta is None:
                    # An output the parser says nothing of still gets a chunk where the
                    # chunk carries its logprobs or token ids.
                    if output.finish_reason is None and logprobs is None and not include_ids:
                        continue
                    delta = DeltaMessage()
                chunk_ids = token_ids if include_ids else None
                if output.finish_reason is None:
                    choice = ChatCompletionResponseStreamChoice(
                        index=i,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=None,
                        token_ids=chunk_ids,
                    )
                    stream.chunks += 1
                    yield opened(sse(_dump(chunk(choice, step.num_output_tokens))))
                    # The native frames take the sample's next outputs where the parser
                    # (if any) will make each one's delta its text under one field.
                    frames = None
                    if step.num_output_tokens:
                        frames = native_frames(parsers[i], delta, token_ids)
                    if frames is not None:
                        field, skip_empty, nulls = frames
                        key = (field, nulls, i)
                        if key not in templates:
                            templates[key] = frame_template(
                                request_id,
                                created,
                                model_name,
                                field,
                                i,
                                include_ids,
                                nulls,
                                stream.num_prompt_tokens if stream.continuous_usage else None,
                            )
                        stream.attach_after_chunk(
                            request_id,
                            logprobs_limit=logprobs_limit,
                            skip_empty=skip_empty,
                            release_ids=release_ids,
                            chat_logprobs=True,
                            index=i,
                            template=templates[key],
                            completion_tokens=step.num_output_tokens,
                        )
                    continue
                finished[i] = True
                choice = ChatCompletionResponseStreamChoice(
                    index=i,
                    delta=delta,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=output.stop_reason,
                    token_ids=chunk_ids,
                    weight_versions=None,
                )
                last = chunk(choice, step.num_output_tokens, res)
                if stream.finish_fingerprint is not None:
                    last.system_fingerprint = stream.finish_fingerprint
                # Counted as every chunk is: the samples still streaming attach again
                # only once the connection has all of them (a finish held for the end
                # counts too, harmlessly: nothing attaches after the last output).
                stream.chunks += 1
                if res.finished:
                    # Nothing follows but the usage: it goes with the end.
                    ending(sse(_dump(last)))
                else:
                    yield opened(sse(_dump(last)))
            if opening:
                # The first output said nothing more: its opening chunks go now, alone.
                stream.chunks += 1
                yield opened("")
        for i in range(samples):
            catch_up(i)
        completion_tokens = sum(step.num_output_tokens for step in steps)
        if stream.include_usage:
            final = usage(completion_tokens)
            final.prompt_tokens_details = _make_prompt_tokens_details(
                serving.enable_prompt_tokens_details,
                stream.num_cached_tokens,
                stream.num_cache_creation_tokens,
                mm_token_counts,
            )
            usage_chunk = stream.usage_chunk(
                ChatCompletionStreamResponse, final, completion_tokens, object=CHUNK_OBJECT
            )
            ending(sse(_dump(usage_chunk)))
        # What vLLM's middleware reports as the request's usage.
        request_metadata.final_usage_info = usage(completion_tokens)
    except GenerationError as e:
        error = serving.create_error_response(
            str(e), err_type="InternalServerError", status_code=e.status_code
        )
        ending(sse(_dump(error)))
    except Exception as e:
        logger.exception("Error in chat completion stream generator.")
        ending(sse(_dump(serving.create_error_response(e))))
    finally:
        stream.close()
    yield StreamEnd("".join(end) + DONE)
