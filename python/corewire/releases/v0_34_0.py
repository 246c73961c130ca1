"""vLLM 0.34.0: what changed since 0.33.0 beyond the struct layouts (which its record
carries: ``watermarking`` on outputs, ``block_hashes`` on requests, int32 ndarray prompts)."""

from __future__ import annotations

from corewire.releases.v0_33_0 import Release0330

__all__ = ["Release0340"]


class Release0340(Release0330):
    """vLLM 0.34.0. Its wire changes are in its record (its front-end packs every prompt
    as an int32 ndarray: :attr:`~corewire.releases.base.Release.packs_prompts`); its
    front-end's client members differ (``sleep(..., reset_connector)``, checkpoints, the
    ``engine_status`` property ``AsyncLLM`` reads: :mod:`corewire.vllm.adapters.v0_34_0`), and so
    do its engines' utilities (:mod:`corewire.engine.utilities_0_34_0`), and its
    ``OutputProcessor`` (:mod:`corewire.vllm.output.processor.v0_34_0`). Its OpenAI server has the
    per-token fast path (:mod:`corewire.vllm.fast_path`)."""

    __slots__ = ()
    NAME = "0.34.0"

    LIVE_CHECKED = ("0.34.0",)

    process_checkpoints = True
    chat_role_usage_details = True
    # Held to 0.34.0's OutputProcessor by tests/interop/test_vllm_output_diff.py.
    NATIVE_OUTPUT = True
    # Held to 0.34.0's OpenAI server by tests/interop/test_vllm_fast_path.py.
    FAST_PATH = True
