"""vLLM 0.34.0: what changed since 0.33.0 beyond the struct layouts (which its record
carries: ``watermarking`` on outputs, ``block_hashes`` on requests, int32 ndarray prompts)."""

from __future__ import annotations

from typing import Any

from corewire.releases.v0_33_0 import Release0330

__all__ = ["Release0340"]


class Release0340(Release0330):
    """vLLM 0.34.0. Its wire changes are in its record (its front-end packs every prompt
    as an int32 ndarray: :attr:`~corewire.releases.base.Release.packs_prompts`); its
    front-end's client members differ (``sleep(..., reset_connector)``, checkpoints, the
    ``engine_status`` property ``AsyncLLM`` reads: :mod:`corewire.vllm.v0_34_0`), and so
    do its engines' utilities (:mod:`corewire.engine.utilities_0_34_0`), and its
    ``OutputProcessor`` (:mod:`corewire.vllm.output_0_34_0`). Its OpenAI server has the
    per-token fast path (:mod:`corewire.vllm.fast_path`)."""

    __slots__ = ()
    NAME = "0.34.0"

    LIVE_CHECKED = ("0.34.0",)

    process_checkpoints = True
    # Held to 0.34.0's OutputProcessor by tests/test_vllm_output_diff.py.
    NATIVE_OUTPUT = True
    # Held to 0.34.0's OpenAI server by tests/test_vllm_fast_path.py.
    FAST_PATH = True

    def engine_utilities(self, proc: Any) -> Any:
        from corewire.engine.utilities_0_34_0 import Utilities0340

        return Utilities0340(proc)

    def request_writer(self) -> Any:
        from corewire.client import wire_requests

        # A later release it stands for packs prompts as its record says (a newer
        # release adopted live: corewire.releases.installed).
        if self.written_for or self.packs_prompts:
            return wire_requests.packed_writer(self)
        return wire_requests.as_given(self)

    def install_fast_path(self) -> None:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

        from corewire.vllm import fast_path

        fast_path.install(OpenAIServingCompletion, OpenAIServingChat)

    def native_output_processor(self) -> type:
        from corewire.vllm.output_0_34_0 import NativeOutputProcessor0340

        return NativeOutputProcessor0340

    def vllm_client_members(self) -> type:
        from corewire.vllm.v0_34_0 import Members0340

        return Members0340
