"""Native output processing inside vLLM 0.33.0's ``AsyncLLM``: what its ``OutputProcessor``
changed since 0.25.1's (:mod:`corewire.vllm.output.processor`;
docs/native-output-processing-notes.md §1.8).

- Stop strings: the one that ends earliest wins, ``min_tokens`` counts per token offset,
  and the ids taken after the one that completed it are dropped from the request and
  from the output (``_trim_surplus_tokens``); a ``DELTA`` output without new ids carries
  no sample logprobs (``[:0]``). Both are the Rust core's rules, selected by the class
  attributes.
- The constructor takes ``admission_stats``; adding a request updates them.
- A request's own ``stream_interval`` (clamped to the engine's),
  ``remote_prefill_cached_tokens`` from its KV-transfer parameters, and its watermark
  flags in its stats.
- ``process_outputs`` takes the step's ``weight_version``: native requests track its
  spans natively, and a finished output carries them.
- ``vllm.v1.engine.detokenizer.uses_fast_detokenizer`` decides the fast detokenizer, and
  ``IterationStats.compute_nans_in_logits`` (read when the stats were made) the NaN check.

Every new ``EngineCoreOutput`` field (errors, sampling masks, spec-decode metrics, ...)
sends the output that sets it through vLLM's loop (``corewire.vllm.output.processor.slow_fields``).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine.output_processor import OutputProcessorOutput, RequestState

from corewire.vllm.output.processor import NativeOutputProcessor

__all__ = ["NativeOutputProcessor0330"]


class NativeOutputProcessor0330(NativeOutputProcessor):
    """vLLM 0.33.0's ``OutputProcessor`` with plain outputs processed natively (see the
    module doc). Same constructor and methods as vLLM 0.33.0's."""

    EARLIEST_STOP = True
    EMPTY_DELTA_SLICE = True

    @staticmethod
    def _uses_fast_detokenizer(tokenizer: Any) -> bool:
        from vllm.v1.engine.detokenizer import uses_fast_detokenizer

        return uses_fast_detokenizer(tokenizer)

    def _stream_interval_of(self, params: Any) -> int:
        # A request's own interval, never below the engine's (as from_new_request).
        if params.stream_interval is None:
            return self.stream_interval
        return max(params.stream_interval, self.stream_interval)

    def _new_state(self, request: Any, params: Any, **fields: Any) -> RequestState:
        state = RequestState(
            **fields, remote_prefill_cached_tokens=_remote_prefill_cached_tokens(params)
        )
        if state.stats is not None:
            # Stats count watermarked requests; the parameters say first.
            state.stats.is_watermarked = bool(params.watermarking)
            state.stats.is_watermark_skipped = params._watermarking_skipped
        return state

    def _request_added(self) -> None:
        self._update_admission_stats()

    def _nans(self, iteration_stats: Any) -> bool:
        # Read once per IterationStats, when it was made.
        return iteration_stats is not None and bool(iteration_stats.compute_nans_in_logits)

    def process_outputs(
        self,
        engine_core_outputs: list[Any],
        engine_core_timestamp: float | None = None,
        iteration_stats: Any = None,
        weight_version: str | None = None,
    ) -> OutputProcessorOutput:
        """vLLM 0.33.0's ``process_outputs``: plain outputs of native requests natively,
        the rest through vLLM's loop."""
        return self._process(
            engine_core_outputs,
            engine_core_timestamp,
            iteration_stats,
            weight_version,
            {"weight_version": weight_version},
        )


def _remote_prefill_cached_tokens(params: Any) -> int | None:
    # A remote prefill reports the prefill worker's cache hits (RequestState's argument,
    # as vLLM's from_new_request reads it).
    if not params.extra_args:
        return None
    kv = params.extra_args.get("kv_transfer_params")
    if not kv or not kv.get("do_remote_prefill"):
        return None
    cached = kv.get("remote_prefill_cached_tokens")
    return cached if isinstance(cached, int) else None
