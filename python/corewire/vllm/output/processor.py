"""Native output processing inside vLLM's ``AsyncLLM`` (0.25.1's here; later releases'
differences in the subclasses ``corewire.vllm.output.by_release`` picks for them).

:class:`NativeOutputProcessor` is vLLM's ``OutputProcessor`` with the common case done in
Rust: for each request that qualifies (:func:`native_refusal`), detokenization, stop
strings and sample logprobs live in a :class:`corewire._native.RequestText`, and every
plain output of such a request (past its first output, no finish from the engine, no
events) is handled whole by :meth:`corewire._native.OutputCore.process`: stats, text,
logprobs, the ``RequestOutput`` and its hand-off to the request's collector, with no
Python per token. The outputs that need vLLM's bookkeeping (first outputs, engine
finishes, events), and every output of other requests, go through vLLM's own loop; for
native requests that loop drives the same ``RequestText`` (it stands in for the request's
detokenizer and logprobs processor), so each request has one state whichever path its
outputs take.

The plugin installs the installed release's class when ``COREWIRE_VLLM_OUTPUT=1``, or
with corewire's client where the differential tests hold it to that release
(:mod:`corewire.vllm.plugin`). A processor whose tokenizer or settings the native path
does not cover (:func:`processor_refusal`) behaves exactly as vLLM's.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import tokenizers
import tokenizers.decoders
import vllm.envs as envs
from vllm.logprobs import FlatLogprobs, Logprob, create_prompt_logprobs, create_sample_logprobs
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.engine.output_processor import (
    OutputProcessor,
    OutputProcessorOutput,
    RequestOutputCollector,
    RequestState,
)

from corewire._native import TOKENIZERS_VERSION, OutputCore, RequestText

__all__ = [
    "NativeOutputProcessor",
    "native_refusal",
    "output_layouts",
    "processor_refusal",
    "slow_fields",
]

logger = logging.getLogger("vllm.corewire")

# Whether the log has said that corewire processes this process's outputs.
_said_processing = False


def _say_processing() -> None:
    # Said when vLLM builds the processor, once per process: by then vLLM's logging is
    # configured (0.34.0 configures it after loading plugins, which install this class).
    global _said_processing
    if _said_processing:
        return
    _said_processing = True
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from corewire.vllm.output import latency_histogram

    if latency_histogram.installed(PrometheusStatLogger):
        how = latency_histogram.FOLDED_LOG_LINE
    else:
        how = "inter-token latencies observed one by one, as vLLM does"
    logger.info("corewire: vLLM's AsyncLLM processes outputs with corewire (%s)", how)


# The Python class vLLM's fast detokenizer steps; a shim that replaces it (vLLM honours
# one) would decode differently from the crate, so the native path only runs under this.
_DECODE_STREAM = tokenizers.decoders.DecodeStream

#: The instance attributes, in order, of the vLLM classes the native path fills without
#: their ``__init__`` beyond the output classes (whose layouts ``OutputCore`` reads off
#: the installed vLLM's own objects, refusing a field it does not know: a vLLM build that
#: adds one must not get objects without it).
_LAYOUTS: dict[type, tuple[str, ...]] = {
    Logprob: ("logprob", "rank", "decoded_token"),
    FlatLogprobs: (
        "start_indices",
        "end_indices",
        "token_ids",
        "logprobs",
        "ranks",
        "decoded_tokens",
    ),
}

#: ``EngineCoreOutput`` fields the native fast path handles itself; any other field
#: (that defaults to None) sends an output that sets it through vLLM's loop.
_FAST_FIELDS = frozenset(
    {
        "request_id",
        "new_token_ids",
        "new_logprobs",
        "stop_reason",
        "trace_headers",
        # Only on a request's first output, which vLLM's loop handles.
        "prefill_stats",
        "num_nans_in_logits",
        # Read by vLLM's loop only for pooling requests' errors.
        "mm_cache_miss_hashes",
    }
)


def output_layouts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The installed vLLM's ``RequestOutput`` and ``CompletionOutput`` attributes, in the
    order their ``__init__`` assigns them."""
    request = RequestOutput("r", None, [], None, [], False)
    completion = CompletionOutput(0, "", [], None, None)
    return tuple(vars(request)), tuple(vars(completion))


