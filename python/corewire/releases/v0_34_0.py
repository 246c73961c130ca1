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
    ``engine_status`` property ``AsyncLLM`` reads)."""

    __slots__ = ()
    NAME = "0.34.0"

    # Its front-end's client members (above) are not written yet: the plugin refuses it
    # by name rather than fail inside AsyncLLM.
    VLLM_CLIENT = False

    def request_writer(self) -> Any:
        from corewire.client import wire_requests

        return wire_requests.packed_writer(self) if self.verified else wire_requests.as_given(self)
