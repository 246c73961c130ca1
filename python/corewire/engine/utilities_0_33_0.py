"""The utility calls a vLLM 0.33.0 front-end makes that 0.25.1's did not, or makes differently.

An engine core speaking 0.33.0 answers these itself (they touch its own state: the weight
version it stamps, whether it refuses new requests) and hands the engine's part to the
engine's own methods (or :class:`~corewire.engine.utilities.UtilityDefaults`):

- ``pause_generation(mode, clear_cache)``: ``pause_scheduler(mode, clear_cache)``, and in
  ``"abort"`` / ``"wait"`` mode every later ADD is refused (finish ERROR with
  ``RequestError("engine_paused", ..., retryable=True)``, which vLLM's front-end answers
  with 503) until ``resume_scheduler`` or a full ``wake_up``. ``"keep"`` refuses nothing
  (new requests queue, as with ``pause_scheduler``).
- ``resume_scheduler()``: lifts that refusal, then resumes the engine.
- ``wake_up(tags)`` returns whether the engine is fully awake: the engine's own bool, or
  (an engine whose ``wake_up`` returns None) ``not is_sleeping()`` afterwards.
- ``profile(is_start, profile_prefix, delay_iterations, max_iterations,
  profiler_kwargs)``: five arguments; an engine whose ``profile`` takes vLLM 0.25.1's two
  gets those, and the three new ones must then be unset (a clear failure otherwise).
- ``set_weight_version(version)`` / ``get_weight_version()``: the string every step's
  messages carry (``"default"`` until set).
- ``release_kv_cache_memory()``: as vLLM, only while paused; then the engine's own
  method, or nothing for an engine without a KV cache.
- ``compute_weight_checksums()``: the engine's per-worker ``{parameter name: sha256 hex
  of its bytes}``, keyed as vLLM's workers key theirs
  (``"dp{engine index}:pp0:pcp0:tp{worker}:{name}"``): a list, one map per worker.

Wire format: docs/vllm-0.33.0-notes.md §6.3.
"""

from __future__ import annotations

import inspect
from typing import Any

from corewire.wire.layouts import RequestError

__all__ = ["PAUSED_ERROR", "UTILITIES_0_33_0", "Utilities0330", "utility_names"]

#: What an ADD gets while generation is paused in ``"abort"`` or ``"wait"`` mode (vLLM
#: 0.33.0's words).
PAUSED_ERROR = RequestError(
    "engine_paused", "Generation is paused. Please retry after it resumes.", retryable=True
)
_PAUSE_MODES = ("abort", "wait", "keep")


class Utilities0330:
    """The 0.33.0 utilities of one engine core (see the module docstring)."""

    def __init__(self, proc: Any) -> None:
        # proc: the EngineCoreProc whose state these answer from (not imported: it
        # imports this module).
        self._proc = proc
        #: Whether new ADDs are refused with :data:`PAUSED_ERROR`.
        self.refuse_new_requests = False

    def _engine(self, method: str) -> Any:
        return self._proc._engine_utility(method)

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> Any:
        """Pause the scheduler; in ``"abort"`` / ``"wait"`` mode also refuse new
        requests until resumed. Returns what ``pause_scheduler`` returns (a future the
        reply waits for, in ``"wait"`` mode)."""
        if mode not in _PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {_PAUSE_MODES}, got {mode!r}")
        result = self._engine("pause_scheduler")(mode, clear_cache)
        self.refuse_new_requests = mode != "keep"
        return result

    def resume_scheduler(self) -> Any:
        """Take new requests again, then resume the engine's scheduler."""
        self.refuse_new_requests = False
        return self._engine("resume_scheduler")()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake the engine; True once it is fully awake (then it also takes new
        requests again, as a resumed scheduler does)."""
        result = self._engine("wake_up")(tags)
        # An engine written for 0.25.1 returns None: then its sleep state tells.
        awake = result if isinstance(result, bool) else not self._engine("is_sleeping")()
        if awake:
            self.refuse_new_requests = False
        return awake

    def profile(
        self,
        is_start: bool = True,
        profile_prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
        profiler_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Start or stop the engine's profiler, with vLLM 0.33.0's five arguments."""
        fn = self._engine("profile")
        extra = (delay_iterations, max_iterations, profiler_kwargs)
        if _takes_positional(fn, 5):
            return fn(is_start, profile_prefix, *extra)
        unsupported = [
            name
            for name, value in zip(
                ("delay_iterations", "max_iterations", "profiler_kwargs"), extra, strict=True
            )
            if value is not None
        ]
        if unsupported:
            engine = type(self._proc.engine).__name__
            raise ValueError(f"profile({', '.join(unsupported)}) is not supported by {engine}")
        return fn(is_start, profile_prefix)

    def set_weight_version(self, weight_version: str) -> None:
        """The weight version later steps' messages carry."""
        if not isinstance(weight_version, str):
            raise TypeError(f"weight_version must be a str, got {type(weight_version).__name__}")
        self._proc.weight_version = weight_version

    def get_weight_version(self) -> str:
        """The weight version steps' messages carry now."""
        return self._proc.weight_version

    def release_kv_cache_memory(self) -> Any:
        """Release the KV cache's memory; only after a completed pause."""
        # A client awaits the pause's reply first (a "wait" pause replies once drained);
        # an engine that keeps a KV cache checks its own state in its own method.
        paused = self._engine("is_scheduler_paused")()
        if not paused or self._proc.engine.has_unfinished_requests():
            # A "wait" pause that has not drained is not complete either (vLLM's check).
            raise RuntimeError("release_kv_cache_memory() requires a completed pause first")
        own = getattr(self._proc.engine, "release_kv_cache_memory", None)
        return own() if callable(own) else None

    def compute_weight_checksums(self) -> list[dict[str, str]]:
        """The engine's per-worker weight digests, keyed as vLLM's workers key them."""
        per_worker = self._engine("compute_weight_checksums")()
        if not isinstance(per_worker, list) or not all(isinstance(w, dict) for w in per_worker):
            raise TypeError("compute_weight_checksums() must return a list of dicts, one a worker")
        index = self._proc.engine_index
        return [
            {f"dp{index}:pp0:pcp0:tp{tp}:{name}": digest for name, digest in worker.items()}
            for tp, worker in enumerate(per_worker)
        ]


def _takes_positional(fn: Any, count: int) -> bool:
    """Whether ``fn`` can be called with ``count`` positional arguments."""
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): let the call itself tell
        return True
    return True


def utility_names(cls: type) -> frozenset[str]:
    """The utility names a protocol-utilities class answers: its public methods, those
    it inherits included."""
    return frozenset(n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n)))


#: The utility names :class:`Utilities0330` answers.
UTILITIES_0_33_0 = utility_names(Utilities0330)
