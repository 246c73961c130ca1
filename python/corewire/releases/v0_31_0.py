"""vLLM 0.31.0: the ready response's attention block size and KV-event sources
(docs/protocol.md §11.3)."""

from __future__ import annotations

from corewire.releases.v0_29_0 import Release0290

__all__ = ["Release0310"]


class Release0310(Release0290):
    """vLLM 0.31.0: the client keeps ``effective_attention_block_size`` only when every
    engine names the same one (an empty ready payload counts as unknown), keeps each
    engine's ``kv_events_config`` (``get_kv_event_sources``), and calls
    ``release_kv_cache_memory``; an engine's ``wake_up`` answers a bool."""

    __slots__ = ()
    NAME = "0.31.0"
    LIVE_CHECKED = ("0.31.0",)
