"""corewire's clients for vLLM 0.34.0's ``AsyncLLM``: what its front-end calls beyond
0.33.0's (:mod:`corewire.vllm.adapters.v0_33_0`).

- ``sleep_async(level, mode, reset_connector)`` and
  ``release_kv_cache_memory_async(reset_connector)`` pass the new flag on.
- The process-checkpoint calls: ``checkpoint_prepare_async(mode)`` (the engine's refusal,
  or None), ``checkpoint_restore_async()`` and ``checkpoint_state_async()``, which asks
  every engine this client drives and reports one state as vLLM's load-balancing client
  does: failed if any failed (with the first failed engine's error), else the state all
  share, else the transition in progress.
- :attr:`~Members0340.engine_status` is the *managed engine's* status map (``AsyncLLM``
  refuses requests while it is not ``"healthy"``, with fault tolerance on), where 0.33.0
  read the map of every engine; :meth:`~Members0340.handle_fault` keeps a recovery's
  progress there (``ft_state``: ``"recovering"``, then ``"failed"`` on a refusal; an
  engine's next status push replaces the map) and refuses a second recovery while one is
  in flight.
- Requests go out with their prompts packed as vLLM 0.34.0's client packs them (the
  release's request writer: :mod:`corewire.wire.requests`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from corewire.vllm.adapters.v0_33_0 import FT_UTILITY_METHOD, Members0330

__all__ = [
    "Members0340",
]


class Members0340(Members0330):
    """The client members of vLLM 0.34.0's ``AsyncMPClient`` (see the module docstring);
    mixed in before the corewire client class."""

    @property
    def engine_status(self) -> dict[str, Any]:  # type: ignore[override]
        """The fault-tolerance status map of the engine this client manages (its first),
        ``{}`` before it sent one."""
        return self._engine_statuses.get(self.engine_indices[0], {})

    async def sleep_async(
        self, level: int = 1, mode: str = "abort", reset_connector: bool = True
    ) -> None:
        """Put the engine to sleep; ``reset_connector``: also reset its KV connector's
        cache."""
        await self.call_utility_async("sleep", level, mode, reset_connector)

    async def release_kv_cache_memory_async(self, reset_connector: bool = True) -> None:
        """Free the engine's KV-cache memory (after a completed pause)."""
        await self.call_utility_async("release_kv_cache_memory", reset_connector)

    async def checkpoint_prepare_async(self, mode: str) -> str | None:
        """Ask the engine to prepare for a process checkpoint (draining with ``mode``);
        why it cannot, or None."""
        return await self.call_utility_async("checkpoint_prepare", mode)

    async def checkpoint_restore_async(self) -> None:
        """Bring the engine back from a prepared checkpoint."""
        await self.call_utility_async("checkpoint_restore")

    async def checkpoint_state_async(self) -> tuple[Any, str | None]:
        """The engines' checkpoint state as one vLLM ``CheckpointState`` and an error."""
        from vllm.v1.engine import CheckpointState

        states: dict[Any, str | None] = {}
        for state, error in await self.call_utility_all_async("checkpoint_state"):
            states.setdefault(CheckpointState(state), error)
        if CheckpointState.FAILED in states:
            return CheckpointState.FAILED, states[CheckpointState.FAILED]
        if len(states) == 1:
            return next(iter(states)), None
        if CheckpointState.PREPARING in states:
            return CheckpointState.PREPARING, None
        return CheckpointState.RESTORING, None

    async def handle_fault(self, fault_tolerance_request: Any) -> Any:
        """Send a fault-tolerance instruction to the managed engine; vLLM's
        ``FaultToleranceResult`` (a failed call is a failed result, not an exception)."""
        from vllm.v1.fault_tolerance.utils import FaultToleranceResult

        rank = self.engine_indices[0]
        status = self._engine_statuses.setdefault(rank, {"id": rank, "status": "healthy"})
        if status.get("ft_state") == "recovering":
            return FaultToleranceResult(
                request_id=fault_tolerance_request.request_id,
                success=False,
                reason="another recovery is in progress",
            )
        status["ft_state"] = "recovering"
        status["last_ft_request_id"] = fault_tolerance_request.request_id
        status.pop("ft_error", None)
        try:
            reply = await self.call_utility_async(FT_UTILITY_METHOD, fault_tolerance_request)
            result = msgspec.convert(reply, FaultToleranceResult)
        except Exception as exc:  # the caller gets a result either way, as from vLLM's
            result = FaultToleranceResult(fault_tolerance_request.request_id, False, str(exc))
        if not result.success:
            # A status push may have replaced the map meanwhile: record in the current one.
            status = self._engine_statuses.setdefault(rank, {"id": rank})
            status["ft_state"] = "failed"
            status["last_ft_request_id"] = result.request_id
            status["ft_error"] = result.reason
        return result
