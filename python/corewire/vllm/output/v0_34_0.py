"""Native output processing inside vLLM 0.34.0's ``AsyncLLM``: what its ``OutputProcessor``
changed since 0.33.0's (:mod:`corewire.vllm.output.v0_33_0`).

- Prompt logprobs start after ``prompt_logprob_start`` unscored positions: the request's
  container is padded with that many more None positions.
- The engine reports a request's watermarking on its first output
  (``EngineCoreOutput.watermarking``): that output goes through vLLM's loop, whose stats
  take the report.
- ``prompt_token_id_logprobs`` (fixed-id prompt scores) travel with the request's state
  (``RequestText``) and are handed out as vLLM's processor hands them out.
"""

from __future__ import annotations

from typing import Any

from vllm.logprobs import create_prompt_logprobs

from corewire.vllm.output.v0_33_0 import NativeOutputProcessor0330

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
