"""The :class:`Engine` interface: what a user implements to run inside an engine process.

Wire format: docs/protocol.md §5.8 (a minimal engine, step by step) and §9.3 (errors an
engine reports).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from corewire.protocol import EngineCoreOutput, EngineCoreRequest

__all__ = ["INTERFACE_METHODS", "NO_MODEL_LEN_LIMIT", "Engine", "EngineInfo", "prefill_stats"]

#: ``max_model_len`` of an engine that sets no limit of its own: a front-end that takes
#: the smaller of its own limit and the engine's (vLLM does) keeps its own.
NO_MODEL_LEN_LIMIT = (1 << 31) - 1


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What an engine reports about itself in its ready response (see
    :meth:`Engine.engine_info`).

    The engine process adds what it knows itself (the DP group size, the DP stats
    address, the protocol version) and sends the map once on each request link.
    vLLM's front-end takes the smaller of its own ``max_model_len`` and this one, and
    copies ``block_size``, ``num_gpu_blocks`` and the KV-cache figures into its cache
    config (its metrics and logs show them).
    """

    #: Longest sequence (prompt + output) the engine accepts.
    max_model_len: int = NO_MODEL_LEN_LIMIT
    #: Model dtype, without the ``torch.`` prefix (``"float32"``, ``"bfloat16"`` ...).
    dtype: str = "float32"
    #: KV-cache blocks; 0 for an engine without a paged KV cache.
    num_gpu_blocks: int = 0
    #: Tokens per KV-cache block (an engine without a KV cache keeps vLLM's usual 16).
    block_size: int = 16
    #: Workers (devices) behind this engine.
    world_size: int = 1
    #: KV-cache capacity in tokens; None for an engine without a KV cache.
    kv_cache_size_tokens: int | None = None
    #: How many requests of ``max_model_len`` tokens fit in the KV cache at once; None
    #: for an engine without a KV cache.
    kv_cache_max_concurrency: float | None = None
    #: Most requests one step runs (vLLM's ``max_num_seqs``; vLLM 0.33.0's ready
    #: response); None: no limit of the engine's own.
    max_num_seqs: int | None = None
    #: Most tokens one step computes (vLLM's ``max_num_batched_tokens``; 0.33.0's ready
    #: response); None: ``max_model_len``.
    max_num_batched_tokens: int | None = None
    #: LoRA adapters the engine holds at once (reported only by an engine that
    #: implements ``add_lora``).
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_model_len", "num_gpu_blocks", "block_size", "world_size"):
            value = getattr(self, name)
            least = 0 if name == "num_gpu_blocks" else 1
            if type(value) is not int or value < least:
                raise ValueError(f"EngineInfo.{name} must be an int >= {least}, got {value!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"EngineInfo.{name} must be None or an int >= 1, got {value!r}")
        if type(self.max_loras) is not int or self.max_loras < 0:
            raise ValueError(f"EngineInfo.max_loras must be an int >= 0, got {self.max_loras!r}")
        tokens, concurrency = self.kv_cache_size_tokens, self.kv_cache_max_concurrency
        if tokens is not None and (type(tokens) is not int or tokens < 0):
            raise ValueError(
                f"EngineInfo.kv_cache_size_tokens must be None or an int >= 0, got {tokens!r}"
            )
        if concurrency is not None and (
            type(concurrency) not in (int, float) or not concurrency >= 0
        ):
            raise ValueError(
                f"EngineInfo.kv_cache_max_concurrency must be None or a number >= 0, "
                f"got {concurrency!r}"
            )
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"EngineInfo.dtype must be a dtype name, got {self.dtype!r}")
        if self.dtype.startswith("torch."):
            object.__setattr__(self, "dtype", self.dtype.removeprefix("torch."))


