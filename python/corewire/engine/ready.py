"""The ready response: the map an engine sends once on each request link when connected.

It carries every key of vLLM 0.25.1's ``EngineCoreReadyResponse`` (vLLM's front-end
decodes it strictly: a missing key fails its start-up), with the engine's own values
from :meth:`corewire.engine.Engine.engine_info`, plus three keys of corewire's own
(``status``, ``engine_index``, ``pid``) that vLLM's decoder ignores.

Wire format: docs/protocol.md §3.1 (the ready response).
"""

from __future__ import annotations

import os
from typing import Any

from corewire.engine.interface import EngineInfo
from corewire.protocol import READY_STATUS

__all__ = ["VLLM_PROTOCOL_VERSION", "engine_info_of", "ready_response"]

#: The vLLM release whose engine-core protocol corewire speaks (the ready response's
#: ``vllm_version``).
VLLM_PROTOCOL_VERSION = "0.25.1"


def engine_info_of(engine: Any) -> EngineInfo:
    """The engine's :class:`EngineInfo`; the defaults for an engine that implements the
    interface by duck typing without ``engine_info()``."""
    report = getattr(engine, "engine_info", None)
    if report is None:
        return EngineInfo()
    info = report()
    if not isinstance(info, EngineInfo):
        raise TypeError(
            f"{type(engine).__name__}.engine_info() must return an EngineInfo, "
            f"got {type(info).__name__}"
        )
    return info


def ready_response(
    info: EngineInfo,
    *,
    engine_index: int,
    data_parallel_size: int = 1,
    dp_stats_address: str | None = None,
) -> dict[str, Any]:
    """The ready map for an engine described by ``info``.

    ``data_parallel_size`` is the size of the engine's DP group (1 without data
    parallelism) and ``dp_stats_address`` where a front-end subscribes to the group's
    load stats (None when there is no such publisher).
    """
    return {
        # vLLM's EngineCoreReadyResponse, every field in its order.
        "max_model_len": info.max_model_len,
        "num_gpu_blocks": info.num_gpu_blocks,
        "block_size": info.block_size,
        "dp_stats_address": dp_stats_address,
        "dtype": info.dtype,
        "vllm_version": VLLM_PROTOCOL_VERSION,
        "world_size": info.world_size,
        "data_parallel_size": data_parallel_size,
        "kv_cache_size_tokens": info.kv_cache_size_tokens,
        "kv_cache_max_concurrency": info.kv_cache_max_concurrency,
        # corewire's own: who is ready (vLLM's front-end ignores unknown keys).
        "status": READY_STATUS,
        "engine_index": engine_index,
        "pid": os.getpid(),
    }
