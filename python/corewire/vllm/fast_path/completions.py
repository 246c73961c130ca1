"""The fast path of vLLM 0.33.0's and 0.34.0's streaming ``/v1/completions`` (see
:mod:`corewire.vllm.fast_path`): one prompt, any number of samples (each written by its
own native state), chunks of text, sample logprobs, (``return_token_ids``) token ids and
(``continuous_usage_stats``) running usage, the prompt echoed in a sample's first chunk
(with the prompt's logprobs before the sample's where the request asks for logprobs);
anything else stays on vLLM's ``completion_stream_generator``."""

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
from vllm.exceptions import GenerationError
from vllm.utils.collection_utils import as_list

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
from corewire.vllm.fast_path.shared import Stream, logger, nothing_to_say, route, stream_refusal

__all__ = ["completion_stream", "frame_template", "install", "refusal"]

ENDPOINT = "completion"


def frame_template(
    request_id: str,
    created: int,
    model: str,
    index: int = 0,
    token_ids: bool = False,
    prompt_tokens: int | None = None,
) -> Template | None:
    """The bytes of an unfinished chunk of the stream's sample ``index`` around its holes
    (the text's JSON literal; the logprobs object, ``null`` without; with ``token_ids``,
    the chunk's token ids; with ``prompt_tokens``, the running usage's counts), as
    :func:`_chunk` renders it (vLLM 0.34.0's model dumped with ``exclude_unset``); None
    when the probe is ambiguous."""
    probe = SimpleNamespace(index=index, text=TEXT_PROBE, finish_reason=None, stop_reason=None)
    usage = None
    if prompt_tokens is not None:
        usage = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=COMPLETION_TOKENS_PROBE,
            total_tokens=TOTAL_TOKENS_PROBE,
        )
    frame = sse(_chunk((request_id, created, model), probe, None, usage=usage)).encode()
    return split_template(frame, token_ids, prompt_tokens)


def refusal(serving: Any, request: Any, num_prompts: int, connection: Any) -> str | None:
    """Why a streaming completion stays on vLLM's generator (None: it takes the fast
    path). The fast path renders a chunk's text, sample logprobs, token ids and running
    usage between the first and the last; requests whose chunks carry more, and servers
    whose settings change the chunks or the connection, keep vLLM's code."""
    return stream_refusal(
        serving,
        request,
        connection,
        first=[(num_prompts != 1, "more than one prompt")],
        options=[
            # A stream's prompt logprobs (the parameter streams only 0, each prompt
            # token's own; an echo with logprobs asks for as many) show only in an
            # echo's chunk, which Python renders.
            (bool(request.logprob_token_ids), "logprob_token_ids"),
            (
                bool(request.return_tokens_as_token_ids or serving.return_tokens_as_token_ids),
                "return_tokens_as_token_ids",
            ),
        ],
    )


def install(serving_class: Any) -> None:
    """Routes ``serving_class.completion_stream_generator`` (vLLM's
    ``OpenAIServingCompletion``) through :func:`completion_stream` for the requests it
    covers."""
    route(serving_class, "completion_stream_generator", ENDPOINT, _take)


def _take(
    serving: Any,
    connection: Any,
    request: Any,
    engine_inputs: Any,
    result_generator: AsyncIterator[tuple[int, Any]],
    request_id: str,
    created_time: int,
    model_name: str,
    num_prompts: int,
    tokenizer: Any,
    request_metadata: Any,
) -> AsyncGenerator[str, None] | str:
    # The fast stream of a request the fast path covers (vLLM's generator's arguments),
    # else why it stays on vLLM's.
    why = refusal(serving, request, num_prompts, connection)
    if why is None and request.echo and tokenizer is None:
        # No prompt text to echo where no tokenizer runs: vLLM's code fails it its way.
        why = "echo without a tokenizer"
    if why is not None:
        return why
    templates = [
        frame_template(request_id, created_time, model_name, index, bool(request.return_token_ids))
        for index in range(request.n or 1)
    ]
    if None in templates:
        return "the chunk's template is ambiguous"
    return completion_stream(
        serving,
        request,
        engine_inputs,
        result_generator,
        request_id,
        created_time,
        model_name,
        tokenizer,
        request_metadata,
        connection,
        templates,  # type: ignore[arg-type]
    )