class Engine(abc.ABC):
    """An inference engine driven by :class:`corewire.engine.EngineCoreProc`.

    Every method runs on the engine process's busy-loop thread, one at a time, so an
    implementation needs no locking of its own. The loop calls :meth:`step` whenever
    :meth:`has_unfinished_requests` is true and blocks on input otherwise.

    Utility calls: any other public method (a name without a leading underscore) can be
    called by a front-end with positional arguments (``call_utility("echo", 1)``). Its
    return value must be plain msgpack data (None, bool, int, float, str, bytes, lists,
    dicts). A method may return a :class:`concurrent.futures.Future`; the reply is sent
    when the future completes (from whatever thread completes it). An exception becomes
    the failure text ``Call to <method> method failed: <error>`` and the engine lives on.
    The utilities vLLM's front-end calls (``get_supported_tasks``, ``sleep(level, mode)``,
    ``profile(is_start, profile_prefix)``, LoRA ...) take vLLM's argument lists; those an
    engine does not define are answered by
    :class:`~corewire.engine.utilities.UtilityDefaults` (no-ops, "no", or a clear
    "not supported" failure). Behind a vLLM 0.33.0 front-end (``release="0.33.0"``)
    the engine core answers that version's new calls itself and hands the engine its
    part (:mod:`corewire.engine.utilities_0_33_0`): ``pause_generation`` calls
    ``pause_scheduler``, ``profile`` passes 0.33.0's five arguments only to a method
    that takes them, ``wake_up`` may return None (then ``is_sleeping()`` tells), and
    ``compute_weight_checksums()`` returns one ``{parameter name: sha256 hex}`` map per
    worker.

    Ready response: :meth:`engine_info` reports the model's limits (``max_model_len``,
    dtype, KV cache) that front-ends apply to their own configuration.

    An exception raised by :meth:`step` (or by the other interface methods that the loop
    cannot attribute to one request) is fatal: the process sends ``ENGINE_CORE_DEAD`` and
    exits with a non-zero status.
    """

    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a new request.

        Raise ``ValueError`` for a request that cannot run (bad token ids, bad sampling
        parameters): the process then finishes that request alone with
        ``FinishReason.ERROR`` and the engine keeps serving the others. The error's text
        is the client's reason (``stop_reason``: its first line, file paths replaced by
        ``<path>``, at most 200 characters), so word it for the caller; any other
        exception sends only "internal engine error" (details stay in the engine log).

        The process has already refused prompts longer than :meth:`engine_info`'s
        ``max_model_len``, and never passes a request whose id is still in flight
        (unless that request was sent ``resumable``: vLLM's streaming input, whose later
        chunks reuse the id; an engine without streaming input should refuse
        ``resumable`` requests).
        """

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop these requests; ids the engine does not hold are ignored."""

    @abc.abstractmethod
    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduling step and return the outputs it produced (may be empty)."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether :meth:`step` can make progress now.

        Return False while the engine is paused or asleep even if requests are queued,
        so that the busy loop waits for input instead of spinning.
        """

    def engine_info(self) -> EngineInfo:
        """Facts about the model for the ready response: ``max_model_len``, ``dtype``,
        KV-cache size ... (see :class:`EngineInfo`). Called once, after the constructor
        and before the first request. The default claims no length limit and no KV
        cache; an engine with real limits should report them."""
        return EngineInfo()

    def scheduler_stats(self) -> dict[str, Any] | None:
        """Counters sent with every batch of outputs (``num_running_reqs``,
        ``num_waiting_reqs``, ...), or None to send none."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional hook, empty on purpose
        """Release resources; called once when the process stops."""


#: Interface methods that are never callable as utility methods: calling them outside
#: the busy loop's own order would lose outputs or tear the engine down under it.
INTERFACE_METHODS = frozenset(
    {
        "add_request",
        "abort_requests",
        "step",
        "has_unfinished_requests",
        "scheduler_stats",
        "engine_info",
        "shutdown",
    }
)


def prefill_stats(num_prompt_tokens: int, num_cached_tokens: int = 0) -> dict[str, int]:
    """vLLM's ``PrefillStats`` for a request's first output (``prefill_stats``), where a
    vLLM front-end counts the request's prompt tokens for its metrics: the prompt, and
    how much of it came from a local cache instead of being computed."""
    return {
        "num_prompt_tokens": num_prompt_tokens,
        "num_computed_tokens": num_prompt_tokens - num_cached_tokens,
        "num_cached_tokens": num_cached_tokens,
        "num_local_cached_tokens": num_cached_tokens,
        "num_external_cached_tokens": 0,
    }
