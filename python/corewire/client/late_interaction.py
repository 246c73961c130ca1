"""Late-interaction pooling requests pinned to one engine, as vLLM's DP client pins them.

A late-interaction scorer (ColBERT-style) first caches a query's token embeddings in an
engine's worker memory (mode ``"cache_query"``), then scores documents against them
(``"score_doc"``); both carry the same ``query_key``. The cache is per engine, so every
request of one query must reach the same engine: vLLM routes them to
``crc32(query_key) % num_engines`` instead of by load, and so does corewire's DP client.

``late_interaction_params`` arrives as vLLM's struct (under vLLM's front-end), as the
positional array it is on the wire (``[mode, query_key, query_uses]``), or as a map.
"""

from __future__ import annotations

import zlib
from typing import Any

__all__ = ["PINNED_MODES", "late_interaction_rank"]

#: The modes whose requests share an engine-local query cache.
PINNED_MODES = frozenset({"cache_query", "score_doc"})


def _mode_and_key(params: Any) -> tuple[Any, Any]:
    if isinstance(params, (list, tuple)):
        return (params[0] if params else None), (params[1] if len(params) > 1 else None)
    if isinstance(params, dict):
        return params.get("mode"), params.get("query_key")
    return getattr(params, "mode", None), getattr(params, "query_key", None)


def late_interaction_rank(pooling_params: Any, num_engines: int) -> int | None:
    """The engine a late-interaction request is pinned to, or None (not one: route it
    by load)."""
    params = getattr(pooling_params, "late_interaction_params", None)
    if params is None:
        return None
    mode, query_key = _mode_and_key(params)
    if mode not in PINNED_MODES or not isinstance(query_key, str) or not query_key:
        return None
    return zlib.crc32(query_key.encode("utf-8")) % num_engines
