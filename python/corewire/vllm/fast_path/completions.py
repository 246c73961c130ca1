"""The fast path of vLLM 0.34.0's streaming ``/v1/completions`` (see
:mod:`corewire.vllm.fast_path`): one prompt, one sample, chunks of text and sample
logprobs; anything else stays on vLLM's ``completion_stream_generator``."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from types import SimpleNamespace
from typing import Any

from vllm.entrypoints.generate.base.serving import completion_top_logprobs_limit
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo
from vllm.entrypoints.serve.utils.api_utils import should_include_usage
from vllm.exceptions import GenerationError

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

__all__ = ["completion_stream", "frame_template", "install", "refusal"]

ENDPOINT = "completion"


def frame_template(request_id: str, created: int, model: str) -> Template | None:
    """The bytes of an unfinished chunk of the stream around its two holes (the text's
    JSON literal; the logprobs object, ``null`` without), as :func:`_chunk` renders it
    (vLLM 0.34.0's model dumped with ``exclude_unset``); None when the probe is
    ambiguous."""
    probe = SimpleNamespace(text=TEXT_PROBE, finish_reason=None, stop_reason=None)
    return split_template(f"data: {_chunk((request_id, created, model), probe, None)}\n\n".encode())


def refusal(serving: Any, request: Any, num_prompts: int, connection: Any) -> str | None:
    """Why a streaming completion stays on vLLM's generator (None: it takes the fast
    path). The fast path renders the text and sample logprobs of a chunk between the first
    and the last; requests whose chunks carry more, and servers whose settings change the
    chunks or the connection, keep vLLM's code."""
    _, continuous = should_include_usage(request.stream_options, serving.enable_force_include_usage)
    server = server_refusal(serving, connection)
    if server is not None:
        return server
    checks = (
        (num_prompts != 1, "more than one prompt"),
        ((request.n or 1) != 1, "n > 1"),
        (request.use_beam_search, "beam search"),
        (request.echo, "echo"),
        (request.prompt_logprobs is not None, "prompt_logprobs"),
        (bool(request.logprob_token_ids), "logprob_token_ids"),
        (
            bool(request.return_tokens_as_token_ids or serving.return_tokens_as_token_ids),
            "return_tokens_as_token_ids",
        ),
        (request.return_token_ids, "return_token_ids"),
        (request.return_weight_versions, "return_weight_versions"),
        (continuous, "continuous_usage_stats"),
    )
    return first_refusal(checks)


def install(serving_class: Any) -> None:
    """Routes ``serving_class.completion_stream_generator`` (vLLM's
    ``OpenAIServingCompletion``) through :func:`completion_stream` for the requests it
    covers."""
    original = serving_class.completion_stream_generator

    def completion_stream_generator(
        self: Any,
        request: Any,
        engine_inputs: Any,
        result_generator: AsyncIterator[tuple[int, Any]],
        request_id: str,
        created_time: int,
        model_name: str,
        num_prompts: int,
        tokenizer: Any,
        request_metadata: Any,
    ) -> AsyncGenerator[str, None]:
        connection = asgi_cycle.current_cycle()
        why = refusal(self, request, num_prompts, connection)
        template = None
        if why is None:
            template = frame_template(request_id, created_time, model_name)
            if template is None:
                why = "the chunk's template is ambiguous"
        if why is not None:
            keep_vllms(ENDPOINT, why)
            return original(
                self,
                request,
                engine_inputs,
                result_generator,
                request_id,
                created_time,
                model_name,
                num_prompts=num_prompts,
                tokenizer=tokenizer,
                request_metadata=request_metadata,
            )
        assert template is not None
        return completion_stream(
            self,
            request,
            result_generator,
            request_id,
            created_time,
            model_name,
            tokenizer,
            request_metadata,
            connection,
            template,
        )

    completion_stream_generator.corewire_fast_path = True  # type: ignore[attr-defined]
    completion_stream_generator.__doc__ = original.__doc__
    serving_class.completion_stream_generator = completion_stream_generator


def _chunk(
    names: tuple[str, int, str],
    output: Any,
    logprobs: Any,
    res: Any = None,
    fingerprint: str | None = None,
) -> str:
    """A chunk's JSON as vLLM's server renders one of a request the fast path covers:
    ``names`` (the request's id, creation time and model name), and ``res`` (the
    ``RequestOutput``) for a finish, whose KV transfer parameters it carries."""
    request_id, created, model = names
    chunk = CompletionStreamResponse(
        id=request_id,
        object="text_completion",
        created=created,
        model=model,
        choices=[
            CompletionResponseStreamChoice(
                index=0,
                text=output.text,
                logprobs=logprobs,
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
                prompt_token_ids=None,
                token_ids=None,
                weight_versions=None,
            )
        ],
        kv_transfer_params=res.kv_transfer_params if res is not None else None,
    )
    if fingerprint is not None:
        chunk.system_fingerprint = fingerprint
    return chunk.model_dump_json(exclude_unset=True)


