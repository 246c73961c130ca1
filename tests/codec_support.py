"""Helpers shared by the codec tests: decoders under test, frame builders, normalization.

The frame builders produce vLLM 0.25.1's wire layout (every field of a positional struct
written, as vLLM's encoder does: msgspec ignores ``omit_defaults`` on array-like structs)
from plain lists, dicts and ``msgspec.msgpack.Ext`` values, never from
``corewire.protocol`` structs, so the golden tests pin the byte layout independently of
the code under test.

:func:`normalize` turns a decoded ``EngineCoreOutputs`` from either decoder (or a
``corewire.protocol`` struct built by hand) into plain, comparable Python: arrays and
tensors become ``(kind, dtype, shape, bytes)``, enums become ints, floats become their
hex text (so NaN equals NaN and ``-0.0`` differs from ``0.0``), and bools stay distinct
from ints.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from corewire import protocol
from corewire.codec import MsgspecDecoder, NativeDecoder

__all__ = [
    "EVENT_FIELDS",
    "LOGPROBS_LISTS_FIELDS",
    "LOGPROBS_TENSORS_FIELDS",
    "OUTPUTS_FIELDS",
    "OUTPUT_FIELDS",
    "RAW_EXT",
    "TORCH_DTYPES",
    "UTILITY_FIELDS",
    "check_types",
    "ext",
    "make_decoder",
    "nd",
    "normalize",
    "output",
    "outputs_msg",
    "pack",
    "tensor_bytes",
    "utility",
]

#: msgpack extension type that carries raw array bytes inline.
RAW_EXT = 3

# Field names, in wire order, of every positional message (vLLM 0.25.1's order).
OUTPUTS_FIELDS = (
    "engine_index",
    "outputs",
    "scheduler_stats",
    "timestamp",
    "utility_output",
    "finished_requests",
    "wave_complete",
    "start_wave",
)
OUTPUT_FIELDS = (
    "request_id",
    "new_token_ids",
    "new_logprobs",
    "new_prompt_logprobs_tensors",
    "pooling_output",
    "finish_reason",
    "stop_reason",
    "events",
    "kv_transfer_params",
    "trace_headers",
    "prefill_stats",
    "routed_experts",
    "num_nans_in_logits",
)
UTILITY_FIELDS = ("call_id", "failure_message", "result")
LOGPROBS_LISTS_FIELDS = (
    "logprob_token_ids",
    "logprobs",
    "sampled_token_ranks",
    "cu_num_generated_tokens",
)
LOGPROBS_TENSORS_FIELDS = (
    "logprob_token_ids",
    "logprobs",
    "selected_token_ranks",
    "cu_num_generated_tokens",
)
EVENT_FIELDS = ("type", "timestamp")

# Wire defaults of the trailing fields, used to build full-length arrays.
_OUTPUT_DEFAULTS: dict[str, Any] = {name: None for name in OUTPUT_FIELDS[2:]}
_OUTPUT_DEFAULTS["num_nans_in_logits"] = 0
_OUTPUTS_DEFAULTS: dict[str, Any] = {
    "engine_index": 0,
    "outputs": [],
    "scheduler_stats": None,
    "timestamp": 0.0,
    "utility_output": None,
    "finished_requests": None,
    "wave_complete": None,
    "start_wave": None,
}

#: Torch dtypes a tensor field may carry, by wire name.
TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


# --------------------------------------------------------------------------- decoders


def make_decoder(kind: str) -> Any:
    """A fresh decoder of ``kind`` ("msgspec" or "native") for EngineCoreOutputs frames."""
    if kind == "msgspec":
        return MsgspecDecoder(protocol.EngineCoreOutputs)
    if kind == "native":
        return NativeDecoder(release="0.25.1")
    raise ValueError(f"unknown decoder kind {kind!r}")


# --------------------------------------------------------------------------- builders


def pack(obj: Any) -> bytes:
    """msgpack bytes of plain Python data (lists, dicts, ints, ``Ext`` ...)."""
    return msgspec.msgpack.encode(obj)


def ext(data: bytes, code: int = RAW_EXT) -> msgspec.msgpack.Ext:
    """Inline array data: msgpack extension ``code`` (3 = raw bytes) holding ``data``."""
    return msgspec.msgpack.Ext(code, bytes(data))


def nd(dtype: str, shape: Sequence[int], data: Any) -> list[Any]:
    """An array or tensor on the wire: ``[dtype, shape, data]``."""
    return [dtype, list(shape), data]


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw C-contiguous bytes of a CPU tensor of any dtype (bfloat16 included)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def output(request_id: Any, new_token_ids: Any, *, length: int = 13, **fields: Any) -> list[Any]:
    """EngineCoreOutput as a positional list, cut to ``length`` fields (13 = all)."""
    unknown = set(fields) - set(OUTPUT_FIELDS)
    if unknown:
        raise TypeError(f"not EngineCoreOutput fields: {sorted(unknown)}")
    values = {**_OUTPUT_DEFAULTS, **fields, "request_id": request_id}
    values["new_token_ids"] = new_token_ids
    return [values[name] for name in OUTPUT_FIELDS][:length]


def outputs_msg(*, length: int = 8, **fields: Any) -> list[Any]:
    """EngineCoreOutputs as a positional list, cut to ``length`` fields (8 = all)."""
    unknown = set(fields) - set(OUTPUTS_FIELDS)
    if unknown:
        raise TypeError(f"not EngineCoreOutputs fields: {sorted(unknown)}")
    values = {**_OUTPUTS_DEFAULTS, **fields}
    return [values[name] for name in OUTPUTS_FIELDS][:length]


def utility(call_id: Any, failure_message: Any = None, result: Any = None) -> list[Any]:
    """UtilityOutput as a positional list."""
    return [call_id, failure_message, result]


# --------------------------------------------------------------------------- normalize


def normalize(outs: Any) -> dict[str, Any]:
    """Comparable plain-Python form of a decoded (or hand-built) EngineCoreOutputs."""
    result = {name: getattr(outs, name) for name in OUTPUTS_FIELDS}
    result["engine_index"] = _value(result["engine_index"])
    result["outputs"] = [_output(o) for o in result["outputs"]]
    result["scheduler_stats"] = _value(result["scheduler_stats"])
    result["timestamp"] = _value(result["timestamp"])
    result["utility_output"] = _utility(result["utility_output"])
    result["finished_requests"] = _value(result["finished_requests"])
    result["wave_complete"] = _value(result["wave_complete"])
    result["start_wave"] = _value(result["start_wave"])
    return result


def _output(out: Any) -> dict[str, Any]:
    result = {name: getattr(out, name) for name in OUTPUT_FIELDS}
    result["new_logprobs"] = _named(result["new_logprobs"], LOGPROBS_LISTS_FIELDS)
    tensors = result["new_prompt_logprobs_tensors"]
    result["new_prompt_logprobs_tensors"] = _named(tensors, LOGPROBS_TENSORS_FIELDS)
    events = result["events"]
    if events is not None:
        result["events"] = [_named(e, EVENT_FIELDS) for e in events]
    for name in OUTPUT_FIELDS:
        if name not in ("new_logprobs", "new_prompt_logprobs_tensors", "events"):
            result[name] = _value(result[name])
    return result


def _utility(util: Any) -> Any:
    if util is None:
        return None
    result = {name: _value(getattr(util, name)) for name in UTILITY_FIELDS[:2]}
    res = util.result
    result["result"] = None if res is None else {"result": _value(res.result)}
    return result


def _named(obj: Any, fields: Sequence[str]) -> Any:
    if obj is None:
        return None
    return {name: _value(getattr(obj, name)) for name in fields}


def _value(v: Any) -> Any:
    """Plain comparable form of one decoded value (recursively)."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, bool):
        return ("bool", v)
    if isinstance(v, enum.Enum):
        return int(v.value)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        # hex keeps -0.0 apart from 0.0; all NaNs compare equal as "nan".
        return ("float", "nan" if math.isnan(v) else v.hex())
    if isinstance(v, (bytes, bytearray, memoryview)):
        return ("bytes", bytes(v))
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.str, tuple(v.shape), np.ascontiguousarray(v).tobytes())
    if isinstance(v, torch.Tensor):
        dtype = str(v.dtype).removeprefix("torch.")
        return ("tensor", dtype, tuple(v.shape), tensor_bytes(v))
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    if isinstance(v, dict):
        # Both decoders keep map order, so an order-sensitive form is the stricter check.
        return ("map", [(_value(k), _value(x)) for k, x in v.items()])
    if isinstance(v, (set, frozenset)):
        return ("set", sorted((_value(x) for x in v), key=repr))
    raise TypeError(f"normalize: unexpected decoded value of type {type(v).__name__}: {v!r:.80}")


