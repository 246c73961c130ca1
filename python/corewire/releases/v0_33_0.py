"""vLLM 0.33.0: what changed since 0.32.0 beyond the struct layouts (docs/protocol.md §11,
docs/vllm-0.33.0-notes.md)."""

from __future__ import annotations

from corewire.releases.v0_32_0 import Release0320

__all__ = ["Release0330"]


class Release0330(Release0320):
    """vLLM 0.33.0: engine-led DP waves (front-ends send no first-request notices),
    ``pause_generation``, session affinity, and the ready response's coordination-store
    port and coordinator addresses (notes §5.1, §6.1), on top of 0.32.0's front-end."""

    __slots__ = ()
    NAME = "0.33.0"
    LIVE_CHECKED = ("0.33.0",)

    engine_led_waves = True
    generation_pause_utilities = True
    session_affinity = True
    # Held to 0.33.0's OutputProcessor by tests/interop/test_vllm_output_diff.py.
    NATIVE_OUTPUT = True
    # Held to 0.33.0's OpenAI server by tests/interop/test_vllm_fast_path.py and
    # test_fast_path_parsers.py, run in that release's venv (COREWIRE_LIVE_0_33_0=1).
    FAST_PATH = True
