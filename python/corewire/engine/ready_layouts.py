"""The ready response of each vLLM version, as declared types (engine -> front-end, once).

An engine sends its ready response once on each request link when connected; vLLM's
front-end decodes it strictly into its ``EngineCoreReadyResponse`` (a missing required
key ends its start-up; unknown keys are ignored). The keys differ by version:

- 0.25.1: 10 keys, 8 required (:class:`ReadyResponse0251`); what
  ``corewire.engine.ready.ready_response`` writes today.
- 0.33.0: 28 keys, 17 required (:class:`ReadyResponse0330`); a 0.25.1-style map is
  refused (``Object missing required field tensor_parallel_size``).

:func:`ready_response_for` builds the map for a version from an engine's
:class:`~corewire.engine.EngineInfo` and the :class:`ReadyFacts` only 0.33.0 asks for,
followed (as today) by corewire's own keys ``status``, ``engine_index`` and ``pid``.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from corewire import releases
from corewire.engine.interface import EngineInfo
from corewire.engine.ready import ready_response

__all__ = [
    "READY_RESPONSE_TYPES",
    "ReadyFacts",
    "ReadyResponse0251",
    "ReadyResponse0330",
    "ready_response_for",
]


class ReadyResponse0251(msgspec.Struct):
    """vLLM 0.25.1's ``EngineCoreReadyResponse``: its keys in its order, 8 required."""

    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    dp_stats_address: str | None
    dtype: str
    vllm_version: str
    world_size: int
    data_parallel_size: int
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None


class ReadyResponse0330(msgspec.Struct):
    """vLLM 0.33.0's ``EngineCoreReadyResponse``: its 28 keys in its order, 17 required."""

    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    dp_stats_address: str | None
    dtype: str
    vllm_version: str
    world_size: int
    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    decode_context_parallel_size: int
    #: vLLM writes its engine index; the front-end keys KV event sources by it.
    data_parallel_rank: int
    max_num_seqs: int
    max_num_batched_tokens: int
    instance_id: str
    supports_lora: bool
    max_loras: int
    mamba_block_size: int | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    #: vLLM's ``KVEventsConfig`` (a map), or None without KV cache events.
    kv_events_config: dict[str, Any] | None = None
    weight_transfer_backend: str | None = None
    enable_sleep_mode: bool = False
    supports_draft_weight_updates: bool = False
    effective_attention_block_size: int | None = None
    coord_store_port: int = 0
    coordinator_input_address: str | None = None
    coordinator_output_address: str | None = None


#: Each version's declared ready response.
READY_RESPONSE_TYPES: dict[str, type[msgspec.Struct]] = {
    "0.25.1": ReadyResponse0251,
    "0.33.0": ReadyResponse0330,
}


#: This process's instance id: vLLM's engines keep one per process, so ready responses
#: written again (a re-handshake) name the same instance.
_PROCESS_INSTANCE_ID = f"corewire-{uuid.uuid4().hex[:12]}"


def _instance_id() -> str:
    return _PROCESS_INSTANCE_ID