def _chunk(
    names: tuple[str, int, str],
    output: Any,
    logprobs: Any,
    res: Any = None,
    fingerprint: str | None = None,
    text: str | None = None,
    prompt_token_ids: list[int] | None = None,
    token_ids: list[int] | None = None,
    usage: Any = None,
) -> str:
    """A chunk's JSON as vLLM's server renders one of a request the fast path covers:
    ``names`` (the request's id, creation time and model name), ``res`` (the
    ``RequestOutput``) for a finish, whose KV transfer parameters it carries; ``text``
    (default: the output's); ``prompt_token_ids`` for a sample's first chunk that carries
    them (an echo's, or with ``return_token_ids``); ``token_ids``, the output's, with
    ``return_token_ids``; ``usage``, the running usage, with continuous usage stats."""
    request_id, created, model = names
    chunk = CompletionStreamResponse(
        id=request_id,
        object="text_completion",
        created=created,
        model=model,
        choices=[
            CompletionResponseStreamChoice(
                index=output.index,
                text=output.text if text is None else text,
                logprobs=logprobs,
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
                prompt_token_ids=prompt_token_ids,
                token_ids=token_ids,
                weight_versions=None,
            )
        ],
        kv_transfer_params=res.kv_transfer_params if res is not None else None,
    )
    if fingerprint is not None:
        chunk.system_fingerprint = fingerprint
    if usage is not None:
        chunk.usage = usage
    return chunk.model_dump_json(exclude_unset=True)


