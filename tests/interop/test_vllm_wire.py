"""Wire parity with the real vLLM 0.25.1: corewire's frames against vLLM's, byte for byte.

Every message here is built twice from the same seeded random values: once from
``corewire.protocol`` and once from vLLM's own structs. corewire's ``Encoder`` must write
exactly the frames vLLM's real ``MsgpackEncoder`` writes, payload and aux frames alike.
Then both ways round: vLLM's ``MsgpackDecoder`` decodes corewire's frames into the values
corewire's decoders (``MsgspecDecoder`` and the Rust ``NativeDecoder``) see, and corewire's
decoders decode vLLM's frames into the values vLLM's decoder produces.

Where corewire holds a plain value for a vLLM object (scheduler and prefill stats are vLLM
dataclasses but corewire maps; a LoRA request or structured-output parameters are plain
lists and maps), the corewire value carries the dataclass's fields in field order: the
bytes still match, and decoded values are compared by meaning (a dataclass equals the map
of its fields). Skipped where vLLM is not installed.

Checks ``docs/protocol.md`` §4.2-§4.7 (every request payload), §5.2-§5.7 (every output
payload) and §6 (arrays and tensors) byte for byte.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random
import string
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.compilation.cuda_graph import CUDAGraphStat
from vllm.lora.request import LoRARequest
from vllm.pooling_params import LateInteractionParams
from vllm.pooling_params import PoolingParams as VPoolingParams
from vllm.sampling_params import (
    RepetitionDetectionParams,
    RequestOutputKind,
    StructuredOutputsParams,
)
from vllm.sampling_params import SamplingParams as VSamplingParams
from vllm.v1 import engine as v
from vllm.v1.metrics.perf import PerfStats
from vllm.v1.metrics.stats import (
    KVCacheEvictionEvent,
    PrefillStats,
    PrefixCacheStats,
    SchedulerStats,
)
from vllm.v1.outputs import LogprobsLists as VLogprobsLists
from vllm.v1.outputs import LogprobsTensors as VLogprobsTensors
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllm.v1.serial_utils import UtilityResult as VUtilityResult
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from codec_support import check_types, normalize
from corewire import protocol as p
from corewire.codec import INLINE_THRESHOLD, Encoder, MsgspecDecoder, NativeDecoder
from vllm_support import require_vllm_0_25_1

require_vllm_0_25_1()

Pair = tuple[Any, Any]  # (corewire value, vLLM value)

# vLLM's decoder shares read-only received buffers with torch, which warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")

# Seeded runs; each builds a batch of random messages.
SEEDS = range(6)
BATCH = 30


def _frames(frames: Sequence[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


def _both_encode(cw: Any, vl: Any) -> list[bytes]:
    """Encode with corewire's Encoder and with vLLM's; assert the frames are identical."""
    ours = _frames(Encoder().encode(cw))
    theirs = _frames(MsgpackEncoder().encode(vl))
    assert ours == theirs, (msgspec.msgpack.decode(ours[0]), msgspec.msgpack.decode(theirs[0]))
    return ours


# --------------------------------------------------------------------------- normalizing


def _norm(x: Any) -> Any:
    """Comparable plain form of a decoded value from either side.

    Map-like msgspec structs and dataclasses become maps of their wire names, array-like
    structs and named tuples become lists, enums their values; floats compare bit for bit
    (NaN equal to NaN), arrays and tensors by kind, dtype, shape and bytes.
    """
    if x is None or isinstance(x, str):
        return x
    if isinstance(x, bool):
        return ("bool", x)
    if isinstance(x, enum.Enum):
        return _norm(x.value)
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return ("float", "nan" if math.isnan(x) else x.hex())
    if isinstance(x, (bytes, bytearray, memoryview)):
        return ("bytes", bytes(x))
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, tuple(x.shape), np.ascontiguousarray(x).tobytes())
    if isinstance(x, torch.Tensor):
        raw = x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("tensor", str(x.dtype), tuple(x.shape), raw)
    if isinstance(x, msgspec.Struct):
        fields = msgspec.structs.fields(x)
        if x.__struct_config__.array_like:
            return [_norm(getattr(x, f.name)) for f in fields]
        return ("map", [(f.encode_name, _norm(getattr(x, f.name))) for f in fields])
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return ("map", [(f.name, _norm(getattr(x, f.name))) for f in dataclasses.fields(x)])
    if type(x).__name__ == "UtilityResult":
        return ("result", _norm(x.result))
    if isinstance(x, (list, tuple)):
        return [_norm(i) for i in x]
    if isinstance(x, dict):
        return ("map", [(_norm(k), _norm(i)) for k, i in x.items()])
    if isinstance(x, (set, frozenset)):
        return ("set", sorted((_norm(i) for i in x), key=repr))
    raise TypeError(f"unexpected decoded value {type(x).__name__}: {x!r:.80}")


def _norm_outputs(outs: Any) -> Any:
    """EngineCoreOutputs from any decoder (vLLM dataclass stats count as maps)."""
    return normalize(_StatsAsMaps(outs))


class _StatsAsMaps:
    """A view of a decoded EngineCoreOutputs whose stats dataclasses read as dicts.

    ``codec_support.normalize`` compares maps; vLLM decodes the two stats fields into
    dataclasses, whose meaning is the map of their fields in order.
    """

    def __init__(self, outs: Any) -> None:
        self._outs = outs
        self.outputs = [_OutputView(o) for o in outs.outputs]
        self.scheduler_stats = _as_map(outs.scheduler_stats)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._outs, name)


class _OutputView:
    def __init__(self, out: Any) -> None:
        self._out = out
        self.prefill_stats = _as_map(out.prefill_stats)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


def _as_map(x: Any) -> Any:
    """A dataclass as the dict of its fields (recursively, in field order)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _as_map(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {k: _as_map(i) for k, i in x.items()}
    if isinstance(x, (list, tuple)):
        return [_as_map(i) for i in x]
    return x


# --------------------------------------------------------------------------- random values


def _rid(rng: random.Random) -> str:
    alphabet = string.ascii_letters + string.digits + "-_üж請🚀"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))


