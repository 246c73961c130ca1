"""corewire.protocol: field order, defaults and enums of every wire type (docs/protocol.md).

The index of a field of a positional (``array_like``) struct is part of the wire format,
so the field lists below are copied from ``docs/protocol.md`` (§4.2, §4.3.1, §5) and compared with
the structs. Requests are also decoded from hand-built arrays (short, long, with unknown
sampling keys) the way an engine receives them.

Checks ``docs/protocol.md`` §1 (short and long positional arrays), §4.1 (request type
bytes), §4.2-§4.4, §5.2-§5.6 (field order and defaults) and §7 (``ENGINE_CORE_DEAD``).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from codec_support import (
    LOGPROBS_LISTS_FIELDS,
    LOGPROBS_TENSORS_FIELDS,
    OUTPUT_FIELDS,
    OUTPUTS_FIELDS,
    UTILITY_FIELDS,
    ext,
    nd,
    pack,
)
from corewire import ProtocolError
from corewire import protocol as p
from corewire.codec import Encoder, MsgspecDecoder

REQUEST_FIELDS = (
    "request_id",
    "prompt_token_ids",
    "mm_features",
    "sampling_params",
    "pooling_params",
    "arrival_time",
    "lora_request",
    "cache_salt",
    "data_parallel_rank",
    "prompt_embeds",
    "prompt_is_token_ids",
    "client_index",
    "current_wave",
    "priority",
    "trace_headers",
    "resumable",
    "external_req_id",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "abort_immediately",
)


@pytest.mark.parametrize(
    ("struct", "fields"),
    [
        (p.EngineCoreRequest, REQUEST_FIELDS),
        (p.EngineCoreOutputs, OUTPUTS_FIELDS),
        (p.EngineCoreOutput, OUTPUT_FIELDS),
        (p.UtilityOutput, UTILITY_FIELDS),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_positional_structs_follow_spec_order(struct: Any, fields: tuple[str, ...]) -> None:
    """Positional wire structs have exactly the spec's fields, in the spec's order."""
    assert struct.__struct_fields__ == fields
    assert struct.__struct_config__.array_like is True


def test_named_tuples_follow_spec_order() -> None:
    """LogprobsLists / LogprobsTensors are named tuples (arrays) in the spec's order."""
    assert p.LogprobsLists._fields == LOGPROBS_LISTS_FIELDS
    assert p.LogprobsTensors._fields == LOGPROBS_TENSORS_FIELDS
    assert issubclass(p.LogprobsLists, tuple)


def test_map_structs() -> None:
    """SamplingParams and EngineCoreEvent are maps, SamplingParams without defaults.

    PoolingParams is positional, as vLLM 0.25.1's (every field written).
    """
    for struct in (p.SamplingParams, p.EngineCoreEvent):
        assert struct.__struct_config__.array_like is False
    assert p.SamplingParams.__struct_config__.omit_defaults is True
    assert p.PoolingParams.__struct_config__.array_like is True
    assert p.EngineCoreEvent.__struct_fields__ == ("type", "timestamp")


def test_request_by_keyword_with_defaults() -> None:
    """The issue's example builds by keyword; every other field has its spec default."""
    request = p.EngineCoreRequest(
        request_id="r1", prompt_token_ids=[1, 2], sampling_params=p.SamplingParams(max_tokens=8)
    )
    assert request.request_id == "r1"
    assert request.prompt_token_ids == [1, 2]
    assert request.sampling_params is not None
    assert request.sampling_params.max_tokens == 8
    defaults = {
        "mm_features": None,
        "pooling_params": None,
        "arrival_time": 0.0,
        "lora_request": None,
        "cache_salt": None,
        "data_parallel_rank": None,
        "prompt_embeds": None,
        "prompt_is_token_ids": None,
        "client_index": 0,
        "current_wave": 0,
        "priority": 0,
        "trace_headers": None,
        "resumable": False,
        "external_req_id": None,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "abort_immediately": False,
    }
    assert {name: getattr(request, name) for name in defaults} == defaults
    with pytest.raises(TypeError):
        p.EngineCoreRequest("r1")  # type: ignore[misc]  # keyword-only


