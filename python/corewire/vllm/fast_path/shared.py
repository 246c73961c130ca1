"""What both endpoints of the fast path (:mod:`corewire.vllm.fast_path`) share: routing a
serving class's streaming generator (:func:`route`), the checks a request passes
(:func:`stream_refusal`, :func:`server_refusal`), the log line of a request that stays on
vLLM's path (:func:`keep_vllms`), and one stream's Python side (:class:`Stream`: its
prompt's counts, attaching its native state to the connection, its usage chunk, its end).

Needs vLLM 0.33.0's or 0.34.0's serving code, as the endpoints do; the package imports it
only when it installs them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

from vllm.entrypoints.generate.base.protocol import PerRequestMetrics
from vllm.entrypoints.generate.base.serving import (
    build_per_request_timing_metrics,
    build_spec_decoding_metrics,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.entrypoints.serve.utils.api_utils import should_include_usage

from corewire import metrics
from corewire._native import RequestText
from corewire.vllm.fast_path import asgi_cycle
from corewire.vllm.fast_path.frames import Template

__all__ = [
    "Check",
    "Stream",
    "attach",
    "attachable",
    "keep_vllms",
    "logger",
    "nothing_to_say",
    "request_metrics",
    "route",
    "server_refusal",
    "stream_refusal",
]

#: One check of a request: ``(refused, reason)``, the reason said when it refuses.
Check = tuple[object, str]

#: Where the fast path speaks: under vLLM's logger, so vLLM's log settings hold for it.
logger = logging.getLogger("vllm.corewire")

# The (endpoint, reason) pairs said in the log already: each is said once per process.
_told: set[tuple[str, str]] = set()
# The values that turn an environment switch on.
_ON = frozenset({"1", "true", "yes", "on"})


def keep_vllms(endpoint: str, reason: str) -> None:
    """Counts a streaming request of ``endpoint`` that stays on vLLM's path, and says why
    in the log once per endpoint and reason (a server at high QPS would say it per
    request)."""
    metrics.count_fast_path("vllm")
    if (endpoint, reason) in _told:
        return
    _told.add((endpoint, reason))
    logger.info("corewire: a streaming %s stays on vLLM's path: %s", endpoint, reason)


def server_refusal(serving: Any, connection: asgi_cycle.Connection | None) -> str | None:
    """Why no streaming request of this server and connection can take the fast path
    (None: they can, as far as the server goes): the connection is not uvicorn's
    ``httptools`` protocol, keep-alive comments are on, middleware of the user's or vLLM's
    response logging could hold the body back (writing beside it would also be safe, see
    ``Connection.caught_up``, but never happen), the engine client has no native output
    processing, or outputs are logged per delta."""
    if connection is None:
        return "the connection is not uvicorn's httptools protocol"
    app = connection.cycle.scope.get("app")
    args = getattr(getattr(app, "state", None), "args", None)
    if getattr(args, "sse_keep_alive_interval", 0):
        return "--sse-keep-alive-interval is set"
    if getattr(args, "middleware", None):
        return "--middleware is set"
    if os.environ.get("VLLM_DEBUG_LOG_API_SERVER_RESPONSE", "").strip().lower() in _ON:
        return "VLLM_DEBUG_LOG_API_SERVER_RESPONSE is set"
    processor = getattr(serving.engine_client, "output_processor", None)
    if getattr(processor, "_core", None) is None:
        return "the engine client has no native output processing"
    if serving.enable_log_outputs and serving.request_logger:
        return "--enable-log-outputs is set"
    return None


def stream_refusal(
    serving: Any,
    request: Any,
    connection: asgi_cycle.Connection | None,
    first: Iterable[Check],
    options: Iterable[Check],
) -> str | None:
    """Why a streaming request stays on vLLM's generator (None: it takes the fast path):
    the reason of the first check that refuses, in this order: the server's
    (:func:`server_refusal`), the endpoint's ``first``, those of both endpoints (no
    beam search), the endpoint's ``options``, then the options neither
    endpoint renders (weight versions)."""
    server = server_refusal(serving, connection)
    if server is not None:
        return server
    checks = (
        *first,
        (request.use_beam_search, "beam search"),
        *options,
        (request.return_weight_versions, "return_weight_versions"),
    )
    return next((why for refused, why in checks if refused), None)


def attachable(
    processor: Any,
    external_id: str,
    connection: asgi_cycle.Connection,
    chunks: int,
    index: int = 0,
    samples: int = 1,
) -> RequestText | None:
    """The native state of the request's sample ``index`` (of ``samples``), if its next
    plain outputs can go straight to the connection: it is native, nothing of the request
    waits in its collector, and the ``chunks`` chunks the generator produced are all on
    the wire (``Connection.caught_up``). With several samples, the external id must name
    exactly their ``samples`` states, children of one parent (another request sharing the
    id, a client's own, leaves every sample on Python's path)."""
    if not connection.caught_up(chunks):
        return None
    internal = processor.external_req_ids.get(external_id)
    if not internal or len(internal) != samples:
        return None
    states = [processor.request_states.get(i) for i in internal]
    if None in states:
        return None
    state = states[0]
    if samples > 1:
        parent = state.parent_req
        if parent is None or any(s.parent_req is not parent for s in states):
            return None
        state = next((s for s in states if s.request_index == index), None)
    if state is None or state.queue is None or _waiting(state.queue.output, index, samples):
        return None
    text = state.detokenizer
    return text if isinstance(text, RequestText) else None


def _waiting(pending: Any, index: int, samples: int) -> bool:
    # Whether the collector holds something of sample ``index`` for Python (anything at
    # all, with one sample): then the sample's next frames would overtake it. The samples
    # of one request share the collector, and another sample's output there is no reason
    # to wait.
    if pending is None:
        return False
    outputs = getattr(pending, "outputs", None)
    if samples == 1 or outputs is None:
        return True
    return any(output.index == index for output in outputs)


def attach(
    endpoint: str,
    text: RequestText,
    connection: asgi_cycle.Connection,
    template: Template,
    logprobs_limit: int | None = None,
    text_offset: int = 0,
    skip_empty: bool = False,
    release_ids: list[int] | None = None,
    chat_logprobs: bool = False,
    completion_tokens: int = 0,
) -> bool:
    """Attaches ``text`` to the connection (``RequestText.attach_stream``; with a template
    whose chunks carry running usage, ``completion_tokens``: the sample's output tokens so
    far); False, said once, when that fails (the native state refuses a request the
    endpoint's checks let through, or the cycle is not what it should be): the stream
    stays Python's, unharmed."""
    usage = None if template.usage is None else (*template.usage, completion_tokens)
    try:
        text.attach_stream(
            connection.cycle,
            template.head,
            template.mid,
            template.tail,
            logprobs_limit,
            text_offset,
            skip_empty=skip_empty,
            release_ids=release_ids or [],
            chat_logprobs=chat_logprobs,
            ids_mid=template.ids_mid,
            usage=usage,
        )
    except Exception as e:
        # Once per reason (the message names the request first).
        reason = str(e).rsplit(": ", 1)[-1]
        if (endpoint, reason) not in _told:
            _told.add((endpoint, reason))
            logger.warning("corewire: a streaming %s stays Python's: %s", endpoint, e)
        return False
    return True


def request_metrics(serving: Any, last_res: Any, completion_tokens: int) -> Any:
    """The per-request metrics a stream's usage chunk carries, as vLLM 0.34.0's server
    makes them for one prompt and one sample: timings when the server reports them
    (``--enable-per-request-metrics``), speculative decoding's counts when the request
    had any; None when neither."""
    per_request: Any = None
    if serving.enable_per_request_metrics:
        per_request = build_per_request_timing_metrics(
            last_res.metrics if last_res is not None else None, completion_tokens
        )
    spec_stats = build_spec_decoding_metrics(last_res)
    if spec_stats is not None:
        if per_request is None:
            per_request = PerRequestMetrics()
        per_request.speculative_decoding = spec_stats
    return per_request


def route(
    serving_class: Any,
    name: str,
    endpoint: str,
    take: Callable[..., AsyncGenerator[str, None] | str],
) -> None:
    """Routes the streaming generator ``name`` of ``serving_class`` (one of vLLM's serving
    classes) through ``take``: called with the server, the request's connection and the
    generator's own arguments, it returns the fast path's stream, or why the request
    stays on vLLM's generator (then :func:`keep_vllms` says so and vLLM's runs, given the
    arguments as they came)."""
    original = getattr(serving_class, name)

    def generator(self: Any, *args: Any, **kwargs: Any) -> AsyncGenerator[str, None]:
        taken = take(self, asgi_cycle.current_cycle(), *args, **kwargs)
        if isinstance(taken, str):
            keep_vllms(endpoint, taken)
            return original(self, *args, **kwargs)
        return taken

    # The mark install() looks for: vLLM loads plugins more than once per process.
    generator.corewire_fast_path = True  # type: ignore[attr-defined]
    generator.__name__ = name
    generator.__doc__ = original.__doc__
    setattr(serving_class, name, generator)


def nothing_to_say(output: Any, tokens: int) -> bool:
    """Whether ``output`` (a ``CompletionOutput``) is chunked prefill's, before the
    request's first token (``tokens``: its output tokens so far): no text, no token ids,
    no finish. vLLM sends no chunk for it."""
    return not output.text and not output.token_ids and not tokens and output.finish_reason is None


class Stream:
    """The Python side of one stream on the fast path, besides the endpoint's own
    rendering: what the outputs said of the prompt, the chunks yielded, the native state
    of each of the request's samples once attached to the connection
    (:meth:`attach_after_chunk`), the usage (:meth:`usage`, :meth:`usage_chunk`) and the
    end (:meth:`close`)."""

    def __init__(
        self,
        serving: Any,
        request: Any,
        connection: asgi_cycle.Connection,
        endpoint: str,
        names: tuple[str, int, str],
        template: Template | None,
    ) -> None:
        self.serving = serving
        self.connection = connection
        self.endpoint = endpoint
        #: The request's id, creation time and model name, as its chunks carry them.
        self.names = names
        #: The frame template of the native chunks (None: the stream stays Python's).
        self.template = template
        #: Whether a usage chunk ends the stream (then the finish has no fingerprint), and
        #: whether every chunk carries the running usage.
        self.include_usage, self.continuous_usage = should_include_usage(
            request.stream_options, serving.enable_force_include_usage
        )
        self.processor = serving.engine_client.output_processor
        #: How many samples the request has (``n``).
        self.samples = request.n or 1
        #: Each sample's native state by its index, once attached (it stays, detached, to
        #: the end).
        self.texts: dict[int, RequestText] = {}
        #: The chunks yielded so far (before the finish): all on the wire before an attach.
        self.chunks = 0
        self.last_res: Any = None
        self.num_prompt_tokens = 0
        self.num_cached_tokens: int | None = None
        self.num_cache_creation_tokens: int | None = None

    def seen(self, res: Any, encoder_prompt: bool = False) -> bool:
        """Notes a ``RequestOutput`` of the request (the last one's metrics go into the
        usage chunk): the prompt's size (with the encoder's prompt, where vLLM counts it)
        and, from the first output, its cached tokens; True for the first output."""
        first = self.last_res is None
        self.last_res = res
        if res.prompt_token_ids is not None:
            self.num_prompt_tokens = len(res.prompt_token_ids)
            if encoder_prompt and res.encoder_prompt_token_ids is not None:
                self.num_prompt_tokens += len(res.encoder_prompt_token_ids)
        if first:
            self.num_cached_tokens = res.num_cached_tokens
            self.num_cache_creation_tokens = res.num_cache_creation_tokens
        return first

    @property
    def text(self) -> RequestText | None:
        """The first sample's native state, once attached."""
        return self.texts.get(0)

    @property
    def streamed(self) -> int:
        """The output tokens the native states wrote to the connection (0 before)."""
        return sum(text.streamed_tokens for text in self.texts.values())

    def streamed_of(self, index: int) -> int:
        """The output tokens sample ``index``'s native state wrote (0 before)."""
        text = self.texts.get(index)
        return text.streamed_tokens if text is not None else 0

    @property
    def finish_fingerprint(self) -> str | None:
        """The fingerprint the finish carries: the server's, unless a usage chunk comes
        after it."""
        return None if self.include_usage else self.serving.system_fingerprint

    def attach_after_chunk(
        self,
        external_id: str,
        wanted: object = True,
        logprobs_limit: int | None = None,
        text_offset: int = 0,
        skip_empty: bool = False,
        release_ids: list[int] | None = None,
        chat_logprobs: bool = False,
        index: int = 0,
        template: Template | None = None,
        completion_tokens: int = 0,
    ) -> bool:
        """Attaches the native state of sample ``index`` (``external_id``: the request's
        id in the output processor) to the connection after an unfinished chunk, with
        ``template`` (default: the stream's), when there is one, the state is not attached
        already, ``wanted`` holds and :func:`attachable` lets it; True when it did.
        The chunk went on before the next was asked for: once it is on the wire, the
        plain outputs after it can go straight there. ``skip_empty``: outputs with no new
        text get no frame; ``release_ids``: an output with one of these token ids is
        Python's to render; ``chat_logprobs``: the logprobs are a chat chunk's;
        ``completion_tokens``: the sample's output tokens so far (for running usage)."""
        template = self.template if template is None else template
        attached = self.texts.get(index)
        if template is None or (attached is not None and attached.stream_attached):
            return False
        ready = attachable(
            self.processor, external_id, self.connection, self.chunks, index, self.samples
        )
        if ready is None or not wanted:
            return False
        if not attach(
            self.endpoint,
            ready,
            self.connection,
            template,
            logprobs_limit,
            text_offset,
            skip_empty,
            release_ids,
            chat_logprobs,
            completion_tokens,
        ):
            return False
        self.texts[index] = ready
        return True

    def usage(self, completion_tokens: int, **fields: Any) -> UsageInfo:
        """The request's usage, with the endpoint's further ``fields``."""
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.num_prompt_tokens + completion_tokens,
            **fields,
        )

    def usage_chunk(
        self, response_class: Any, usage: UsageInfo, completion_tokens: int, **fields: Any
    ) -> Any:
        """The choice-less chunk of ``response_class`` (the endpoint's stream response)
        that carries ``usage``, the server's fingerprint and the per-request metrics (of
        a request of one sample), with
        the endpoint's further ``fields``."""
        request_id, created, model = self.names
        return response_class(
            id=request_id,
            created=created,
            model=model,
            choices=[],
            usage=usage,
            system_fingerprint=self.serving.system_fingerprint,
            # vLLM reports a request's metrics for one sample only.
            metrics=(
                request_metrics(self.serving, self.last_res, completion_tokens)
                if self.samples == 1
                else None
            ),
            **fields,
        )

    def close(self) -> None:
        """Ends the stream (it is over, or cancelled): detaches the native states, so that
        nothing more goes to the connection, and counts the request and its native
        tokens."""
        for text in self.texts.values():
            text.detach_stream()
        metrics.count_fast_path("fast", self.streamed)