def _float(rng: random.Random) -> float:
    return rng.choice([rng.uniform(-1e6, 1e6), rng.random(), -0.0, 1.5, 1e-300, 2.0**70])


def _plain(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-plain value (what utility results and free-form maps carry)."""
    kinds = ["int", "bigint", "neg", "float", "str", "none", "bool", "bytes"]
    if depth < 2:
        kinds += ["list", "dict", "tuple"]
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(0, 300)
    if kind == "bigint":
        return rng.choice([2**32, 2**63 - 1, 2**63, 2**64 - 1])
    if kind == "neg":
        return rng.choice([-1, -33, -(2**31), -(2**63)])
    if kind == "float":
        return _float(rng)
    if kind == "str":
        return _rid(rng)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "bytes":
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 5)))
    items = [_plain(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "tuple":
        return tuple(items)
    if kind == "list":
        return items
    return {_rid(rng): i for i in items}


def _maybe(rng: random.Random, make: Callable[[], Any], chance: float = 0.5) -> Any:
    return make() if rng.random() < chance else None


def _tensor(rng: random.Random, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    count = math.prod(shape)
    values = torch.tensor([rng.uniform(-50, 50) for _ in range(count)], dtype=torch.float64)
    if dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        values = values.round().abs()
    return values.to(dtype).reshape(shape)


def _inline_or_aux(rng: random.Random, itemsize: int, width: int) -> int:
    """A row count that makes an array inline (< 256 bytes) or aux, half the time each."""
    limit = INLINE_THRESHOLD // (itemsize * width)
    return (
        rng.randint(0, max(limit - 1, 0)) if rng.random() < 0.5 else rng.randint(limit, limit + 40)
    )


# --------------------------------------------------------------------------- requests


def _sampling_kwargs(rng: random.Random) -> dict[str, Any]:
    """Random user-level sampling arguments (corewire spelling: output_kind is an int)."""
    choices: dict[str, Callable[[], Any]] = {
        "n": lambda: rng.choice([1, 2, 4]),
        "presence_penalty": lambda: rng.uniform(-2, 2),
        "frequency_penalty": lambda: rng.choice([0.0, rng.uniform(-2, 2)]),
        "repetition_penalty": lambda: rng.choice([1.0, rng.uniform(0.5, 2)]),
        "temperature": lambda: rng.choice([0.0, 1e-6, 1e-3, 0.5, 1.0, 1.7]),
        "top_p": lambda: rng.choice([1.0, rng.uniform(0.05, 1)]),
        "top_k": lambda: rng.choice([-1, 0, 1, 50]),
        "min_p": lambda: rng.choice([0.0, rng.random()]),
        "seed": lambda: rng.choice([-1, 0, 7, 2**40, None]),
        "stop": lambda: rng.choice(["x", ["ab", "cde"], [], None]),
        "stop_token_ids": lambda: [rng.randrange(50000) for _ in range(rng.randint(0, 4))],
        "ignore_eos": lambda: rng.random() < 0.5,
        "max_tokens": lambda: rng.choice([None, 1, 16, 40, 4096]),
        "min_tokens": lambda: rng.choice([0, 1]),
        "logprobs": lambda: rng.choice([0, 1, 5, -1, True]),
        "prompt_logprobs": lambda: rng.choice([0, 3, -1, True]),
        "flat_logprobs": lambda: rng.random() < 0.5,
        "detokenize": lambda: rng.random() < 0.5,
        "skip_special_tokens": lambda: rng.random() < 0.5,
        "spaces_between_special_tokens": lambda: rng.random() < 0.5,
        "include_stop_str_in_output": lambda: rng.random() < 0.5,
        "output_kind": lambda: rng.choice([0, 1, 2]),
        "skip_clone": lambda: rng.random() < 0.5,
        "logit_bias": lambda: {rng.randrange(1000): rng.uniform(-100, 100) for _ in range(3)},
        "allowed_token_ids": lambda: [rng.randrange(1000) for _ in range(rng.randint(1, 3))],
        "extra_args": lambda: {"k": _plain(rng), "n": rng.randint(0, 9)},
        "routed_experts_prompt_start": lambda: rng.choice([0, 3]),
        "bad_words": lambda: rng.choice([["bad"], ["a b", "c"], []]),
        "skip_reading_prefix_cache": lambda: rng.choice([True, False, None]),
        "thinking_token_budget": lambda: rng.choice([-1, 0, 100, None]),
    }
    names = rng.sample(sorted(choices), rng.randint(0, 10))
    return {name: choices[name]() for name in names}


def _sampling_pair(rng: random.Random) -> Pair:
    """SamplingParams as a vLLM front-end builds them, and corewire's equivalent."""
    while True:
        kwargs = _sampling_kwargs(rng)
        extra: dict[str, Any] = {}
        if rng.random() < 0.2:
            extra["structured_outputs"] = StructuredOutputsParams(json={"type": "object"})
        if rng.random() < 0.2:
            extra["repetition_detection"] = RepetitionDetectionParams(4, 2, 3)
        vkw = dict(kwargs)
        if "output_kind" in vkw:
            vkw["output_kind"] = RequestOutputKind(vkw["output_kind"])
        try:
            vsp = VSamplingParams(**vkw, **extra)
        except ValueError:  # vLLM refuses some combinations (greedy with n > 1 ...)
            continue
        break
    csp = p.SamplingParams(**kwargs, **{k: _as_map(x) for k, x in extra.items()})
    # What vLLM's input processor adds: the eos token and the generation config's ids.
    eos = rng.choice([None, 2, 50256])
    config = {"eos_token_id": [eos, 7]} if eos is not None and rng.random() < 0.3 else {}
    vsp.update_from_generation_config(config, eos)
    if not csp.ignore_eos:
        csp.eos_token_id = eos
    if eos is not None:
        csp.all_stop_token_ids.add(eos)
    if config:
        # A set's iteration order (its bytes) depends on how it was built: add what vLLM
        # adds, the way it adds it. Decoders read sets, so only the bytes would differ.
        csp.all_stop_token_ids.update({7})
        if not csp.ignore_eos:
            # vLLM rebuilds stop_token_ids from a set; take its order, the contents are checked.
            assert set(vsp.stop_token_ids) == {7, *csp.stop_token_ids}  # type: ignore[arg-type]
            csp.stop_token_ids = list(vsp.stop_token_ids)  # type: ignore[arg-type]
    return csp, vsp


def _pooling_pair(rng: random.Random) -> Pair:
    kwargs: dict[str, Any] = {
        "dimensions": rng.choice([None, 3, 768]),
        "step_tag_id": rng.choice([None, 5]),
        "returned_token_ids": rng.choice([None, [1, 2]]),
        "task": rng.choice([None, "embed", "classify", "token_embed"]),
        "requires_token_ids": rng.random() < 0.5,
        "skip_reading_prefix_cache": rng.choice([None, True, False]),
        "extra_kwargs": rng.choice([None, {"a": 1}]),
    }
    use_activation = rng.choice([None, True, False])
    late = _maybe(rng, lambda: LateInteractionParams("cache_query", "q1", 2), 0.2)
    vpp = VPoolingParams(use_activation=use_activation, late_interaction_params=late, **kwargs)
    late_list = None if late is None else list(msgspec.structs.astuple(late))
    cpp = p.PoolingParams(normalize=use_activation, late_interaction_params=late_list, **kwargs)
    return cpp, vpp


def _request_pair(rng: random.Random) -> Pair:
    embeds = None
    if rng.random() < 0.3:
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        embeds = _tensor(rng, dtype, (_inline_or_aux(rng, dtype.itemsize, 8), 8))
    params_kind = rng.choice(["sampling", "sampling", "pooling", "none"])
    csp = vsp = cpp = vpp = None
    if params_kind == "sampling":
        csp, vsp = _sampling_pair(rng)
    elif params_kind == "pooling":
        cpp, vpp = _pooling_pair(rng)
    lora = _maybe(rng, lambda: LoRARequest("adapter", rng.randint(1, 9), "/adapters/a"), 0.2)
    common = {
        "request_id": _rid(rng),
        "prompt_token_ids": _maybe(rng, lambda: [rng.randrange(2**17) for _ in range(9)], 0.8),
        "mm_features": None,
        "arrival_time": rng.choice([0.0, _float(rng)]),
        "cache_salt": _maybe(rng, lambda: _rid(rng)),
        "data_parallel_rank": _maybe(rng, lambda: rng.randint(0, 3)),
        "prompt_embeds": embeds,
        "prompt_is_token_ids": _maybe(rng, lambda: [True, False, True], 0.2),
        "client_index": rng.choice([0, 1, 3]),
        "current_wave": rng.choice([0, 5, 2**33]),
        "priority": rng.choice([0, -1, 10]),
        "trace_headers": _maybe(rng, lambda: {"traceparent": _rid(rng)}),
        "resumable": rng.random() < 0.5,
        "external_req_id": _maybe(rng, lambda: _rid(rng)),
        "reasoning_ended": rng.choice([None, True, False]),
        "reasoning_parser_kwargs": _maybe(rng, lambda: {"think": True}, 0.2),
        "abort_immediately": rng.random() < 0.2,
    }
    cw = p.EngineCoreRequest(
        **common,
        sampling_params=csp,
        pooling_params=cpp,
        lora_request=None if lora is None else list(msgspec.structs.astuple(lora)),
    )
    vl = v.EngineCoreRequest(**common, sampling_params=vsp, pooling_params=vpp, lora_request=lora)
    return cw, vl


@pytest.mark.parametrize("seed", SEEDS)
def test_requests_byte_for_byte(seed: int) -> None:
    """EngineCoreRequest (sampling, pooling, prompt_embeds inline and aux): same frames.

    Then vLLM's decoder reads corewire's frames as corewire's decoder reads vLLM's.
    """
    rng = random.Random(seed)
    ours_dec = MsgspecDecoder(p.EngineCoreRequest)
    theirs_dec = MsgpackDecoder(v.EngineCoreRequest)
    seen_aux = False
    for _ in range(BATCH):
        cw, vl = _request_pair(rng)
        ours = _frames(Encoder().encode(cw))
        theirs = _frames(MsgpackEncoder().encode(vl))
        assert ours == theirs, (msgspec.msgpack.decode(ours[0]), msgspec.msgpack.decode(theirs[0]))
        seen_aux |= len(ours) > 1
        expected = _norm(theirs_dec.decode(theirs))
        assert _norm(ours_dec.decode(theirs)) == expected
        assert _norm(theirs_dec.decode(ours)) == _norm(ours_dec.decode(ours)) == expected
    assert seen_aux or seed, "seed 0 must send a prompt_embeds aux frame"


def test_sampling_params_maps() -> None:
    """A few hand-picked SamplingParams: the maps vLLM writes, and corewire's same bytes.

    vLLM writes ``stop``, ``stop_token_ids`` and ``bad_words`` even when unset (as ``[]``)
    and always ``skip_reading_prefix_cache``; greedy sampling drops top_p/top_k/min_p;
    the eos token travels as ``_eos_token_id`` and in ``_all_stop_token_ids``.
    """
    unset = {"stop": [], "stop_token_ids": [], "bad_words": [], "skip_reading_prefix_cache": False}
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({}, unset),
        ({"max_tokens": 8}, {"stop": [], "stop_token_ids": [], "max_tokens": 8, **unset}),
        ({"temperature": 0.0, "top_k": 5, "top_p": 0.5}, {"temperature": 0.0, **unset}),
        ({"temperature": 1.0}, {"temperature": 1.0, **unset}),  # explicit floats are written
        (
            {"seed": -1, "stop": "ab", "stop_token_ids": [9], "prompt_logprobs": 1},
            {
                "stop": ["ab"],
                "stop_token_ids": [9],
                "prompt_logprobs": 1,
                "output_text_buffer_length": 1,
                "_all_stop_token_ids": [9],
                "bad_words": [],
                "skip_reading_prefix_cache": True,
            },
        ),
    ]
    for kwargs, expected in cases:
        payload = _both_encode(p.SamplingParams(**kwargs), VSamplingParams(**kwargs))[0]
        assert msgspec.msgpack.decode(payload) == expected
        assert payload[:1] == b"\xde"  # map16 header: the struct has more than 15 fields
    eos = p.SamplingParams(eos_token_id=2, all_stop_token_ids={2})
    vsp = VSamplingParams()
    vsp.update_from_generation_config({}, 2)
    payload = _both_encode(eos, vsp)[0]
    assert msgspec.msgpack.decode(payload) == {
        **unset,
        "_eos_token_id": 2,
        "_all_stop_token_ids": [2],
    }


