"""Call id -2: an engine's fault-tolerance status (vLLM 0.33.0), as the clients take it.

A vLLM 0.33.0 engine with fault tolerance on pushes its health to client 0 as a utility
reply nobody asked for: call id :data:`~corewire.wire.layouts.FT_STATUS_CALL_ID`, result
``{"id": engine_index, "status": "healthy" | "unhealthy" | "dead", "fault_info"?: ...}``.
The output link hands each one to the client's status handler and never to a waiting
call (:meth:`~corewire.client.output_link.OutputLink.pump`):

- the async clients keep the latest map per engine (:class:`StatusKeeper`, into their
  public ``engine_status``), as vLLM 0.33.0's ``AsyncMPClient`` does;
- the sync client has nowhere to put it (vLLM 0.33.0's ``SyncMPClient`` would fail on it
  with a ``KeyError``): :class:`StatusDrops` counts it and logs the first one.

Wire format: docs/vllm-0.33.0-notes.md §4.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["StatusDrops", "StatusKeeper"]

logger = logging.getLogger("corewire.client")


class StatusKeeper:
    """Stores each status map in ``statuses[engine_index]`` (replacing the last one).

    Holds the dict only, never the client, so the output link keeps nothing alive. A
    reply without a result (vLLM ignores those too) or whose value is not a map is
    skipped, with a warning for the latter.
    """

    __slots__ = ("statuses",)

    def __init__(self, statuses: dict[int, dict[str, Any]]) -> None:
        self.statuses = statuses

    def __call__(self, engine_index: int, utility: Any) -> None:
        """The link's status handler: one call id -2 reply from ``engine_index``."""
        result = utility.result
        if result is None:
            return
        value = result.result
        if not isinstance(value, dict):
            logger.warning(
                "ignoring an engine status (call id -2) from engine %d that is not a map: %.200r",
                engine_index,
                value,
            )
            return
        self.statuses[engine_index] = value


class StatusDrops:
    """Drops status messages: :attr:`count` says how many, the first one is logged."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        #: Status messages (call id -2) received and dropped.
        self.count = 0

    def __call__(self, engine_index: int, utility: Any) -> None:
        """The link's status handler: one call id -2 reply from ``engine_index``."""
        self.count += 1
        if self.count == 1:
            result = utility.result
            logger.warning(
                "engine %d sent a fault-tolerance status (call id -2: %.200r); the sync "
                "client keeps no engine status, so it and any later ones are dropped "
                "(use an async client to read them)",
                engine_index,
                None if result is None else result.result,
            )
