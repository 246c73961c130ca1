"""vLLM 0.27.0 (and 0.27.1, which changed none of the files its behaviour lives in): what
changed since 0.26.0 beyond the struct layouts (docs/protocol.md §11.3)."""

from __future__ import annotations

from typing import Any

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

    def request_writer(self) -> Any:
        from corewire.client import wire_requests

        # corewire's 0.25.1 struct converted into this release's own layout by field name.
        return wire_requests.converted_writer(self)

    def engine_utilities(self, proc: Any) -> Any:
        # The calls this front-end makes beyond the engine's own methods (weight
        # versions) are in 0.33.0's set; the rest of that set is never called here.
        from corewire.engine.utilities_0_33_0 import Utilities0330

        return Utilities0330(proc)

    def vllm_client_members(self) -> type:
        # 0.33.0's client members: this AsyncLLM calls a subset of them, with the same
        # arguments (handle_fault, get_status, weight versions, prepare/commit elastic EP;
        # profile with two of its five). The all-engine and consensus answers of
        # reset_prefix_cache, wake_up, is_sleeping and is_scheduler_paused are 0.32.0's;
        # before it a DP group answered with its first engine's, the same whenever the
        # engines agree (they take every such call together).
        from corewire.vllm.v0_33_0 import Members0330

        return Members0330
