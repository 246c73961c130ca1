"""vLLM 0.27.0 (and 0.27.1, which changed none of the files its behaviour lives in): what
changed since 0.26.0 beyond the struct layouts (docs/protocol.md §11.3)."""

from __future__ import annotations

from corewire.releases.v0_25_1 import Release0251

__all__ = ["Release0270"]


class Release0270(Release0251):
    """vLLM 0.27.0: ``[waiting, running, kv_cache_usage]`` DP counts and the KV-pressure
    routing rule; fault-tolerance status (call id -2) kept per engine, with
    ``handle_fault`` / ``get_status``; ``set_weight_version`` / ``get_weight_version``;
    elastic EP split into ``prepare_elastic_ep`` / ``commit_elastic_ep``; the ready
    response's seven new required keys (its record's). Still 0.25.1's 4-tuple from
    ``launch_core_engines`` and ``get_engine_zmq_addresses``."""

    __slots__ = ()
    NAME = "0.27.0"
    # 0.27.1's core_client.py, async_llm.py, utils.py, coordinator.py, core.py and
    # __init__.py are byte-identical to 0.27.0's.
    LIVE_CHECKED = ("0.27.0", "0.27.1")

    counts_carry_kv_usage = True
    kv_pressure_routing = True
    # Checked against 0.25.1's, 0.33.0's and 0.34.0's OutputProcessor only.
    NATIVE_OUTPUT = False