@dataclass(frozen=True)
class ReadyFacts:
    """What 0.33.0's ready response asks of an engine beyond its ``EngineInfo``.

    The defaults describe corewire's engines: one device, no LoRA, no sleep mode.
    vLLM's front-end reads none of these but ``data_parallel_rank`` (filled from the
    engine index) and checks only that they are present and typed.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    #: Most requests an engine schedules at once (vLLM's ``max_num_seqs``).
    max_num_seqs: int = 256
    #: Most tokens per step; None: the engine's ``max_model_len``.
    max_num_batched_tokens: int | None = None
    #: Names this engine instance (vLLM: a random id per process); one per process here.
    instance_id: str = field(default_factory=_instance_id)
    supports_lora: bool = False
    max_loras: int = 0
    mamba_block_size: int | None = None
    kv_events_config: dict[str, Any] | None = None
    weight_transfer_backend: str | None = None
    enable_sleep_mode: bool = False
    supports_draft_weight_updates: bool = False
    effective_attention_block_size: int | None = None
    coord_store_port: int = 0
    coordinator_input_address: str | None = None
    coordinator_output_address: str | None = None


def ready_response_for(
    release: str | None,
    info: EngineInfo,
    *,
    engine_index: int,
    data_parallel_size: int = 1,
    dp_stats_address: str | None = None,
    facts: ReadyFacts | None = None,
) -> dict[str, Any]:
    """The ready map a ``release`` front-end accepts, for an engine described by ``info``.

    0.25.1 (and ``None``, the default version): exactly
    ``corewire.engine.ready.ready_response``. 0.33.0: :class:`ReadyResponse0330`'s 28
    keys in vLLM's order, from ``info`` and ``facts`` (:class:`ReadyFacts` defaults when
    None), then corewire's ``status``, ``engine_index`` and ``pid``. Any other recorded
    release: the keys of its own ``EngineCoreReadyResponse`` (its record), in its order,
    those 0.33.0 has from them and the rest at the release's defaults.
    """
    release = releases.get(release)
    if release.speaks_protocol_structs:
        return ready_response(
            info,
            engine_index=engine_index,
            data_parallel_size=data_parallel_size,
            dp_stats_address=dp_stats_address,
        )
    facts = ReadyFacts() if facts is None else facts
    batched = facts.max_num_batched_tokens
    response = ReadyResponse0330(
        max_model_len=info.max_model_len,
        num_gpu_blocks=info.num_gpu_blocks,
        block_size=info.block_size,
        dp_stats_address=dp_stats_address,
        dtype=info.dtype,
        vllm_version=release.name,
        world_size=info.world_size,
        data_parallel_size=data_parallel_size,
        tensor_parallel_size=facts.tensor_parallel_size,
        pipeline_parallel_size=facts.pipeline_parallel_size,
        decode_context_parallel_size=facts.decode_context_parallel_size,
        data_parallel_rank=engine_index,
        max_num_seqs=facts.max_num_seqs,
        max_num_batched_tokens=info.max_model_len if batched is None else batched,
        instance_id=facts.instance_id,
        supports_lora=facts.supports_lora,
        max_loras=facts.max_loras,
        mamba_block_size=facts.mamba_block_size,
        kv_cache_size_tokens=info.kv_cache_size_tokens,
        kv_cache_max_concurrency=info.kv_cache_max_concurrency,
        kv_events_config=facts.kv_events_config,
        weight_transfer_backend=facts.weight_transfer_backend,
        enable_sleep_mode=facts.enable_sleep_mode,
        supports_draft_weight_updates=facts.supports_draft_weight_updates,
        effective_attention_block_size=facts.effective_attention_block_size,
        coord_store_port=facts.coord_store_port,
        coordinator_input_address=facts.coordinator_input_address,
        coordinator_output_address=facts.coordinator_output_address,
    )
    out = _in_release_layout(msgspec.structs.asdict(response), release)
    # corewire's own: who is ready (vLLM's front-end ignores unknown keys).
    out.update(status="READY", engine_index=engine_index, pid=os.getpid())
    return out


def _in_release_layout(ready: dict[str, Any], release: Any) -> dict[str, Any]:
    """``ready`` (0.33.0's keys) with exactly ``release``'s ready keys in its order, from
    its record: a key ``ready`` lacks takes the release's default; one the release lacks
    is left out (0.33.0's own map is its record's keys already)."""
    from corewire.releases import records

    if release.name not in records.releases():
        return ready
    record = records.load(release.name)
    defaults = records.defaults_or_missing(record, "EngineCoreReadyResponse")
    out: dict[str, Any] = {}
    for key, default in defaults.items():
        if key in ready:
            out[key] = ready[key]
        elif default is records.MISSING:
            raise ValueError(f"vLLM {release.name}'s ready response needs {key!r}")
        else:
            out[key] = default
    return out