def test_pooling_params_are_a_full_array() -> None:
    """PoolingParams is array-like in vLLM: all 10 fields written, output_kind 2."""
    payload = _both_encode(p.PoolingParams(), VPoolingParams())[0]
    assert payload == b"\x9a" + b"\xc0" * 5 + b"\xc2" + b"\xc0" * 3 + b"\x02"
    assert _norm(MsgspecDecoder(p.PoolingParams).decode(payload)) == _norm(
        MsgpackDecoder(VPoolingParams).decode(payload)
    )


def test_request_every_default_field_is_written() -> None:
    """vLLM writes all 20 fields of a request although it declares omit_defaults.

    msgspec ignores ``omit_defaults`` on array-like structs, so nothing is cut short.
    """
    vl = v.EngineCoreRequest("r", [1], None, None, None, 0.0, None, None, None)
    cw = p.EngineCoreRequest(request_id="r", prompt_token_ids=[1])
    payload = _both_encode(cw, vl)[0]
    assert payload[:3] == b"\xdc\x00\x14"  # array16 of 20


# --------------------------------------------------------------------------- outputs


def _logprobs_pair(rng: random.Random) -> Pair:
    k = rng.randint(0, 5)
    rows = _inline_or_aux(rng, 4, k + 1)
    ids = np.array([[rng.randrange(2**17) for _ in range(k + 1)] for _ in range(rows)], "<i4")
    ids = ids.reshape(rows, k + 1)
    values = np.array([rng.uniform(-20, 0) for _ in range(rows * (k + 1))], "<f4")
    values = values.reshape(rows, k + 1)
    ranks = np.array([rng.randint(1, 9) for _ in range(rows)], "<i4")
    cu = rng.choice([None, [0, rows]])
    return p.LogprobsLists(ids, values, ranks, cu), VLogprobsLists(ids, values, ranks, cu)


