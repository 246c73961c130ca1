"""The releases corewire follows, written out here as the tests expect them (not read
from ``corewire.releases``, which they check): every vLLM release from 0.25.1 to 0.34.0
(docs/protocol.md §11.3)."""

from __future__ import annotations

__all__ = ["FOLLOWED"]

#: Every release corewire follows: each must be recorded, and the plugin must take it.
FOLLOWED = (
    "0.25.1",
    "0.26.0",
    "0.27.0",
    "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
    "0.34.0",
)
