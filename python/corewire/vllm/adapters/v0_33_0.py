"""corewire's clients for vLLM 0.33.0's ``AsyncLLM``: the members it calls that 0.25.1's
did not, or calls with other signatures or semantics (docs/vllm-0.33.0-notes.md §6.2).

- **All-engine and consensus calls.** ``reset_prefix_cache`` and ``wake_up`` go to every
  engine and AND the results; ``is_sleeping``, ``is_scheduler_paused`` and
  ``get_weight_version`` go to every engine and must agree (``RuntimeError`` otherwise).
- **New calls.** ``pause_generation_async`` (the engine refuses new requests while paused),
  ``release_kv_cache_memory_async``, ``set_weight_version_async``,
  ``compute_weight_checksums_async`` (every engine's workers, flattened), ``profile_async``
  with five arguments, :meth:`Members0330.get_kv_event_sources` (from the ready responses).
- **Fault tolerance.** ``handle_fault`` calls the engine utility
  ``handle_fault_tolerance``; ``get_status`` reports each engine's last status from
  corewire's client (``engine_status``, fed by the engines' call id -2 messages).
- **Elastic EP** (``prepare_elastic_ep`` / ``commit_elastic_ep`` /
  ``abort_external_elastic_ep``) is not supported: each raises ``NotImplementedError``
  saying so, as vLLM's own base client does.
- **Request errors.** An output whose engine refused or failed its request carries
  corewire's ``RequestError`` as decoded: its ``to_exception()`` is the one vLLM's output
  processor calls, giving vLLM's own exceptions (503 / 400 / 500), so outputs are handed
  over untouched (no per-output step in Python).

The data-parallel clients follow vLLM 0.33.0's coordinator as corewire's DP clients do
with ``release="0.33.0"`` (``[waiting, running, kv_cache_usage]`` counts, no first-request
notices, 0.33.0's routing rule); the rest is :mod:`corewire.vllm.adapters.dp_client`'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from corewire.client.dp import DPConsensusError
from corewire.vllm.adapters.client import VllmArgs, VllmClientMixin

__all__ = [
    "FT_UTILITY_METHOD",
    "Members0330",
]

#: The engine utility behind ``handle_fault`` (vLLM 0.33.0's ``FT_UTILITY_METHOD``).
FT_UTILITY_METHOD = "handle_fault_tolerance"
#: The ``schema_version`` of ``get_status``'s answer (vLLM 0.33.0's).
_STATUS_SCHEMA_VERSION = 1


class Members0330(VllmClientMixin):
    """The client members of vLLM 0.33.0's ``AsyncMPClient`` (see the module docstring);
    mixed in before the corewire client class."""

    # Provided by the corewire client class this is mixed into.
    core_engines: list[bytes]
    _engine_statuses: dict[int, dict[str, Any]]

    def _vllm_setup(self, args: VllmArgs) -> dict[str, Any]:
        #: Ready-response facts vLLM's client keeps (notes §5.1).
        self.effective_attention_block_sizes: set[int | None] = set()
        self.kv_event_sources: dict[int, Any] = {}
        self.coordinator_input_address: str | None = None
        self.coordinator_output_address: str | None = None
        parallel_config = args.vllm_config.parallel_config
        self._fault_tolerance = bool(getattr(parallel_config, "enable_fault_tolerance", False))
        return super()._vllm_setup(args)

    def _vllm_finish_setup(self) -> None:
        super()._vllm_finish_setup()
        if self._fault_tolerance:
            # vLLM's client starts from "healthy" for every engine it drives.
            for rank in self.engine_indices:
                self._engine_statuses.setdefault(rank, {"id": rank, "status": "healthy"})

    # -- utility fan-out ---------------------------------------------------------------

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every engine this client drives; their results in
        engine order."""
        return list(
            await asyncio.gather(
                *(self._call_utility_async(method, *args, engine=e) for e in self.core_engines)
            )
        )

    async def call_utility_consensus_async(self, method: str, *args: Any) -> Any:
        """Like :meth:`call_utility_all_async`, but one result, which every engine must
        have returned (:class:`corewire.client.dp.DPConsensusError`, a ``RuntimeError``,
        otherwise)."""
        results = await self.call_utility_all_async(method, *args)
        if any(r != results[0] for r in results[1:]):
            raise DPConsensusError(method, results)
        return results[0]

    # -- the calls whose semantics changed ---------------------------------------------

    async def reset_prefix_cache_async(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Drop every engine's prefix cache; whether all of them were reset."""
        results = await self.call_utility_all_async(
            "reset_prefix_cache", reset_running_requests, reset_connector
        )
        return all(results)

    async def wake_up_async(self, tags: list[str] | None = None) -> bool:
        """Wake every engine; whether all of them are fully awake."""
        return all(await self.call_utility_all_async("wake_up", tags))

    async def is_sleeping_async(self) -> bool:
        """Whether the engines sleep (they must agree)."""
        return bool(await self.call_utility_consensus_async("is_sleeping"))

    async def is_scheduler_paused_async(self) -> bool:
        """Whether the engines' schedulers are paused (they must agree)."""
        return bool(await self.call_utility_consensus_async("is_scheduler_paused"))

    async def profile_async(
        self,
        is_start: bool = True,
        profile_prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
        profiler_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Start or stop the engine's profiler (vLLM 0.33.0's five arguments)."""
        await self.call_utility_async(
            "profile", is_start, profile_prefix, delay_iterations, max_iterations, profiler_kwargs
        )

    # -- new calls -----------------------------------------------------------------------

    async def pause_generation_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation: the scheduler stops, and in "abort" / "wait" mode the engine
        refuses new requests (retryable) until :meth:`resume_scheduler_async`."""
        await self.call_utility_async("pause_generation", mode, clear_cache)

    async def release_kv_cache_memory_async(self) -> None:
        """Free the engine's KV-cache memory."""
        await self.call_utility_async("release_kv_cache_memory")

    async def set_weight_version_async(self, weight_version: str) -> None:
        """Label the engine's weights (stamped on its later outputs)."""
        await self.call_utility_async("set_weight_version", weight_version)

    async def get_weight_version_async(self) -> str:
        """The engines' weight label (they must agree)."""
        return str(await self.call_utility_consensus_async("get_weight_version"))

    async def compute_weight_checksums_async(self) -> list[dict[str, str]]:
        """Every worker's weight checksums, over all engines."""
        per_engine = await self.call_utility_all_async("compute_weight_checksums")
        return [worker for workers in per_engine for worker in workers]

    def get_kv_event_sources(self) -> dict[int, Any]:
        """Each engine's KV-event publisher config (from its ready response), by DP rank."""
        return dict(self.kv_event_sources)

    async def handle_fault(self, fault_tolerance_request: Any) -> Any:
        """Send a fault-tolerance instruction to the engine; vLLM's
        ``FaultToleranceResult``. A refusal is noted in the first engine's status."""
        from vllm.v1.fault_tolerance.utils import FaultToleranceResult

        reply = await self.call_utility_async(FT_UTILITY_METHOD, fault_tolerance_request)
        result = msgspec.convert(reply, FaultToleranceResult)
        if not result.success:
            status = self._engine_statuses.get(self.engine_indices[0])
            if status is not None:
                status["last_ft_request_id"] = result.request_id
                status["ft_error"] = result.reason
        return result

    async def get_status(self) -> dict[str, Any]:
        """The engines' fault-tolerance status, as vLLM's client reports it."""
        return {
            "schema_version": _STATUS_SCHEMA_VERSION,
            "total_engines": len(self.engine_indices),
            "engines": list(self._engine_statuses.values()),
        }

    # -- elastic EP: not supported -----------------------------------------------------

    async def prepare_elastic_ep(self, new_data_parallel_size: int) -> None:
        """Not supported by corewire's client: raises ``NotImplementedError``."""
        raise NotImplementedError(
            f"corewire's client inside vLLM {self.release.name} does not support elastic EP "
            f"scaling (to {new_data_parallel_size}); unset COREWIRE_VLLM_CLIENT to use vLLM's"
        )

    async def commit_elastic_ep(self) -> None:
        """Not supported by corewire's client: raises ``NotImplementedError``."""
        raise NotImplementedError(
            f"corewire's client inside vLLM {self.release.name} does not support elastic EP scaling"
        )

    async def abort_external_elastic_ep(self, error: str) -> None:
        """Not supported by corewire's client: raises ``NotImplementedError``."""
        raise NotImplementedError(
            f"corewire's client inside vLLM {self.release.name} does not support elastic EP scaling"
        )

    async def get_external_elastic_ep_status(self) -> dict[str, Any] | None:
        """No external elastic EP scaling runs here: None, as vLLM's base client."""
        return None
