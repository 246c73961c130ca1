"""vLLM 0.28.0: ``launch_core_engines`` yields an object, and sampling parameters drop
repeated stops (docs/protocol.md §11.3)."""

from __future__ import annotations

from corewire.releases.v0_27_0 import Release0270

__all__ = ["Release0280"]


class Release0280(Release0270):
    """vLLM 0.28.0: ``launch_core_engines`` yields a ``CoreEngineLaunch`` (0.27.0: a
    4-tuple); ``SamplingParams`` drops repeated stop token ids and bad words; the ready
    response's new keys (``weight_transfer_backend``,
    ``enable_sleep_mode``, ``supports_draft_weight_updates``) are optional and in its
    record."""

    __slots__ = ()
    NAME = "0.28.0"
    LIVE_CHECKED = ("0.28.0",)

    drops_repeated_stops = True
