"""vLLM 0.31.0: the ready response's attention block size and KV-event sources
(docs/protocol.md §11.3)."""

from __future__ import annotations

from typing import Any

import msgspec

from corewire.releases.base import apply_common_ready
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

    def apply_ready(self, client: Any, info: dict[str, Any]) -> Any:
        from vllm.v1.engine import EngineCoreReadyResponse

        vllm_config = client.vllm_config
        # An empty payload is a ready engine that says nothing (vLLM skips it), and
        # counts as an unknown attention block size.
        response = msgspec.convert(info, EngineCoreReadyResponse) if info else None
        sizes = client.effective_attention_block_sizes
        sizes.add(None if response is None else response.effective_attention_block_size)
        cache_config = vllm_config.cache_config
        cache_config.effective_attention_block_size = next(iter(sizes)) if len(sizes) == 1 else None
        if response is None:
            return None
        apply_common_ready(vllm_config, response)
        cache_config.mamba_block_size = response.mamba_block_size
        if response.kv_events_config is not None:
            client.kv_event_sources[response.data_parallel_rank] = response.kv_events_config
        return response