async def completion_stream(
    serving: Any,
    request: Any,
    result_generator: AsyncIterator[tuple[int, Any]],
    request_id: str,
    created_time: int,
    model_name: str,
    tokenizer: Any,
    request_metadata: Any,
    connection: Any,
    template: Template,
) -> AsyncGenerator[str, None]:
    """vLLM 0.34.0's ``completion_stream_generator`` for one prompt and one sample whose
    chunks carry text and sample logprobs only (see :func:`refusal`), with the unfinished
    chunks after the first written natively (see the module doc). Same chunks, same usage,
    same errors."""
    include_usage, _ = should_include_usage(
        request.stream_options, serving.enable_force_include_usage
    )
    processor = serving.engine_client.output_processor
    # Plain chunks rendered here use the template the native frames use.
    head, mid, tail = (part.decode() for part in template)
    # How many candidates a chunk shows per position (-1: all), for the native frames.
    limit = None
    if request.logprobs is not None:
        shown = completion_top_logprobs_limit(request.logprobs)
        limit = -1 if shown is None else shown
    # Where the next chunk's first token starts (logprobs' text_offset): here until the
    # request's state is attached, then in it (its frames move it too).
    text_offset = 0
    external_id = f"{request_id}-0"
    names = (request_id, created_time, model_name)
    # The chunks yielded so far (before the finish): all on the wire before an attach.
    chunks = 0
    # Output token ids of the chunks rendered here; the attached state counts its own.
    rendered = 0
    num_prompt_tokens = 0
    num_cached_tokens = None
    first_output = True
    last_res = None
    text: RequestText | None = None
    try:
        async for _, res in result_generator:
            last_res = res
            if first_output:
                num_cached_tokens = res.num_cached_tokens
                first_output = False
            if res.prompt_token_ids is not None:
                num_prompt_tokens = len(res.prompt_token_ids)
            output = res.outputs[0]
            finish_reason = output.finish_reason
            serving._raise_if_error(finish_reason, request_id)
            streamed = text.streamed_tokens if text is not None else 0
            if (
                not output.text
                and not output.token_ids
                and not (rendered + streamed)
                and finish_reason is None
            ):
                continue  # chunked prefill: vLLM sends no empty chunk
            rendered += len(output.token_ids)
            logprobs = None
            if request.logprobs is not None:
                if text is not None:
                    text_offset = text.stream_text_offset
                logprobs = serving._create_completion_logprobs(
                    token_ids=output.token_ids,
                    top_logprobs=output.logprobs,
                    num_output_top_logprobs=request.logprobs,
                    tokenizer=tokenizer,
                    initial_text_offset=text_offset,
                    return_as_token_id=request.return_tokens_as_token_ids,
                )
                if logprobs.tokens:
                    text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                if text is not None:
                    text.stream_text_offset = text_offset
            if finish_reason is None:
                chunks += 1
                if logprobs is None:
                    yield f"{head}{json.dumps(output.text, ensure_ascii=False)}{mid}null{tail}"
                else:
                    yield f"data: {_chunk(names, output, logprobs)}\n\n"
                # Starlette passed that chunk on before asking for the next one: once it
                # is on the wire, the plain outputs after it can go straight there.
                if text is None or not text.stream_attached:
                    ready = attachable(processor, external_id, connection, chunks)
                    if ready is not None and attach(
                        ENDPOINT, ready, connection, template, limit, text_offset
                    ):
                        text = ready
                continue
            # The finish carries the fingerprint unless a usage chunk comes after it.
            fingerprint = None if include_usage else serving.system_fingerprint
            yield f"data: {_chunk(names, output, logprobs, res, fingerprint)}\n\n"

        completion_tokens = rendered + (text.streamed_tokens if text is not None else 0)
        usage = UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=num_prompt_tokens + completion_tokens,
        )
        if serving.enable_prompt_tokens_details and num_cached_tokens is not None:
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=num_cached_tokens)
        if include_usage:
            per_request = request_metrics(serving, last_res, completion_tokens)
            usage_chunk = CompletionStreamResponse(
                id=request_id,
                created=created_time,
                model=model_name,
                choices=[],
                usage=usage,
                system_fingerprint=serving.system_fingerprint,
                metrics=per_request,
            )
            yield f"data: {usage_chunk.model_dump_json(exclude_unset=False, exclude_none=True)}\n\n"
        # What vLLM's middleware reports as the request's usage.
        request_metadata.final_usage_info = usage
    except GenerationError as e:
        yield f"data: {serving._convert_generation_error_to_streaming_response(e)}\n\n"
    except Exception as e:
        logger.exception("Error in completion stream generator.")
        yield f"data: {serving.create_streaming_error_response(e)}\n\n"
    finally:
        # The response is over (or cancelled): nothing more goes to the connection.
        if text is not None:
            text.detach_stream()
        metrics.count_fast_path("fast", text.streamed_tokens if text is not None else 0)
    yield "data: [DONE]\n\n"