def _prompt_logprobs_pair(rng: random.Random) -> Pair:
    k = rng.randint(0, 4)
    rows = _inline_or_aux(rng, 8, k + 1)
    ids = _tensor(rng, torch.int64, (rows, k + 1))
    values = _tensor(rng, torch.float32, (rows, k + 1))
    ranks = _tensor(rng, torch.int64, (rows,))
    return p.LogprobsTensors(ids, values, ranks), VLogprobsTensors(ids, values, ranks)


def _scheduler_stats(rng: random.Random) -> SchedulerStats:
    def prefix() -> PrefixCacheStats:
        return PrefixCacheStats(
            reset=rng.random() < 0.5,
            requests=rng.randint(0, 9),
            queries=rng.randint(0, 999),
            hits=rng.randint(0, 99),
            preempted_requests=rng.randint(0, 3),
        )

    return SchedulerStats(
        num_running_reqs=rng.randint(0, 64),
        num_waiting_reqs=rng.randint(0, 64),
        num_skipped_waiting_reqs=rng.randint(0, 3),
        step_counter=rng.randint(0, 2**40),
        current_wave=rng.randint(0, 9),
        kv_cache_usage=rng.random(),
        prefix_cache_stats=prefix(),
        connector_prefix_cache_stats=_maybe(rng, prefix, 0.3),
        kv_cache_eviction_events=[
            KVCacheEvictionEvent(rng.random(), rng.random(), (rng.random(), 2.5))
            for _ in range(rng.randint(0, 2))
        ],
        spec_decoding_stats=_maybe(
            rng, lambda: SpecDecodingStats(3, 1, 3, 2, [1, 1, 0], [1, 1, 1]), 0.3
        ),
        kv_connector_stats=_maybe(rng, lambda: {"bytes": rng.randint(0, 2**40)}, 0.3),
        waiting_lora_adapters=rng.choice([{}, {"a": 1}]),
        running_lora_adapters=rng.choice([{}, {"b": 2}]),
        cudagraph_stats=_maybe(rng, lambda: CUDAGraphStat(5, 8, 3, "FULL"), 0.2),
        perf_stats=_maybe(rng, lambda: PerfStats(2**45, 2**33, rng.randint(0, 9)), 0.2),
    )