def slow_fields() -> tuple[str, ...] | None:
    """The installed vLLM's ``EngineCoreOutput`` fields that send an output through
    vLLM's loop when set, or None when it has a field the native path cannot judge (one
    without a None default)."""
    slow = []
    for field in msgspec.structs.fields(EngineCoreOutput):
        if field.name in _FAST_FIELDS:
            continue
        if field.default is not None:
            return None
        slow.append(field.name)
    return tuple(slow)


def _fast_detokenizer_0_25_1(tokenizer: Any) -> bool:
    # vLLM 0.25.1's choice of FastIncrementalDetokenizer.
    from transformers import PreTrainedTokenizerFast
    from vllm.v1.engine.detokenizer import USE_FAST_DETOKENIZER

    return USE_FAST_DETOKENIZER and isinstance(tokenizer, PreTrainedTokenizerFast)


def processor_refusal(
    tokenizer: Any,
    tracing_enabled: bool,
    uses_fast_detokenizer: Any = _fast_detokenizer_0_25_1,
) -> str | None:
    """Why a whole processor must stay on vLLM's path, or None when it can go native.

    The native path decodes with the ``tokenizers`` crate what vLLM decodes with the
    ``tokenizers`` package's ``DecodeStream``: only tokenizers for which
    ``uses_fast_detokenizer`` (the release's own test) holds qualify. Tracing keeps
    vLLM's code (not covered yet).
    """
    if tokenizer is None:
        return "no tokenizer (skip_tokenizer_init)"
    if not uses_fast_detokenizer(tokenizer):
        return f"not a fast tokenizer ({type(tokenizer).__name__})"
    if tokenizers.decoders.DecodeStream is not _DECODE_STREAM:
        return "tokenizers.decoders.DecodeStream is replaced by a shim"
    if tokenizers.__version__.split(".")[:2] != TOKENIZERS_VERSION.split("."):
        # Another release of the library could decode an edge case differently.
        return (
            f"the tokenizers package is {tokenizers.__version__}, the native path decodes "
            f"with the {TOKENIZERS_VERSION} crate"
        )
    if tracing_enabled:
        return "tracing is enabled"
    samples = {Logprob: Logprob(0.0), FlatLogprobs: FlatLogprobs()}
    if any(tuple(vars(obj)) != _LAYOUTS[cls] for cls, obj in samples.items()):
        return "vLLM's logprob classes have fields the native path does not know"
    if slow_fields() is None:
        return "vLLM's EngineCoreOutput has a field the native path does not know"
    return None


def native_refusal(request: Any, parent_req: Any, queue: Any) -> str | None:
    """Why one request must stay on vLLM's path (None: it goes native).

    Pooling, prompt embeddings, streaming input and the synchronous engine (no
    collector) keep vLLM's code.
    """
    params = request.sampling_params
    if params is None:
        return "pooling"
    if queue is None:
        return "no output collector (LLMEngine)"
    if request.prompt_token_ids is None or request.prompt_embeds is not None:
        return "prompt embeddings"
    if request.resumable:
        return "streaming input"
    return None