# --------------------------------------------------------------------------- type checks


def check_types(outs: Any) -> None:
    """Assert the Python types the spec promises for every field of a decoded message."""
    assert isinstance(outs.engine_index, int) and not isinstance(outs.engine_index, bool)
    assert isinstance(outs.outputs, list)
    assert outs.scheduler_stats is None or isinstance(outs.scheduler_stats, dict)
    assert isinstance(outs.timestamp, float)
    assert outs.finished_requests is None or isinstance(outs.finished_requests, set)
    if outs.finished_requests:
        assert all(isinstance(r, str) for r in outs.finished_requests)
    for name in ("wave_complete", "start_wave"):
        value = getattr(outs, name)
        assert value is None or (isinstance(value, int) and not isinstance(value, bool)), name
    util = outs.utility_output
    if util is not None:
        assert isinstance(util.call_id, int) and not isinstance(util.call_id, bool)
        assert util.failure_message is None or isinstance(util.failure_message, str)
        assert util.result is None or hasattr(util.result, "result")
    for out in outs.outputs:
        _check_output_types(out)


def _check_output_types(out: Any) -> None:
    assert isinstance(out.request_id, str)
    assert isinstance(out.new_token_ids, list)
    assert all(isinstance(t, int) and not isinstance(t, bool) for t in out.new_token_ids)
    if out.new_logprobs is not None:
        for name in LOGPROBS_LISTS_FIELDS[:3]:
            assert isinstance(getattr(out.new_logprobs, name), np.ndarray), name
    if out.new_prompt_logprobs_tensors is not None:
        for name in LOGPROBS_TENSORS_FIELDS[:3]:
            value = getattr(out.new_prompt_logprobs_tensors, name)
            assert isinstance(value, torch.Tensor), name
    assert out.pooling_output is None or isinstance(out.pooling_output, torch.Tensor)
    reason = out.finish_reason
    assert reason is None or type(reason) is protocol.FinishReason, type(reason)
    assert out.stop_reason is None or isinstance(out.stop_reason, (int, str))
    if out.events is not None:
        assert isinstance(out.events, list)
        for event in out.events:
            assert isinstance(event.type, int) and int(event.type) in (1, 2, 3)
            assert isinstance(event.timestamp, float)
    for name in ("kv_transfer_params", "trace_headers", "prefill_stats"):
        value = getattr(out, name)
        assert value is None or isinstance(value, dict), name
    assert out.routed_experts is None or isinstance(out.routed_experts, np.ndarray)
    nans = out.num_nans_in_logits
    assert isinstance(nans, int) and not isinstance(nans, bool)