def _event(rng: random.Random) -> tuple[int, float]:
    return rng.choice([1, 2, 3]), _float(rng)


def _output_pair(rng: random.Random) -> Pair:
    fields: dict[str, Pair] = {}
    if rng.random() < 0.4:
        fields["new_logprobs"] = _logprobs_pair(rng)
    if rng.random() < 0.25:
        fields["new_prompt_logprobs_tensors"] = _prompt_logprobs_pair(rng)
    if rng.random() < 0.25:
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        tensor = _tensor(rng, dtype, (_inline_or_aux(rng, dtype.itemsize, 1),))
        fields["pooling_output"] = (tensor, tensor)
    reason = rng.choice([None, None, *range(5)])
    if reason is not None:
        fields["finish_reason"] = (p.FinishReason(reason), v.FinishReason(reason))
    stop = rng.choice([None, 0, 50256, _rid(rng)])
    fields["stop_reason"] = (stop, stop)
    if rng.random() < 0.5:
        events = [_event(rng) for _ in range(rng.randint(0, 3))]
        fields["events"] = (
            [p.EngineCoreEvent(p.EngineCoreEventType(t), ts) for t, ts in events],
            [v.EngineCoreEvent(v.EngineCoreEventType(t), ts) for t, ts in events],
        )
    if rng.random() < 0.3:
        params = {"remote_host": "10.0.0.1", "remote_port": 5557, "x": _plain(rng)}
        fields["kv_transfer_params"] = (params, params)
    if rng.random() < 0.3:
        headers = {"traceparent": _rid(rng)}
        fields["trace_headers"] = (headers, headers)
    if rng.random() < 0.4:
        counts = [rng.randint(0, 500) for _ in range(5)]
        stats = PrefillStats(*counts)
        fields["prefill_stats"] = (dataclasses.asdict(stats), stats)
    if rng.random() < 0.2:
        experts = np.array(
            [rng.randrange(64) for _ in range(_inline_or_aux(rng, 2, 4) * 4)], "<i2"
        ).reshape(-1, 4)
        fields["routed_experts"] = (experts, experts)
    if rng.random() < 0.2:
        nans = rng.randint(1, 9)
        fields["num_nans_in_logits"] = (nans, nans)
    rid = _rid(rng)
    tokens = [rng.randrange(2**31) for _ in range(rng.randint(0, 6))]
    cw = p.EngineCoreOutput(rid, tokens, **{k: c for k, (c, _) in fields.items()})
    vl = v.EngineCoreOutput(rid, tokens, **{k: x for k, (_, x) in fields.items()})
    return cw, vl