def test_sampling_params_defaults() -> None:
    """The keys an engine must honour default as docs/protocol.md says."""
    params = p.SamplingParams()
    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert params.top_k == 0
    assert params.top_p == 1.0
    assert params.seed is None
    assert params.stop_token_ids == []  # vLLM writes unset stop_token_ids as []
    assert params.ignore_eos is False
    assert params.min_tokens == 0
    assert params.logprobs is None
    assert params.n == 1


def test_output_defaults() -> None:
    """EngineCoreOutputs / EngineCoreOutput / UtilityOutput defaults."""
    outs = p.EngineCoreOutputs()
    assert (outs.engine_index, outs.outputs, outs.timestamp) == (0, [], 0.0)
    assert outs.scheduler_stats is None and outs.utility_output is None
    assert outs.finished_requests is None
    assert outs.wave_complete is None and outs.start_wave is None
    assert p.EngineCoreOutputs().outputs is not outs.outputs  # no shared mutable default
    out = p.EngineCoreOutput("r", [1])
    assert out.num_nans_in_logits == 0
    assert all(getattr(out, name) is None for name in OUTPUT_FIELDS[2:12])
    util = p.UtilityOutput(5)
    assert (util.call_id, util.failure_message, util.result) == (5, None, None)


def test_finish_reason_values() -> None:
    """finish_reason: 0 stop, 1 length, 2 abort, 3 error, 4 repetition; str is the name."""
    assert [(r.name, int(r)) for r in p.FinishReason] == [
        ("STOP", 0),
        ("LENGTH", 1),
        ("ABORT", 2),
        ("ERROR", 3),
        ("REPETITION", 4),
    ]
    assert str(p.FinishReason.ABORT) == "abort"


def test_event_types() -> None:
    """Event types: 1 queued, 2 scheduled, 3 preempted."""
    assert [(t.name, int(t)) for t in p.EngineCoreEventType] == [
        ("QUEUED", 1),
        ("SCHEDULED", 2),
        ("PREEMPTED", 3),
    ]


def test_request_types() -> None:
    """Request types are single bytes; 0x04 and 0x05 are engine-internal."""
    assert {t.name: t.value for t in p.EngineCoreRequestType} == {
        "ADD": b"\x00",
        "ABORT": b"\x01",
        "START_DP_WAVE": b"\x02",
        "UTILITY": b"\x03",
        "EXECUTOR_FAILED": b"\x04",
        "WAKEUP": b"\x05",
    }
    assert p.EngineCoreRequestType(b"\x03") is p.EngineCoreRequestType.UTILITY
    assert p.ENGINE_CORE_DEAD == b"ENGINE_CORE_DEAD"


def test_elastic_scaling_notifications() -> None:
    """Notifications are utility outputs with call_id -1 and a ``[kind, rank]`` result;
    the kinds are strings, equal to (and encoded as) their values."""
    assert p.EEP_NOTIFICATION_CALL_ID == -1
    assert {t.name: t.value for t in p.EEPNotificationType} == {
        "NEW_CORE_ENGINES_INIT_READY": "NEW_CORE_ENGINES_INIT_READY",
        "NEW_CORE_ENGINES_WEIGHTS_INIT_READY": "NEW_CORE_ENGINES_WEIGHTS_INIT_READY",
        "RECONFIGURE_FINISHED": "RECONFIGURE_FINISHED",
        "SHUTDOWN_COMPLETE": "SHUTDOWN_COMPLETE",
    }
    assert p.EEPNotificationType.SHUTDOWN_COMPLETE == "SHUTDOWN_COMPLETE"