async def completion_stream(
    serving: Any,
    request: Any,
    engine_inputs: Any,
    result_generator: AsyncIterator[tuple[int, Any]],
    request_id: str,
    created_time: int,
    model_name: str,
    tokenizer: Any,
    request_metadata: Any,
    connection: Any,
    templates: list[Template],
) -> AsyncGenerator[str, None]:
    """vLLM 0.34.0's ``completion_stream_generator`` for one prompt whose chunks carry
    text, sample logprobs, token ids and running usage only (see :func:`refusal`), with
    each sample's unfinished chunks after its first written natively (see the package
    doc; ``templates``: each sample's frame template, by index, without running usage).
    Same chunks, same usage, same errors."""
    names = (request_id, created_time, model_name)
    stream = Stream(serving, request, connection, ENDPOINT, names, templates[0])
    samples = len(templates)
    # Plain chunks rendered here use the template the native frames use, per sample.
    parts = [(t.head.decode(), t.mid.decode(), t.tail.decode()) for t in templates]
    # With running usage, each sample's template carries the prompt's count: made once
    # the first output has told it.
    usage_templates: dict[int, Template | None] = {}
    # How many candidates a chunk shows per position (-1: all), for the native frames.
    limit = None
    if request.logprobs is not None:
        shown = completion_top_logprobs_limit(request.logprobs)
        limit = -1 if shown is None else shown
    # Where each sample's next chunk's first token starts (logprobs' text_offset): here
    # until the sample's state is attached, then in it (its frames move it too).
    text_offsets = [0] * samples
    external_id = f"{request_id}-0"
    # Output token ids of the chunks rendered here, per sample; attached states count
    # their own.
    rendered = [0] * samples
    # With echo, each sample's first chunk carries the prompt (and its token ids) first;
    # with return_token_ids, the first output's chunk carries the prompt's token ids. As
    # in vLLM's generator, one flag per sample marks both done.
    echoed = [False] * samples
    return_ids = bool(request.return_token_ids)
    # The events after the request's final output, sent with the stream's end.
    end: list[str] = []
    try:
        async for _, res in result_generator:
            stream.seen(res)
            for output in res.outputs:
                i = output.index
                finish_reason = output.finish_reason
                serving._raise_if_error(finish_reason, request_id)
                delta_text, prompt_ids = output.text, None
                delta_ids, delta_logprobs = output.token_ids, output.logprobs
                if request.echo and not echoed[i]:
                    echoed[i] = True
                    prompt = res.prompt
                    if prompt is None:
                        prompt = serving._extract_prompt_text(engine_inputs[0])
                    prompt_ids = res.prompt_token_ids
                    # As vLLM's generator: a failure streamed as an error.
                    assert prompt_ids is not None
                    if return_ids:
                        # The prompt goes back as its token ids, not as text.
                        prompt = ""
                    if request.max_tokens == 0:
                        # A request for no tokens gets the prompt alone, as vLLM answers it.
                        delta_text = prompt
                        delta_ids, delta_logprobs = prompt_ids, res.prompt_logprobs
                    else:
                        delta_text = prompt + output.text
                        if request.logprobs is not None:
                            # The chunk's logprobs run over the prompt, then the sample
                            # (the prompt's first position has none), as vLLM's do.
                            delta_ids = [*prompt_ids, *output.token_ids]
                            delta_logprobs = [
                                *(res.prompt_logprobs or []),
                                *(output.logprobs or []),
                            ]
                else:
                    if return_ids and not echoed[i]:
                        # Marked before the check below, as vLLM's generator does: an
                        # output it skips takes the prompt's ids with it.
                        prompt_ids, echoed[i] = res.prompt_token_ids, True
                    if nothing_to_say(output, rendered[i] + stream.streamed_of(i)):
                        continue
                rendered[i] += len(output.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    text = stream.texts.get(i)
                    if text is not None:
                        text_offsets[i] = text.stream_text_offset
                    if delta_logprobs is None:
                        # vLLM's generator asserts them, and streams the failure.
                        raise AssertionError("Did not output logprobs")
                    logprobs = serving._create_completion_logprobs(
                        token_ids=delta_ids,
                        top_logprobs=delta_logprobs,
                        num_output_top_logprobs=request.logprobs,
                        tokenizer=tokenizer,
                        initial_text_offset=text_offsets[i],
                        return_as_token_id=request.return_tokens_as_token_ids,
                    )
                    if logprobs.tokens:
                        text_offsets[i] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                    if text is not None:
                        text.stream_text_offset = text_offsets[i]
                token_ids = as_list(output.token_ids) if return_ids else None
                usage = None
                if stream.continuous_usage:
                    # The sample's tokens so far, this output's included, as vLLM counts.
                    so_far = rendered[i] + stream.streamed_of(i)
                    usage = stream.usage(so_far)
                if finish_reason is None:
                    stream.chunks += 1
                    plain = logprobs is None and prompt_ids is None and token_ids is None
                    if plain and usage is None:
                        head, mid, tail = parts[i]
                        yield f"{head}{json.dumps(delta_text, ensure_ascii=False)}{mid}null{tail}"
                    else:
                        yield sse(
                            _chunk(
                                names,
                                output,
                                logprobs,
                                text=delta_text,
                                prompt_token_ids=prompt_ids,
                                token_ids=token_ids,
                                usage=usage,
                            )
                        )
                    template: Template | None = templates[i]
                    if usage is not None:
                        if i not in usage_templates:
                            usage_templates[i] = frame_template(
                                request_id,
                                created_time,
                                model_name,
                                i,
                                return_ids,
                                stream.num_prompt_tokens,
                            )
                        template = usage_templates[i]
                    stream.attach_after_chunk(
                        external_id,
                        template is not None,
                        limit,
                        text_offsets[i],
                        index=i,
                        template=template,
                        completion_tokens=usage.completion_tokens if usage is not None else 0,
                    )
                    continue
                # Counted as every chunk is: the samples still streaming attach again
                # only once the connection has all of them (a finish held for the end
                # counts too, harmlessly: nothing attaches after the last output).
                stream.chunks += 1
                finish = sse(
                    _chunk(
                        names,
                        output,
                        logprobs,
                        res,
                        stream.finish_fingerprint,
                        delta_text,
                        prompt_ids,
                        token_ids,
                        usage,
                    )
                )
                if res.finished:
                    # Nothing follows but the usage: it goes with the end.
                    end.append(finish)
                else:
                    yield finish

        completion_tokens = sum(rendered) + stream.streamed
        usage = stream.usage(completion_tokens)
        if serving.enable_prompt_tokens_details and stream.num_cached_tokens is not None:
            usage.prompt_tokens_details = PromptTokenUsageInfo(
                cached_tokens=stream.num_cached_tokens
            )
        if stream.include_usage:
            usage_chunk = stream.usage_chunk(CompletionStreamResponse, usage, completion_tokens)
            end.append(sse(usage_chunk.model_dump_json(exclude_unset=False, exclude_none=True)))
        # What vLLM's middleware reports as the request's usage.
        request_metadata.final_usage_info = usage
    except GenerationError as e:
        end.append(sse(serving._convert_generation_error_to_streaming_response(e)))
    except Exception as e:
        logger.exception("Error in completion stream generator.")
        end.append(sse(serving.create_streaming_error_response(e)))
    finally:
        stream.close()
    yield StreamEnd("".join(end) + DONE)
