"""The utility calls a vLLM 0.34.0 front-end makes that 0.33.0's did not, or makes differently.

On top of :class:`~corewire.engine.utilities_0_33_0.Utilities0330`:

- ``sleep(level, mode, reset_connector)`` and ``release_kv_cache_memory(reset_connector)``
  take a third, resp. first, argument: whether clearing caches also resets the KV
  connector's. corewire engines have no KV connector, so there is nothing more to reset;
  the flag is type-checked and the engine's own method is called as before.
- The process-checkpoint lifecycle (``checkpoint_prepare(mode)``, ``checkpoint_restore()``,
  ``checkpoint_state()``): corewire engines do not take process checkpoints. As vLLM's
  engine does for an engine that cannot prepare (one without sleep mode), the refusal
  is the reply of ``checkpoint_prepare``, with nothing changed; the state stays
  ``"running"`` with no error, and ``checkpoint_restore`` of a running engine is the
  no-op vLLM's is. ``sleep`` and ``wake_up`` need no checkpoint guard, as the state never
  leaves ``"running"``.
- ``is_inference_ready()``: whether the engine takes and runs new requests (not asleep,
  not paused). vLLM's own Rust front-end (``vllm-rs``) calls it once its engines are
  ready and stops ("failed to connect to engine core") unless it is answered.
"""

from __future__ import annotations

from typing import Any

from corewire.engine.utilities_0_33_0 import Utilities0330, utility_names

__all__ = ["CHECKPOINT_REFUSAL", "UTILITIES_0_34_0", "Utilities0340"]

#: ``checkpoint_prepare``'s reply: why a corewire engine does not prepare.
CHECKPOINT_REFUSAL = "corewire engines do not take process checkpoints"
#: ``checkpoint_state``'s state string (vLLM 0.34.0's ``CheckpointState.RUNNING``).
_RUNNING = "running"
_PAUSE_MODES = ("abort", "wait", "keep")


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


class Utilities0340(Utilities0330):
    """The 0.34.0 utilities of one engine core (see the module docstring)."""

    def sleep(self, level: int = 1, mode: str = "abort", reset_connector: bool = True) -> Any:
        """The engine's own ``sleep(level, mode)``; ``reset_connector`` has no connector
        to reset here."""
        _check_flag("reset_connector", reset_connector)
        return self._engine("sleep")(level, mode)

    def release_kv_cache_memory(self, reset_connector: bool = True) -> Any:
        """Release the KV cache's memory: only after a completed pause (0.33.0's rule;
        the engine's own method checks whatever else it keeps, such as being asleep)."""
        _check_flag("reset_connector", reset_connector)
        return super().release_kv_cache_memory()

    def is_inference_ready(self) -> bool:
        """Whether new requests would run now: the engine is neither asleep nor paused
        (vLLM's engines also wait out an incomplete weight update; corewire engines take
        no weight updates)."""
        if self.refuse_new_requests:
            return False
        return not (self._engine("is_sleeping")() or self._engine("is_scheduler_paused")())

    def checkpoint_prepare(self, mode: str = "wait") -> str | None:
        """Refuse, with nothing changed: the reason (see the module docstring)."""
        if mode not in _PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {_PAUSE_MODES}, got {mode!r}")
        return CHECKPOINT_REFUSAL

    def checkpoint_restore(self) -> None:
        """Nothing to restore: the engine is running (vLLM's no-op)."""

    def checkpoint_state(self) -> tuple[str, str | None]:
        """``("running", None)``: no checkpoint is ever prepared."""
        return _RUNNING, None


#: The utility names :class:`Utilities0340` answers.
UTILITIES_0_34_0 = utility_names(Utilities0340)