def _utility_pair(rng: random.Random) -> Pair:
    call_id = rng.choice([0, 1, rng.getrandbits(64), 2**63, 2**64 - 1, -1])
    if call_id == -1:
        value: Any = ("RECONFIGURE_FINISHED", rng.randint(0, 3))
        return (
            p.UtilityOutput(call_id, None, p.UtilityResult(value)),
            v.UtilityOutput(call_id, None, VUtilityResult(value)),
        )
    if rng.random() < 0.3:
        message = f"Call to {_rid(rng)} method failed: boom"
        return p.UtilityOutput(call_id, message), v.UtilityOutput(call_id, message)
    if rng.random() < 0.2:
        return p.UtilityOutput(call_id), v.UtilityOutput(call_id)
    value = _plain(rng)
    return (
        p.UtilityOutput(call_id, None, p.UtilityResult(value)),
        v.UtilityOutput(call_id, None, VUtilityResult(value)),
    )


def _outputs_pair(rng: random.Random) -> Pair:
    pairs = [_output_pair(rng) for _ in range(rng.randint(0, 4))]
    fields: dict[str, Pair] = {}
    if rng.random() < 0.4:
        stats = _scheduler_stats(rng)
        fields["scheduler_stats"] = (dataclasses.asdict(stats), stats)
    if rng.random() < 0.3:
        fields["utility_output"] = _utility_pair(rng)
    if rng.random() < 0.4:
        done = [_rid(rng) for _ in range(rng.randint(0, 4))]
        fields["finished_requests"] = (set(done), set(done))
    for name in ("wave_complete", "start_wave"):
        if rng.random() < 0.2:
            wave = rng.choice([0, 3, 2**40])
            fields[name] = (wave, wave)
    # Never 0.0: vLLM's decoder replaces a zero timestamp with its own clock.
    timestamp = rng.choice([1.0, rng.uniform(1, 1e6)])
    engine_index = rng.randint(0, 7)
    cw = p.EngineCoreOutputs(
        engine_index=engine_index,
        outputs=[c for c, _ in pairs],
        timestamp=timestamp,
        **{k: c for k, (c, _) in fields.items()},
    )
    vl = v.EngineCoreOutputs(
        engine_index=engine_index,
        outputs=[x for _, x in pairs],
        timestamp=timestamp,
        **{k: x for k, (_, x) in fields.items()},
    )
    return cw, vl


