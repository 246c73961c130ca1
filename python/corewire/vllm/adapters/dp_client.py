"""What corewire's data-parallel clients do differently when built from vLLM's
client-factory arguments (their classes: :mod:`corewire.vllm.adapters.classes`).

Under vLLM the DP coordinator is vLLM's own (started by ``launch_core_engines`` on rank 0,
or reached through ``client_addresses["stats_update_address"]``): these clients start no
coordinator of their own and follow vLLM's publications on its front-end stats address,
whose format (``[counts, current_wave, engines_running]``) corewire's DP clients already
read. Routing, aborts, utility fan-out and death handling are corewire's: with internal
load balancing, one engine lost is ``engine_loss``'s (``COREWIRE_ENGINE_LOSS``; see
:mod:`corewire.client.engine_loss`), where vLLM's engines are independent, those of a
dense model; a MoE model's DP engines run their steps together (vLLM's
``DPEngineCoreProc``), so losing one fails the whole client, as in vLLM.

Wire format: docs/protocol.md §8.1 (vLLM's coordinator) and §5.6 (elastic-scaling
notifications).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from corewire.client.dp import DPLBAsyncMPClient
from corewire.coordinator import CoordinatorAddresses
from corewire.vllm.adapters.client import VllmArgs, VllmClientMixin

__all__ = ["VllmDPMixin"]

# Filled in once vLLM's coordinator is known (after the engines' start-up); the engine
# endpoints are never used here: vLLM's handshake gives the engines their own.
_UNKNOWN = CoordinatorAddresses(front_publish="", engine_stats="", engine_publish="")


class VllmDPMixin(VllmClientMixin):
    """Construction shared by the DP adapters (of every vLLM release): no coordinator of
    corewire's, vLLM's publications followed instead."""

    coordinator_addresses: CoordinatorAddresses

    def _vllm_setup(self, args: VllmArgs) -> dict[str, Any]:
        kwargs = super()._vllm_setup(args)
        kwargs["data_parallel_size"] = self.vllm_config.parallel_config.data_parallel_size
        kwargs["coordinator_addresses"] = _UNKNOWN
        if isinstance(self, DPLBAsyncMPClient):
            # vLLM runs a MoE model's DP engines in lockstep, a dense model's apart.
            kwargs["engines_coupled"] = bool(getattr(self.vllm_config.model_config, "is_moe", True))
        return kwargs

    def _vllm_finish_setup(self) -> None:
        super()._vllm_finish_setup()
        if self.stats_update_address is None:
            raise RuntimeError(
                "vLLM's DP coordinator address is unknown: no engine's ready response and "
                "no client_addresses named it"
            )
        self.coordinator_addresses = dataclasses.replace(
            self.coordinator_addresses, front_publish=self.stats_update_address
        )