def test_utility_result() -> None:
    """UtilityResult holds ``.result``, compares by value and is not hashable."""
    assert p.UtilityResult().result is None
    assert p.UtilityResult([1]) == p.UtilityResult([1])
    assert p.UtilityResult([1]) != p.UtilityResult([2])
    assert p.UtilityResult(1) != 1
    assert repr(p.UtilityResult("x")) == "UtilityResult('x')"
    with pytest.raises(TypeError):
        hash(p.UtilityResult())


def test_finished_property() -> None:
    """``EngineCoreOutput.finished`` is true exactly when a finish reason is set."""
    assert not p.EngineCoreOutput("r", []).finished
    assert p.EngineCoreOutput("r", [], finish_reason=p.FinishReason.STOP).finished


def test_sampling_params_from_map() -> None:
    """An engine decodes sampling params from a map; unknown keys are ignored."""
    decoder = msgspec.msgpack.Decoder(p.SamplingParams)
    params = decoder.decode(pack({"max_tokens": 3, "future_key": [1, 2], "temperature": 0}))
    assert params.max_tokens == 3
    assert params.temperature == 0.0
    assert params.top_p == 1.0
    assert decoder.decode(pack({})) == p.SamplingParams()


# --------------------------------------------------------------------------- requests


def _request_wire(length: int = 20, extra: tuple[Any, ...] = ()) -> list[Any]:
    full = [
        "req",
        [5, 6],
        None,
        {"max_tokens": 4, "seed": 9, "unknown": "ignored"},
        None,
        7.5,
        None,
        "salt",
        2,
        nd("float16", [2], ext(b"\x00\x3c\x00\xc0")),
        None,
        1,
        4,
        3,
        {"traceparent": "t"},
        True,
        "ext",
        None,
        None,
        True,
    ]
    return [*full[:length], *extra]


def test_request_decodes_from_full_array() -> None:
    """A hand-built 20-field request decodes field by field."""
    request = MsgspecDecoder(p.EngineCoreRequest).decode([pack(_request_wire())])
    assert request.request_id == "req"
    assert request.prompt_token_ids == [5, 6]
    assert request.sampling_params == p.SamplingParams(max_tokens=4, seed=9)
    assert request.arrival_time == 7.5
    assert (request.cache_salt, request.data_parallel_rank) == ("salt", 2)
    assert request.prompt_embeds.dtype == torch.float16
    assert request.prompt_embeds.tolist() == [1.0, -2.0]
    assert (request.client_index, request.current_wave, request.priority) == (1, 4, 3)
    assert request.trace_headers == {"traceparent": "t"}
    assert request.resumable is True and request.abort_immediately is True
    assert request.external_req_id == "ext"


def test_request_short_array_takes_defaults() -> None:
    """Fields after index 8 may be absent: they take their defaults."""
    request = MsgspecDecoder(p.EngineCoreRequest).decode([pack(_request_wire(9))])
    assert request.data_parallel_rank == 2
    assert request.prompt_embeds is None
    assert (request.client_index, request.current_wave, request.priority) == (0, 0, 0)
    assert request.resumable is False and request.abort_immediately is False


def test_request_long_array_ignores_extra_fields() -> None:
    """A newer front-end's extra trailing fields are ignored."""
    wire = _request_wire(extra=("new field", {"x": 1}, [1, 2]))
    request = MsgspecDecoder(p.EngineCoreRequest).decode([pack(wire)])
    assert request.abort_immediately is True


def test_request_round_trip_with_aux_tensor() -> None:
    """Encoder -> MsgspecDecoder gives back an equal request, prompt_embeds via aux."""
    embeds = torch.randn(8, 16).bfloat16()
    request = p.EngineCoreRequest(
        request_id="rt",
        prompt_token_ids=None,
        sampling_params=p.SamplingParams(logprobs=2),
        prompt_embeds=embeds,
        priority=5,
    )
    frames = Encoder(release="0.25.1").encode(request)
    assert len(frames) == 2
    decoded = MsgspecDecoder(p.EngineCoreRequest).decode(frames)
    assert torch.equal(decoded.prompt_embeds, embeds)
    assert msgspec.structs.replace(decoded, prompt_embeds=None) == msgspec.structs.replace(
        request, prompt_embeds=None
    )


