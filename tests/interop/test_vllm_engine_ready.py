"""The ready response against the installed vLLM's own ``EngineCoreReadyResponse`` type
(0.25.1 in the main venv; engines speak the installed release by default).

Each engine sends it once on each request link; vLLM's front-end decodes it strictly
with its own type. These tests build the map the way the engine process does and decode
it with vLLM's class (no re-typed copy of it here).

Checks ``docs/protocol.md`` §3.1 (the ready response).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest

from corewire import releases
from corewire.engine import EngineCoreProc
from corewire.engine.core_utilities import RELEASE_UTILITIES
from corewire.engine.dp import DPEngineCoreProc
from corewire.engine.interface import NO_MODEL_LEN_LIMIT, EngineInfo
from corewire.engine.ready import engine_info_of
from corewire.engine.ready_layouts import ready_response_for
from corewire.engine.reference import ReferenceEngine
from corewire.engine.utilities import DEFAULT_UTILITIES, UnsupportedUtility, UtilityDefaults
from corewire.engine.utilities_0_33_0 import utility_names
from vllm_support import offline_environment

offline_environment()
pytest.importorskip("vllm")

import vllm  # noqa: E402
from vllm.v1.engine import EngineCoreReadyResponse  # noqa: E402


class _KVEngine(ReferenceEngine):
    """A reference engine that claims a paged KV cache, to see every figure travel."""

    def engine_info(self) -> EngineInfo:
        return EngineInfo(
            max_model_len=300,
            dtype="torch.bfloat16",
            num_gpu_blocks=100,
            block_size=32,
            world_size=2,
            kv_cache_size_tokens=3200,
            kv_cache_max_concurrency=10.67,
        )


class _DuckEngine:
    """The Engine interface by duck typing, without engine_info()."""

    def add_request(self, request: Any) -> None:
        pass

    def abort_requests(self, request_ids: list[str]) -> None:
        pass

    def step(self) -> list[Any]:
        return []

    def has_unfinished_requests(self) -> bool:
        return False


#: The ready response's keys in vLLM 0.25.1.
_KEYS_0_25_1 = (
    "max_model_len",
    "num_gpu_blocks",
    "block_size",
    "dp_stats_address",
    "dtype",
    "vllm_version",
    "world_size",
    "data_parallel_size",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
)


def _decoded(message: dict[str, Any]) -> Any:
    # Exactly what vLLM's client does with the bytes (strict msgspec decode).
    return msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=EngineCoreReadyResponse)


def test_engines_speak_the_installed_vllm_by_default() -> None:
    assert vllm.__version__.split("+")[0] == releases.DEFAULT


def test_reference_engine_ready_map_decodes_as_vllms_type(tmp_path: Any) -> None:
    proc = EngineCoreProc(
        ReferenceEngine(device="cpu", max_model_len=777, dtype="float32"),
        input_address=f"ipc://{tmp_path}/in",
        output_address=f"ipc://{tmp_path}/out",
        engine_index=5,
    )
    proc._ctx.term()  # never started: only its ready map is needed
    message = proc._ready_message()
    fields = [f.name for f in dataclasses.fields(EngineCoreReadyResponse)]
    assert list(message)[: len(fields)] == fields  # every key, in vLLM's order
    assert set(message) - set(fields) == {"status", "engine_index", "pid"}
    response = _decoded(message)
    # 0.25.1's keys, as every release has them (later releases add theirs: their
    # records, and test_ready_layouts.py).
    assert {key: getattr(response, key) for key in _KEYS_0_25_1} == {
        "max_model_len": 777,
        "num_gpu_blocks": 0,
        "block_size": 16,
        "dp_stats_address": None,
        "dtype": "float32",
        "vllm_version": releases.DEFAULT.name,
        "world_size": 1,
        "data_parallel_size": 1,
        "kv_cache_size_tokens": None,
        "kv_cache_max_concurrency": None,
    }
    assert message["status"] == "READY" and message["engine_index"] == 5


def test_engine_info_figures_travel_and_dp_proc_reports_its_group(tmp_path: Any) -> None:
    proc = DPEngineCoreProc(
        _KVEngine(device="cpu"),
        input_address=f"ipc://{tmp_path}/in",
        output_address=f"ipc://{tmp_path}/out",
        engine_index=1,
        data_parallel_size=3,
        coordinator_addresses=[f"ipc://{tmp_path}/front", "ipc://s", "ipc://w"],
    )
    proc._ctx.term()  # never started: only its ready map is needed
    response = _decoded(proc._ready_message())
    assert (response.max_model_len, response.dtype, response.world_size) == (300, "bfloat16", 2)
    assert (response.num_gpu_blocks, response.block_size) == (100, 32)
    assert response.kv_cache_size_tokens == 3200
    assert response.kv_cache_max_concurrency == pytest.approx(10.67)
    assert response.data_parallel_size == 3
    assert response.dp_stats_address == f"ipc://{tmp_path}/front"


def test_duck_typed_engine_gets_the_defaults() -> None:
    info = engine_info_of(_DuckEngine())
    assert info == EngineInfo() and info.max_model_len == NO_MODEL_LEN_LIMIT
    response = _decoded(ready_response_for(releases.DEFAULT, info, engine_index=0))
    assert response.max_model_len == NO_MODEL_LEN_LIMIT and response.num_gpu_blocks == 0

    class _Wrong(_DuckEngine):
        def engine_info(self) -> Any:
            return {"max_model_len": 5}

    with pytest.raises(TypeError, match=r"_Wrong.engine_info\(\) must return an EngineInfo"):
        engine_info_of(_Wrong())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_model_len": 0}, "max_model_len must be an int >= 1"),
        ({"num_gpu_blocks": -1}, "num_gpu_blocks must be an int >= 0"),
        ({"block_size": 1.5}, "block_size must be an int >= 1"),
        ({"world_size": True}, "world_size must be an int >= 1"),
        ({"dtype": ""}, "dtype must be a dtype name"),
        ({"kv_cache_size_tokens": -1}, "kv_cache_size_tokens must be None or an int >= 0"),
        ({"kv_cache_max_concurrency": "2"}, "kv_cache_max_concurrency must be None or a number"),
        ({"kv_cache_max_concurrency": float("nan")}, "kv_cache_max_concurrency must be"),
    ],
)
def test_engine_info_is_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineInfo(**kwargs)


def test_utility_defaults_cover_what_vllms_client_calls() -> None:
    from vllm.v1.engine.core_client import AsyncMPClient

    # Every utility vLLM's AsyncMPClient has a wrapper for: an engine that lacks one
    # still answers it (a no-op, "no", or a clear failure).
    names = {
        name.removesuffix("_async")
        for name in vars(AsyncMPClient)
        if name.endswith("_async")
        and name
        not in {
            "get_output_async",
            "add_request_async",
            "abort_requests_async",
            "call_utility_async",
            "_call_utility_async",
            # 0.32.0 on: fan-out helpers over call_utility, not utilities.
            "call_utility_all_async",
            "call_utility_consensus_async",
        }
    }
    # ...or the release's own utilities do (weight versions from vLLM 0.27.0 on).
    answered = set(DEFAULT_UTILITIES)
    own = releases.DEFAULT.choose(RELEASE_UTILITIES)
    if own is not None:
        answered |= utility_names(own)
    assert names <= answered, names - answered
    defaults = UtilityDefaults(_DuckEngine())
    assert defaults.get_supported_tasks() == ["generate"]
    assert defaults.reset_prefix_cache(True, True) is True
    assert defaults.is_sleeping() is False and defaults.is_scheduler_paused() is False
    with pytest.raises(UnsupportedUtility, match="LoRA adapters are not supported by _DuckEngine"):
        defaults.add_lora(["name", 1, "/path"])
    with pytest.raises(UnsupportedUtility, match="sleep is not supported by _DuckEngine"):
        defaults.sleep(1, "abort")