class NativeOutputProcessor(OutputProcessor):
    """vLLM 0.25.1's ``OutputProcessor`` with plain outputs processed natively (see the
    module doc). Same constructor and methods as vLLM's.

    A later release's subclass changes what its release changed through the hooks
    (``_uses_fast_detokenizer``, ``_refusal``, ``_stream_interval_of``,
    ``_prompt_container``, ``_new_state``, ``_request_added``, ``_nans``) and the
    class attributes ``EARLIEST_STOP`` and ``EMPTY_DELTA_SLICE`` (the Rust core's
    rules)."""

    #: vLLM 0.33.0's stop-string rule (the earliest-ending stop string; the ids after the
    #: one that completed it dropped); 0.25.1: the first listed.
    EARLIEST_STOP = False
    #: vLLM 0.33.0's ``logprobs[:0]`` for a ``DELTA`` output without new ids; 0.25.1
    #: slices ``[-0:]`` (the whole list).
    EMPTY_DELTA_SLICE = False

    def __init__(
        self,
        tokenizer: Any,
        *,
        log_stats: bool,
        stream_interval: int = 1,
        tracing_enabled: bool = False,
        **kwargs: Any,
    ) -> None:
        # kwargs: what a later release's constructor adds (0.33.0: admission_stats).
        super().__init__(
            tokenizer,
            log_stats=log_stats,
            stream_interval=stream_interval,
            tracing_enabled=tracing_enabled,
            **kwargs,
        )
        #: Why this processor stays on vLLM's path (None when it does not).
        self.refusal = processor_refusal(tokenizer, tracing_enabled, self._uses_fast_detokenizer)
        self._core: OutputCore | None = None
        if self.refusal is None:
            raw = tokenizer._tokenizer
            added = {tid: tok.content for tid, tok in raw.get_added_tokens_decoder().items()}
            try:
                self._core = OutputCore(
                    raw.to_str(),
                    added,
                    self._candidate_string,
                    # transformers may clean up spaces after decoding; the crate never does.
                    tokenizer.decode
                    if getattr(tokenizer, "clean_up_tokenization_spaces", False)
                    else None,
                    logger.warning,
                    (RequestOutput, CompletionOutput, Logprob, FlatLogprobs),
                    self.request_states,
                    output_layouts(),
                    slow_fields(),
                    self.EARLIEST_STOP,
                    self.EMPTY_DELTA_SLICE,
                )
            except ValueError as e:
                # An output class with a field the native path does not know.
                self.refusal = str(e)
        if self.refusal is not None:
            logger.info("corewire: vLLM's output processing kept: %s", self.refusal)
        else:
            _say_processing()

    @staticmethod
    def _uses_fast_detokenizer(tokenizer: Any) -> bool:
        """Whether this release's vLLM detokenizes with ``FastIncrementalDetokenizer``
        (the ``DecodeStream`` the native path reproduces)."""
        return _fast_detokenizer_0_25_1(tokenizer)

    def _candidate_string(self, token_id: int) -> str:
        # vLLM's own function, so that the strings are exactly vLLM's (once per id).
        return convert_ids_list_to_tokens(self.tokenizer, [token_id])[0]

    @property
    def native_counts(self) -> dict[str, int]:
        """Outputs by path: ``fast`` (wholly native), ``slow`` (native requests' outputs
        that took vLLM's loop), ``fallback`` (other requests' outputs)."""
        if self._core is None:
            return {"fast": 0, "slow": 0, "fallback": 0}
        return self._core.counts

    def is_native(self, request_id: str) -> bool:
        """Whether the request (internal id) takes the native path."""
        state = self.request_states.get(request_id)
        return state is not None and isinstance(state.detokenizer, RequestText)

    # -- what later releases change --------------------------------------------------

    def _refusal(self, request: Any, parent_req: Any, queue: Any) -> str | None:
        """Why ``request`` stays on vLLM's path (:func:`native_refusal`)."""
        return native_refusal(request, parent_req, queue)

    def _stream_interval_of(self, params: Any) -> int:
        """The request's stream interval (0.25.1: the processor's)."""
        return self.stream_interval

    def _prompt_container(self, params: Any) -> Any:
        """vLLM's new prompt-logprobs container for a request that asked for them."""
        return create_prompt_logprobs(params.flat_logprobs)

    def _new_state(self, request: Any, params: Any, **fields: Any) -> RequestState:
        """The request's vLLM ``RequestState`` from ``fields`` (0.25.1's arguments)."""
        return RequestState(**fields)

    def _request_added(self) -> None:
        """After a native request was added (0.25.1: nothing more)."""

    def _nans(self, iteration_stats: Any) -> bool:
        """Whether NaN counts mark requests corrupted in this chunk's stats."""
        # vLLM 0.25.1 reads this setting per output; once per chunk gives the same answer.
        return iteration_stats is not None and bool(envs.VLLM_COMPUTE_NANS_IN_LOGITS)

    # -- vLLM's methods -------------------------------------------------------------

    def add_request(
        self,
        request: Any,
        prompt: str | None,
        parent_req: Any = None,
        request_index: int = 0,
        queue: Any = None,
    ) -> None:
        """vLLM's ``add_request``; a qualifying new request gets native state."""
        core = self._core
        if (
            core is None
            or request.request_id in self.request_states
            or self._refusal(request, parent_req, queue) is not None
        ):
            super().add_request(request, prompt, parent_req, request_index, queue)
            return
        params = request.sampling_params
        detokenize = bool(params.detokenize)
        if params.stop is None or not detokenize:
            stop: list[str] = []
        elif isinstance(params.stop, str):
            stop = [params.stop]
        else:
            stop = list(params.stop)
        stream_interval = self._stream_interval_of(params)
        stats_state = self._new_state(
            request,
            params,
            request_id=request.request_id,
            external_req_id=request.external_req_id,
            parent_req=parent_req,
            request_index=request_index,
            lora_request=request.lora_request,
            output_kind=params.output_kind,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_embeds=None,
            logprobs_processor=None,
            detokenizer=None,
            max_tokens_param=params.max_tokens,
            arrival_time=request.arrival_time,
            queue=queue,
            log_stats=self.log_stats,
            stream_interval=stream_interval,
            top_p=params.top_p,
            n=params.n,
            temperature=params.temperature,
            stream_input=False,
        )
        text = core.request(
            request.request_id,
            request.external_req_id,
            prompt,
            request.prompt_token_ids,
            request.lora_request,
            request_index,
            params.output_kind.value,
            stream_interval,
            queue,
            type(queue) is RequestOutputCollector,
            stats_state.stats,
            detokenize,
            params.skip_special_tokens,
            params.skip_special_tokens or params.spaces_between_special_tokens,
            stop,
            params.min_tokens,
            params.include_stop_str_in_output,
            params.num_logprobs,
            # vLLM's own container, filled natively: what reads it reads vLLM's class.
            create_sample_logprobs(True) if params.flat_logprobs else None,
            params.prompt_logprobs,
            # vLLM's new prompt container (its first position None), filled natively.
            None if params.prompt_logprobs is None else self._prompt_container(params),
            # An n > 1 child's outputs go through vLLM's ParentRequest, as in vLLM.
            parent_req,
        )
        # One object answers both roles: it holds the text and the sample logprobs.
        stats_state.detokenizer = text
        stats_state.logprobs_processor = text
        self.request_states[request.request_id] = stats_state
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req
        self.external_req_ids[stats_state.external_req_id].append(request.request_id)
        self._request_added()

    def abort_requests(self, request_ids: Any, internal: bool) -> list[str]:
        """vLLM's ``abort_requests``; a request on ``vllm serve``'s fast path is handed
        back to Python first (its waiting frames written, its kept logprobs back in vLLM's
        container), as its aborted output is rendered there."""
        request_ids = list(request_ids)
        for request_id in request_ids:
            internal_ids = [request_id] if internal else self.external_req_ids.get(request_id)
            for internal_id in internal_ids or [request_id]:
                state = self.request_states.get(internal_id)
                text = getattr(state, "detokenizer", None)
                if isinstance(text, RequestText) and text.stream_attached:
                    text.detach_stream(True)
        return super().abort_requests(request_ids, internal)

    def process_outputs(
        self,
        engine_core_outputs: list[Any],
        engine_core_timestamp: float | None = None,
        iteration_stats: Any = None,
    ) -> OutputProcessorOutput:
        """vLLM's ``process_outputs``: plain outputs of native requests natively, the
        rest through vLLM's loop."""
        return self._process(engine_core_outputs, engine_core_timestamp, iteration_stats)

    def _process(
        self,
        engine_core_outputs: list[Any],
        engine_core_timestamp: float | None,
        iteration_stats: Any,
        weight_version: str | None = None,
        loop_kwargs: dict[str, Any] | None = None,
    ) -> OutputProcessorOutput:
        # loop_kwargs: what a later release's process_outputs takes beyond 0.25.1's,
        # passed on to vLLM's loop.
        loop_kwargs = loop_kwargs or {}
        core = self._core
        if core is None:
            return super().process_outputs(
                engine_core_outputs, engine_core_timestamp, iteration_stats, **loop_kwargs
            )
        aborted: list[str] = []

        def finish(req_id: str) -> None:
            # A stop string ended a request the engine still runs: finish it and have the
            # engine abort it, as vLLM's loop does right after the request's output.
            req_state = self.request_states[req_id]
            self._finish_request(req_state)
            aborted.append(req_id)
            self._update_stats_from_finished(req_state, FinishReason.STOP, iteration_stats)

        rest = core.process(
            engine_core_outputs,
            engine_core_timestamp,
            iteration_stats,
            self._nans(iteration_stats),
            finish,
            weight_version,
        )
        if rest:
            result = super().process_outputs(
                rest, engine_core_timestamp, iteration_stats, **loop_kwargs
            )
        else:
            result = OutputProcessorOutput(request_outputs=[], reqs_to_abort=[])
        result.reqs_to_abort.extend(aborted)
        return result
