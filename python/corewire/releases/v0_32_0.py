"""vLLM 0.32.0: bound listening sockets for multi-API-server children, and all-engine
utility calls (docs/protocol.md §11.3); what 0.33.0 added on top is :mod:`.v0_33_0`."""

from __future__ import annotations

from corewire.releases.v0_31_0 import Release0310

__all__ = ["Release0320"]


class Release0320(Release0310):
    """vLLM 0.32.0: ``get_engine_zmq_bind_addresses``, and listening sockets handed to
    multi-API-server children; ``profile`` with four arguments; ``reset_prefix_cache``,
    ``wake_up`` and ``compute_weight_checksums`` go to every engine, ``is_sleeping``,
    ``is_scheduler_paused`` and ``get_weight_version`` must agree across engines. Front-ends
    still send first-request notices (waves are not yet engine-led) and there is no
    ``pause_generation``, session affinity or coordinator address in the ready response:
    those are 0.33.0's."""

    __slots__ = ()
    NAME = "0.32.0"
    LIVE_CHECKED = ("0.32.0",)