@pytest.mark.parametrize(
    "wire",
    [
        [5],
        [],
        ["r", "not tokens"],
        ["r", None, None, "not a map"],
        ["r", None, None, None, None, "now"],
        ["r", None, None, None, None, 0.0, None, None, None, nd("float16", [3], ext(bytes(4)))],
    ],
    ids=["int_request_id", "empty", "tokens_str", "sampling_str", "arrival_str", "embeds_size"],
)
def test_malformed_request_raises_protocol_error(wire: list[Any]) -> None:
    """The engine side's decoder reports malformed requests as ProtocolError."""
    with pytest.raises(ProtocolError):
        MsgspecDecoder(p.EngineCoreRequest).decode([pack(wire)])


def test_outputs_struct_round_trip() -> None:
    """A protocol struct with arrays survives Encoder -> MsgspecDecoder unchanged."""
    array = np.arange(12, dtype="<i4").reshape(3, 4)
    outs = p.EngineCoreOutputs(
        outputs=[p.EngineCoreOutput("r", [1], routed_experts=array)],
        finished_requests={"r"},
    )
    decoded = MsgspecDecoder(p.EngineCoreOutputs).decode(Encoder(release="0.25.1").encode(outs))
    assert np.array_equal(decoded.outputs[0].routed_experts, array)
    assert decoded.finished_requests == {"r"}


@pytest.mark.parametrize("index", [0, 1, 255, 256, 65535])
def test_engine_identity_is_two_little_endian_bytes(index: int) -> None:
    """§2: an engine's identity is its index as 2 bytes, little-endian, and reads back."""
    identity = p.engine_identity(index)
    assert identity == bytes([index & 0xFF, index >> 8])
    assert p.engine_index_of(identity) == index


def test_engine_identity_past_two_bytes_is_refused() -> None:
    with pytest.raises(OverflowError):
        p.engine_identity(65536)


@pytest.mark.parametrize("method", ["add_lora", "collective_rpc", "a method with spaces"])
def test_utility_failure_text_names_its_method(method: str) -> None:
    """§5.6: the failure message is vLLM's ``Call to <method> method failed: <error>``,
    and the method reads back out of it; other texts name none."""
    text = p.utility_failure_text(method, ValueError("no: not here"))
    assert text == f"Call to {method} method failed: no: not here"
    assert p.failed_method(text) == method
    for other in ("boom", "Engine Call to x method failed", "Call to x failed", ""):
        assert p.failed_method(other) is None


def test_field_position_is_the_wire_index() -> None:
    """The positions code reads out of undecoded payloads are the structs' own."""
    assert p.field_position(p.EngineCoreOutputs, "outputs") == 1
    assert p.field_position(p.EngineCoreOutputs, "utility_output") == 4
    assert p.field_position(p.EngineCoreOutput, "request_id") == 0
    assert p.field_position(p.UtilityOutput, "call_id") == 0
    assert p.field_position(p.EngineCoreRequest, "client_index") == 11
    with pytest.raises(ValueError):
        p.field_position(p.EngineCoreOutputs, "no_such_field")


def test_utility_call_encodes_as_the_plain_wire_array() -> None:
    """§4.6: the named payload writes the same bytes as ``[client_index, call_id, method,
    args]``."""
    call = p.UtilityCall(1, 7, "echo", ("x", 2))
    assert msgspec.msgpack.encode(call) == msgspec.msgpack.encode([1, 7, "echo", ["x", 2]])


def test_finished_outputs_end_each_request_once() -> None:
    out = p.finished_outputs(["a", "b"], p.FinishReason.ABORT, engine_index=3)
    assert out.engine_index == 3 and out.timestamp > 0
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in out.outputs] == [
        ("a", [], p.FinishReason.ABORT),
        ("b", [], p.FinishReason.ABORT),
    ]
    assert out.finished_requests == {"a", "b"}