@pytest.mark.parametrize("seed", SEEDS)
def test_outputs_byte_for_byte(seed: int) -> None:
    """EngineCoreOutputs of every kind: corewire writes vLLM's frames exactly.

    And vLLM's decoder, corewire's MsgspecDecoder and its NativeDecoder read the same
    frames into the same values (stats dataclasses compared as the maps of their fields).
    """
    rng = random.Random(1000 + seed)
    theirs_dec = MsgpackDecoder(v.EngineCoreOutputs)
    ours = [MsgspecDecoder(p.EngineCoreOutputs), NativeDecoder()]
    aux_frames = 0
    for _ in range(BATCH):
        cw, vl = _outputs_pair(rng)
        frames = _both_encode(cw, vl)
        aux_frames += len(frames) - 1
        expected = _norm_outputs(theirs_dec.decode(frames))
        assert expected == normalize(cw)
        for decoder in ours:
            decoded = decoder.decode(frames)
            check_types(decoded)
            assert _norm_outputs(decoded) == expected, type(decoder).__name__
    assert aux_frames > 0


def test_stats_dataclasses_decode_from_corewire_maps() -> None:
    """vLLM decodes corewire's stats maps into its dataclasses, missing keys defaulted.

    A corewire map need not carry every field: vLLM fills the rest with the dataclass
    defaults and ignores unknown keys; corewire's decoders keep the map as sent.
    """
    prefill = {"num_prompt_tokens": 9, "num_cached_tokens": 4}
    stats = {"num_running_reqs": 2, "prefix_cache_stats": {"hits": 3}, "future_key": [1]}
    cw = p.EngineCoreOutputs(
        outputs=[p.EngineCoreOutput("r", [1], prefill_stats=prefill)],
        scheduler_stats=stats,
        timestamp=2.0,
    )
    frames = _frames(Encoder().encode(cw))
    decoded = MsgpackDecoder(v.EngineCoreOutputs).decode(frames)
    assert decoded.outputs[0].prefill_stats == PrefillStats(
        num_prompt_tokens=9, num_cached_tokens=4
    )
    assert decoded.scheduler_stats == SchedulerStats(
        num_running_reqs=2, prefix_cache_stats=PrefixCacheStats(hits=3)
    )
    for decoder in (MsgspecDecoder(p.EngineCoreOutputs), NativeDecoder()):
        again = decoder.decode(frames)
        assert again.scheduler_stats == stats
        assert again.outputs[0].prefill_stats == prefill


@pytest.mark.parametrize(
    "payload",
    [
        [7, [], None, 3.5],
        [0, [["r", [1, 2]]], None, 3.5],
        [0, [["r", [], None, None, None, 1]], None, 3.5, [5]],
        [1, [["r", [4], *[None] * 10, 0, "future"]], None, 3.5, [5, None, [None, 1], "x"], None],
        [0, [], None, 3.5, None, ["a"], None, None, "future", {"k": 1}],
    ],
    ids=["outputs_short", "output_short", "utility_short", "fields_appended", "outputs_long"],
)
def test_short_and_long_arrays_decode_alike(payload: list[Any]) -> None:
    """Arrays cut short or with extra trailing fields: vLLM's decoder takes them too, and
    reads the same values as corewire's decoders."""
    frames = [msgspec.msgpack.encode(payload)]
    expected = _norm_outputs(MsgpackDecoder(v.EngineCoreOutputs).decode(frames))
    for decoder in (MsgspecDecoder(p.EngineCoreOutputs), NativeDecoder()):
        assert _norm_outputs(decoder.decode(frames)) == expected


def test_zero_timestamp_is_replaced_by_vllms_decoder() -> None:
    """Same bytes, different meaning: vLLM's EngineCoreOutputs turns timestamp 0.0 into
    its own ``time.monotonic()`` on decode; corewire's decoders keep 0.0."""
    vl = v.EngineCoreOutputs(engine_index=1, timestamp=5.0)
    vl.timestamp = 0.0
    frames = _both_encode(p.EngineCoreOutputs(engine_index=1), vl)
    assert MsgpackDecoder(v.EngineCoreOutputs).decode(frames).timestamp > 0.0
    for decoder in (MsgspecDecoder(p.EngineCoreOutputs), NativeDecoder()):
        assert decoder.decode(frames).timestamp == 0.0


def test_outputs_every_default_field_is_written() -> None:
    """vLLM writes all 8 / 13 fields although it declares omit_defaults (msgspec ignores
    the option on array-like structs)."""
    vl = v.EngineCoreOutputs(outputs=[v.EngineCoreOutput("r", [])], timestamp=1.0)
    cw = p.EngineCoreOutputs(outputs=[p.EngineCoreOutput("r", [])], timestamp=1.0)
    payload = _both_encode(cw, vl)[0]
    assert payload[:4] == b"\x98\x00\x91\x9d"  # array of 8: index 0, [array of 13]


# --------------------------------------------------------------------------- other messages


