"""The fast path of vLLM 0.34.0's streaming ``/v1/chat/completions`` (see
:mod:`corewire.vllm.fast_path`): one sample whose chunks carry content alone (no tool-call
or reasoning parser on the server, no logprobs, token ids, echo or continuous usage);
anything else stays on vLLM's ``chat_completion_stream_generator``.

The role chunk, the content chunks Python renders, the finish and the usage chunk are made
as vLLM makes them, its own ``ChatStreamProcessor`` deciding each delta and the finish
reason; the content chunks after the first one written are frames of the native output
state, whose tokens the processor is told of before it counts again.
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
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, UsageInfo
from vllm.entrypoints.serve.utils.api_utils import should_include_usage
from vllm.exceptions import GenerationError
from vllm.utils.collection_utils import as_list

from corewire import metrics
from corewire._native import RequestText
from corewire.vllm import asgi_cycle
from corewire.vllm.fast_path.frames import TEXT_PROBE, Template, split_template
from corewire.vllm.fast_path.shared import (
    attach,
    attachable,
    first_refusal,
    keep_vllms,
    logger,
    request_metrics,
    server_refusal,
)

__all__ = ["chat_stream", "frame_template", "install", "refusal"]

ENDPOINT = "chat completion"
CHUNK_OBJECT = "chat.completion.chunk"


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
    return split_template(f"data: {_dump(probe)}\n\n".encode())


def refusal(serving: Any, request: Any, connection: Any) -> str | None:
    """Why a streaming chat completion stays on vLLM's generator (None: it takes the fast
    path): its chunks would carry more than content, or the server's settings change them
    or the connection."""
    _, continuous = should_include_usage(request.stream_options, serving.enable_force_include_usage)
    server = server_refusal(serving, connection)
    if server is not None:
        return server
    checks = (
        (serving.parser_cls is not None, "a tool-call or reasoning parser"),
        (serving._include_reasoning_tokens_details, "reasoning token counts"),
        ((request.n or 1) != 1, "n > 1"),
        (request.use_beam_search, "beam search"),
        (request.echo, "echo"),
        (bool(request.logprobs), "logprobs"),
        (request.return_token_ids, "return_token_ids"),
        (request.return_prompt_text, "return_prompt_text"),
        (request.return_weight_versions, "return_weight_versions"),
        (continuous, "continuous_usage_stats"),
    )
    return first_refusal(checks)


def install(serving_class: Any) -> None:
    """Routes ``serving_class.chat_completion_stream_generator`` (vLLM's
    ``OpenAIServingChat``) through :func:`chat_stream` for the requests it covers."""
    original = serving_class.chat_completion_stream_generator

    def chat_completion_stream_generator(
        self: Any,
        request: Any,
        result_generator: AsyncIterator[Any],
        request_id: str,
        model_name: str,
        conversation: Any,
        tokenizer: Any,
        request_metadata: Any,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_token_counts: dict[str, int] | None = None,
    ) -> AsyncGenerator[str, None]:
        connection = asgi_cycle.current_cycle()
        why = refusal(self, request, connection)
        if why is not None:
            keep_vllms(ENDPOINT, why)
            return original(
                self,
                request,
                result_generator,
                request_id,
                model_name,
                conversation,
                tokenizer,
                request_metadata,
                chat_template_kwargs=chat_template_kwargs,
                mm_token_counts=mm_token_counts,
            )
        return chat_stream(
            self,
            request,
            result_generator,
            request_id,
            model_name,
            request_metadata,
            connection,
            mm_token_counts,
        )

    chat_completion_stream_generator.corewire_fast_path = True  # type: ignore[attr-defined]
    chat_completion_stream_generator.__doc__ = original.__doc__
    serving_class.chat_completion_stream_generator = chat_completion_stream_generator


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
) -> AsyncGenerator[str, None]:
    """vLLM 0.34.0's ``chat_completion_stream_generator`` for a request :func:`refusal`
    lets through, with the unfinished content chunks after the first written natively.
    Same chunks, same usage, same errors."""
    created = int(time.time())
    template = frame_template(request_id, created, model_name)
    include_usage, _ = should_include_usage(
        request.stream_options, serving.enable_force_include_usage
    )
    step = ChatStreamProcessor(
        request, None, enable_auto_tools=serving.enable_auto_tools, parser_cls=None
    )
    processor = serving.engine_client.output_processor
    num_prompt_tokens = 0
    num_cached_tokens = num_cache_creation_tokens = None
    first_output = True
    finished = False
    last_res = None
    text: RequestText | None = None
    # The native frames' tokens the step processor has been told of.
    counted = 0
    # The chunks yielded so far (before the finish): all on the wire before an attach.
    chunks = 0

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
        try:
            async for res in result_generator:
                last_res = res
                if res.prompt_token_ids is not None:
                    num_prompt_tokens = len(res.prompt_token_ids)
                    if res.encoder_prompt_token_ids is not None:
                        num_prompt_tokens += len(res.encoder_prompt_token_ids)
                if first_output:
                    first_output = False
                    num_cached_tokens = res.num_cached_tokens
                    num_cache_creation_tokens = res.num_cache_creation_tokens
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
                    chunks += 1
                    yield f"data: {_dump(first)}\n\n"
                output = res.outputs[0]
                if finished:
                    continue
                serving._raise_if_error(output.finish_reason, request_id)
                if text is not None:
                    step.num_output_tokens += text.streamed_tokens - counted
                    counted = text.streamed_tokens
                if (
                    not output.text
                    and not output.token_ids
                    and not step.num_output_tokens
                    and output.finish_reason is None
                ):
                    continue  # chunked prefill: vLLM sends no empty chunk
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
                    chunks += 1
                    yield f"data: {_dump(chunk(choice))}\n\n"
                    # Starlette passed that chunk on before asking for the next one: once
                    # it is on the wire, the plain outputs after it can go straight there.
                    if template is not None and (text is None or not text.stream_attached):
                        ready = attachable(processor, request_id, connection, chunks)
                        if (
                            ready is not None
                            and step.num_output_tokens
                            and attach(ENDPOINT, ready, connection, template)
                        ):
                            text = ready
                            counted = text.streamed_tokens
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
                # The finish carries the fingerprint unless a usage chunk comes after it.
                if not include_usage and serving.system_fingerprint is not None:
                    last.system_fingerprint = serving.system_fingerprint
                yield f"data: {_dump(last)}\n\n"
            if text is not None:
                step.num_output_tokens += text.streamed_tokens - counted
                counted = text.streamed_tokens
            completion_tokens = step.num_output_tokens
            if include_usage:
                usage = UsageInfo(
                    prompt_tokens=num_prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=num_prompt_tokens + completion_tokens,
                    completion_tokens_details=None,
                )
                usage.prompt_tokens_details = _make_prompt_tokens_details(
                    serving.enable_prompt_tokens_details,
                    num_cached_tokens,
                    num_cache_creation_tokens,
                    mm_token_counts,
                )
                per_request = request_metrics(serving, last_res, completion_tokens)
                usage_chunk = ChatCompletionStreamResponse(
                    id=request_id,
                    object=CHUNK_OBJECT,
                    created=created,
                    choices=[],
                    model=model_name,
                    usage=usage,
                    system_fingerprint=serving.system_fingerprint,
                    metrics=per_request,
                )
                yield f"data: {_dump(usage_chunk)}\n\n"
            # What vLLM's middleware reports as the request's usage.
            request_metadata.final_usage_info = UsageInfo(
                prompt_tokens=num_prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=num_prompt_tokens + completion_tokens,
                completion_tokens_details=None,
            )
        except GenerationError as e:
            error = serving.create_error_response(
                str(e), err_type="InternalServerError", status_code=e.status_code
            )
            yield f"data: {_dump(error)}\n\n"
        except Exception as e:
            logger.exception("Error in chat completion stream generator.")
            yield f"data: {_dump(serving.create_error_response(e))}\n\n"
    finally:
        # The response is over (or cancelled): nothing more goes to the connection.
        if text is not None:
            text.detach_stream()
        metrics.count_fast_path("fast", text.streamed_tokens if text is not None else 0)
    yield "data: [DONE]\n\n"
