"""Answers to the utility calls vLLM's front-end makes, for engines that do not define them.

vLLM 0.25.1's ``AsyncLLM`` calls utilities on its engines at start-up
(``reset_mm_cache``, ``get_supported_tasks``) and on request (cache resets, sleep, pause,
profiling, LoRA ...). An :class:`~corewire.engine.Engine` implements the ones it can;
:class:`UtilityDefaults` answers the others: the cache resets and the dummy batch are
no-ops for an engine that has no such cache or lockstep peers, the queries say "no", and
whatever would need a feature the engine lacks (LoRA adapters, sleep, profiling ...)
fails with :class:`UnsupportedUtility`, whose text names the method and the engine.

Wire format: docs/protocol.md §4.6 (UTILITY) and §5.6 (its reply).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_UTILITIES", "UnsupportedUtility", "UtilityDefaults"]


class UnsupportedUtility(NotImplementedError):
    """A utility call the engine does not support (the caller gets its text)."""


class UtilityDefaults:
    """Fallback utility methods, consulted only when the engine has no method of that
    name. Each takes vLLM 0.25.1's argument list for the call."""

    def __init__(self, engine: Any) -> None:
        self._engine_name = type(engine).__name__

    def _unsupported(self, what: str) -> UnsupportedUtility:
        return UnsupportedUtility(f"{what} not supported by {self._engine_name}")

    # ------------------------------------------------------------ no-ops and queries

    def get_supported_tasks(self) -> list[str]:
        """Text generation only."""
        return ["generate"]

    def reset_mm_cache(self) -> None:
        """No multimodal cache: nothing to reset."""

    def reset_encoder_cache(self) -> None:
        """No encoder cache: nothing to reset."""

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """No prefix cache: the (empty) reset succeeds."""
        return True

    def execute_dummy_batch(self) -> None:
        """No lockstep peers that would wait on a collective: nothing to run."""

    def is_sleeping(self) -> bool:
        """An engine that cannot sleep is awake."""
        return False

    def is_scheduler_paused(self) -> bool:
        """An engine that cannot pause is running."""
        return False

    # ------------------------------------------------------------ unsupported features

    def add_lora(self, lora_request: Any) -> bool:
        """LoRA adapters need engine support."""
        raise self._unsupported("LoRA adapters are")

    def remove_lora(self, lora_id: int) -> bool:
        """LoRA adapters need engine support."""
        raise self._unsupported("LoRA adapters are")

    def list_loras(self) -> list[int]:
        """LoRA adapters need engine support."""
        raise self._unsupported("LoRA adapters are")

    def pin_lora(self, lora_id: int) -> bool:
        """LoRA adapters need engine support."""
        raise self._unsupported("LoRA adapters are")

    def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        """Saving weights needs engine support."""
        raise self._unsupported("save_sharded_state is")

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Sleep needs engine support."""
        raise self._unsupported("sleep is")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Sleep needs engine support."""
        raise self._unsupported("sleep is")

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pausing needs engine support."""
        raise self._unsupported("pause_scheduler is")

    def resume_scheduler(self) -> None:
        """Pausing needs engine support."""
        raise self._unsupported("pause_scheduler is")

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Profiling needs engine support."""
        raise self._unsupported("profiling is")

    def compute_weight_checksums(self) -> list[dict[str, str]]:
        """Weight checksums need engine support (a model with weights)."""
        raise self._unsupported("compute_weight_checksums is")

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: Any = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Worker calls need engine support."""
        raise self._unsupported("collective_rpc is")


#: Names :class:`UtilityDefaults` answers (everything public on it).
DEFAULT_UTILITIES = frozenset(n for n in vars(UtilityDefaults) if not n.startswith("_"))