@pytest.mark.parametrize("seed", SEEDS)
def test_abort_utility_and_wave_payloads(seed: int) -> None:
    """ABORT, UTILITY and START_DP_WAVE payloads as vLLM's client and coordinator write them."""
    rng = random.Random(2000 + seed)
    for _ in range(BATCH):
        ids = [_rid(rng) for _ in range(rng.randint(0, 5))]
        _both_encode(ids, ids)
        call_id = rng.choice([0, rng.getrandbits(64), 2**63, 2**64 - 1])
        args = tuple(_plain(rng) for _ in range(rng.randint(0, 3)))
        method = rng.choice(["get_supported_tasks", "sleep", "collective_rpc", "is_sleeping"])
        call = (rng.randint(0, 3), call_id, method, args)
        frames = _both_encode(call, call)
        assert _norm(MsgspecDecoder().decode(frames)) == _norm(MsgpackDecoder().decode(frames))
        wave = (rng.randint(0, 2**33), rng.randint(-1, 7))
        frames = _both_encode(wave, wave)
        # vLLM's coordinator writes START_DP_WAVE with plain msgspec: the same bytes.
        assert frames == [msgspec.msgpack.encode(wave)]


def test_add_lora_arguments() -> None:
    """A LoRARequest argument to a utility call is an array; corewire sends the same list."""
    lora = LoRARequest("adapter", 7, "/adapters/a", load_inplace=True)
    as_list = list(msgspec.structs.astuple(lora))
    _both_encode((0, 2**63 + 5, "add_lora", (as_list,)), (0, 2**63 + 5, "add_lora", (lora,)))


def test_enum_values_match() -> None:
    """Request types, finish reasons (and their text) and event types are vLLM's."""
    assert {t.name: t.value for t in p.EngineCoreRequestType} == {
        t.name: t.value for t in v.EngineCoreRequestType
    }
    assert [(r.name, int(r), str(r)) for r in p.FinishReason] == [
        (r.name, int(r), str(r)) for r in v.FinishReason
    ]
    assert [(e.name, int(e)) for e in p.EngineCoreEventType] == [
        (e.name, int(e)) for e in v.EngineCoreEventType
    ]
    assert [k.value for k in RequestOutputKind] == [0, 1, 2]


def test_struct_layouts_match() -> None:
    """Field order and wire names of every struct are vLLM's (positions are the format)."""
    for ours, theirs in [
        (p.EngineCoreRequest, v.EngineCoreRequest),
        (p.EngineCoreOutput, v.EngineCoreOutput),
        (p.EngineCoreOutputs, v.EngineCoreOutputs),
        (p.UtilityOutput, v.UtilityOutput),
        (p.EngineCoreEvent, v.EngineCoreEvent),
        (p.SamplingParams, VSamplingParams),
        (p.PoolingParams, VPoolingParams),
    ]:
        names = [f.encode_name for f in msgspec.structs.fields(ours)]
        assert names == [f.encode_name for f in msgspec.structs.fields(theirs)], ours.__name__
        assert ours.__struct_config__.array_like == theirs.__struct_config__.array_like
    assert p.LogprobsLists._fields == VLogprobsLists._fields
    assert p.LogprobsTensors._fields == VLogprobsTensors._fields


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((), dtype="<c16"),
        np.arange(12, dtype=">i4").reshape(3, 4).T,
        np.zeros((0, 9), dtype="<f8"),
        np.arange(64, dtype="<u4"),
        np.arange(63, dtype="<u4"),
        np.ones((3, 2), dtype="|b1"),
    ],
    ids=["scalar", "big_endian_transposed", "empty", "aux_256", "inline_252", "bool"],
)
def test_ndarray_edge_cases(array: np.ndarray) -> None:
    """0-d, non-contiguous, big-endian, empty and threshold-sized arrays: same frames."""
    _both_encode(array, array)
    _both_encode([array, array], [array, array])


@pytest.mark.parametrize("threshold", [0, 1, 8, 300])
def test_custom_threshold_edge_cases(threshold: int) -> None:
    """With any threshold, 0-d arrays stay inline and the rest follow the byte count."""
    items = [np.full((), 1.5), np.arange(2, dtype="<i4"), torch.arange(3)]
    ours = _frames(Encoder(inline_threshold=threshold).encode(items))
    assert ours == _frames(MsgpackEncoder(size_threshold=threshold).encode(items))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_small_cuda_tensor_goes_to_aux_like_vllm() -> None:
    """vLLM inlines CPU tensors only: a small CUDA tensor takes an aux frame."""
    tensor = torch.arange(4, dtype=torch.float32).cuda()
    frames = _both_encode([tensor], [tensor])
    assert len(frames) == 2
