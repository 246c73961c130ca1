"""The ready response per vLLM version (``corewire.engine.ready_layouts``).

0.25.1's is exactly what ``corewire.engine.ready.ready_response`` writes today; 0.33.0's
has vLLM 0.33.0's 28 keys in its order, byte for byte what vLLM 0.33.0's engine writes
(``tests/data/vllm-0.33.0/ready_response.bin``, by ``make_golden_requests.py``), then
corewire's own keys. That vLLM 0.33.0's front-end accepts it is checked against vLLM
itself in ``test_vllm_0_33_0_live.py``.
"""

from __future__ import annotations

import os

import msgspec
import pytest

from corewire.engine import EngineInfo
from corewire.engine.ready import ready_response
from corewire.engine.ready_layouts import (
    READY_RESPONSE_TYPES,
    ReadyFacts,
    ReadyResponse0251,
    ReadyResponse0330,
    ready_response_for,
)
from golden_0_33_0_support import DATA

OWN_KEYS = ("status", "engine_index", "pid")


def _vllm_part(ready: dict) -> dict:
    return {k: v for k, v in ready.items() if k not in OWN_KEYS}


def _required(cls: type) -> int:
    return sum(f.required for f in msgspec.structs.fields(cls))


def test_the_declared_types_count_vllms_keys() -> None:
    assert len(ReadyResponse0251.__struct_fields__) == 10 and _required(ReadyResponse0251) == 8
    assert len(ReadyResponse0330.__struct_fields__) == 28 and _required(ReadyResponse0330) == 17
    assert set(READY_RESPONSE_TYPES) == {"0.25.1", "0.33.0"}


@pytest.mark.parametrize("release", [None, "0.25.1"])
def test_0_25_1_is_todays_ready_response(release: str | None) -> None:
    info = EngineInfo(max_model_len=4096, num_gpu_blocks=10, kv_cache_size_tokens=160)
    got = ready_response_for(release, info, engine_index=1, data_parallel_size=2)
    assert got == ready_response(info, engine_index=1, data_parallel_size=2)
    assert tuple(_vllm_part(got)) == ReadyResponse0251.__struct_fields__
    msgspec.convert(got, ReadyResponse0251)


def test_0_33_0_is_vllm_0_33_0s_bytes() -> None:
    ready = ready_response_for(
        "0.33.0",
        EngineInfo(max_model_len=2048),
        engine_index=0,
        facts=ReadyFacts(instance_id="golden"),
    )
    golden = (DATA / "ready_response.bin").read_bytes()
    assert msgspec.msgpack.encode(_vllm_part(ready)) == golden
    assert tuple(ready)[-3:] == OWN_KEYS
    assert (ready["status"], ready["engine_index"], ready["pid"]) == ("READY", 0, os.getpid())


def test_0_33_0_carries_the_engines_facts() -> None:
    info = EngineInfo(
        max_model_len=512,
        dtype="bfloat16",
        num_gpu_blocks=64,
        block_size=8,
        world_size=2,
        kv_cache_size_tokens=512,
        kv_cache_max_concurrency=1.0,
    )
    facts = ReadyFacts(
        tensor_parallel_size=2, max_num_seqs=8, max_num_batched_tokens=128, supports_lora=True
    )
    ready = ready_response_for(
        "0.33.0",
        info,
        engine_index=3,
        data_parallel_size=4,
        dp_stats_address="tcp://127.0.0.1:5555",
        facts=facts,
    )
    typed = msgspec.convert(ready, ReadyResponse0330)
    assert (typed.max_model_len, typed.dtype, typed.num_gpu_blocks) == (512, "bfloat16", 64)
    assert (typed.block_size, typed.world_size, typed.data_parallel_size) == (8, 2, 4)
    assert typed.data_parallel_rank == 3
    assert typed.dp_stats_address == "tcp://127.0.0.1:5555"
    assert (typed.tensor_parallel_size, typed.max_num_seqs) == (2, 8)
    assert (typed.max_num_batched_tokens, typed.supports_lora) == (128, True)
    assert (typed.kv_cache_size_tokens, typed.kv_cache_max_concurrency) == (512, 1.0)
    assert typed.vllm_version == "0.33.0"
    # max_num_batched_tokens unset: the engine's max_model_len
    default = ready_response_for("0.33.0", info, engine_index=0)
    assert default["max_num_batched_tokens"] == 512
    assert default["instance_id"]


def test_a_0_25_1_ready_response_is_refused_by_the_0_33_0_type() -> None:
    old = ready_response(EngineInfo(), engine_index=0)
    with pytest.raises(msgspec.ValidationError, match="tensor_parallel_size"):
        msgspec.convert(old, ReadyResponse0330)
    # and 0.25.1's front-end takes 0.33.0's (unknown keys are ignored)
    new = ready_response_for("0.33.0", EngineInfo(), engine_index=0)
    msgspec.convert(new, ReadyResponse0251)


def test_an_unknown_version_is_refused() -> None:
    with pytest.raises(ValueError, match=r"0\.25\.2"):
        ready_response_for("0.25.2", EngineInfo(), engine_index=0)
