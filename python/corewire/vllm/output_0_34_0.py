"""Native output processing inside vLLM 0.34.0's ``AsyncLLM``: what its ``OutputProcessor``
changed since 0.33.0's (:mod:`corewire.vllm.output_0_33_0`).

- Prompt logprobs start after ``prompt_logprob_start`` unscored positions: the request's
  container is padded with that many more None positions.
- Stats count watermarking: a request's ``RequestStateStats`` starts with its sampling
  parameters' watermark flags (``EngineCoreOutput.watermarking``, sent on a first
  output, goes through vLLM's loop).
- ``prompt_token_id_logprobs`` (fixed-id prompt scores) travel with the request's state
  (``RequestText``) and are handed out as vLLM's processor hands them out.
"""

from __future__ import annotations

from typing import Any

from vllm.logprobs import create_prompt_logprobs
from vllm.v1.engine.output_processor import RequestState

from corewire.vllm.output_0_33_0 import NativeOutputProcessor0330

__all__ = ["NativeOutputProcessor0340"]


class NativeOutputProcessor0340(NativeOutputProcessor0330):
    """vLLM 0.34.0's ``OutputProcessor`` with plain outputs processed natively (see the
    module doc). Same constructor and methods as vLLM 0.34.0's."""

    def _prompt_container(self, params: Any) -> Any:
        container = create_prompt_logprobs(params.flat_logprobs)
        # Positions up to prompt_logprob_start are not scored (None), as vLLM pads.
        for _ in range(params.prompt_logprob_start or 0):
            container.append(None)
        return container

    def _new_state(self, request: Any, params: Any, **fields: Any) -> RequestState:
        state = super()._new_state(request, params, **fields)
        if state.stats is not None:
            state.stats.is_watermarked = bool(params.watermarking)
            state.stats.is_watermark_skipped = params._watermarking_skipped
        return state
