"""Property test: random EngineCoreOutputs -> Encoder -> NativeDecoder == MsgspecDecoder.

Hypothesis draws messages with every field populated or not (logprobs, tensors of every
dtype, inline and aux arrays, utility outputs with any msgpack value, events, finished
sets). Both decoders must give back the message that was encoded.

Checks ``docs/protocol.md`` §5.2-§5.7 and §6 (every output field, every array form).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codec_support import TORCH_DTYPES, check_types, make_decoder, normalize
from corewire import protocol as p
from corewire.codec import Encoder

NUMPY_DTYPES = ["<f2", "<f4", "<f8", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "|b1"]

_shapes = st.one_of(
    st.lists(st.integers(0, 5), min_size=0, max_size=3),
    # Large enough to cross the 256-byte threshold into aux frames.
    st.lists(st.integers(8, 40), min_size=1, max_size=2),
)


def _raw_bytes(draw: Any, nbytes: int, is_bool: bool) -> bytes:
    if is_bool:  # only 0/1 are valid booleans
        return bytes(draw(st.lists(st.integers(0, 1), min_size=nbytes, max_size=nbytes)))
    return draw(st.binary(min_size=nbytes, max_size=nbytes))


@st.composite
def ndarrays(draw: Any, dtypes: list[str] = NUMPY_DTYPES) -> np.ndarray:
    """A C-contiguous ndarray of any wire dtype with arbitrary contents."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    shape = draw(_shapes)
    count = int(np.prod(shape, dtype=np.int64))
    data = _raw_bytes(draw, count * dtype.itemsize, dtype.kind == "b")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


@st.composite
def tensors(draw: Any, dtypes: list[str] | None = None) -> torch.Tensor:
    """A contiguous CPU tensor of any wire dtype (bfloat16 included)."""
    name = draw(st.sampled_from(dtypes or list(TORCH_DTYPES)))
    dtype = TORCH_DTYPES[name]
    shape = draw(_shapes)
    count = int(np.prod(shape, dtype=np.int64))
    data = _raw_bytes(draw, count * dtype.itemsize, dtype == torch.bool)
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


_ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(-40, 300))
_text = st.text(max_size=12)
_scalars = st.one_of(
    st.none(), st.booleans(), _ints, st.floats(allow_nan=True), _text, st.binary(max_size=12)
)
any_values = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(_text, children, max_size=4)
    ),
    max_leaves=12,
)
str_maps = st.dictionaries(_text, any_values, max_size=4)


@st.composite
def logprobs_lists(draw: Any) -> p.LogprobsLists:
    """Sampled-token logprobs: [n, k+1] ids and values, [n] ranks."""
    n, k = draw(st.integers(0, 12)), draw(st.integers(0, 6))
    ids_dtype = draw(st.sampled_from(["<i4", "<i8"]))
    ids = np.frombuffer(draw(st.binary(min_size=n * (k + 1) * 8, max_size=n * (k + 1) * 8)), "<i8")
    values = np.frombuffer(
        draw(st.binary(min_size=n * (k + 1) * 4, max_size=n * (k + 1) * 4)), "<f4"
    )
    ranks = np.arange(n, dtype=ids_dtype)
    cu = draw(st.none() | st.lists(st.integers(0, 2**31), max_size=4))
    return p.LogprobsLists(
        ids.astype(ids_dtype).reshape(n, k + 1), values.reshape(n, k + 1).copy(), ranks, cu
    )


@st.composite
def logprobs_tensors(draw: Any) -> p.LogprobsTensors:
    """Prompt logprobs as tensors."""
    ids = draw(tensors(["int64", "int32"]))
    values = draw(tensors(["float32", "bfloat16", "float16"]))
    ranks = draw(tensors(["int64"]))
    cu = draw(st.none() | st.lists(st.integers(0, 1000), max_size=3))
    return p.LogprobsTensors(ids, values, ranks, cu)


events = st.builds(
    p.EngineCoreEvent,
    st.sampled_from(list(p.EngineCoreEventType)),
    st.floats(allow_nan=False, allow_infinity=False),
)


@st.composite
def engine_core_outputs(draw: Any) -> p.EngineCoreOutput:
    """One EngineCoreOutput, each optional field present or not."""

    def maybe(strategy: Any) -> Any:
        return draw(st.none() | strategy)

    return p.EngineCoreOutput(
        request_id=draw(st.text(max_size=40)),
        new_token_ids=draw(st.lists(_ints, max_size=8)),
        new_logprobs=maybe(logprobs_lists()),
        new_prompt_logprobs_tensors=maybe(logprobs_tensors()),
        pooling_output=maybe(tensors()),
        finish_reason=maybe(st.sampled_from(list(p.FinishReason))),
        stop_reason=maybe(st.one_of(_ints, _text)),
        events=maybe(st.lists(events, max_size=3)),
        kv_transfer_params=maybe(str_maps),
        trace_headers=maybe(st.dictionaries(_text, _text, max_size=3)),
        prefill_stats=maybe(str_maps),
        routed_experts=maybe(ndarrays()),
        num_nans_in_logits=draw(st.integers(0, 2**40)),
    )


utility_outputs = st.builds(
    p.UtilityOutput,
    call_id=st.one_of(st.just(-1), st.integers(0, 2**64 - 1)),
    failure_message=st.none() | st.text(max_size=30),
    result=st.none() | st.builds(p.UtilityResult, any_values),
)

messages = st.builds(
    p.EngineCoreOutputs,
    engine_index=st.integers(0, 2**16),
    outputs=st.lists(engine_core_outputs(), max_size=5),
    scheduler_stats=st.none() | str_maps,
    timestamp=st.floats(allow_nan=True),
    utility_output=st.none() | utility_outputs,
    finished_requests=st.none() | st.sets(st.text(max_size=10), max_size=4),
    wave_complete=st.none() | st.integers(0, 2**63 - 1),
    start_wave=st.none() | st.integers(0, 2**63 - 1),
)


@pytest.fixture(scope="module")
def decoders() -> tuple[Any, Any]:
    """(reference MsgspecDecoder, NativeDecoder)."""
    return make_decoder("msgspec"), make_decoder("native")


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(message=messages, as_memoryview=st.booleans())
def test_native_equals_msgspec(
    decoders: tuple[Any, Any], message: p.EngineCoreOutputs, as_memoryview: bool
) -> None:
    """Encoder -> NativeDecoder gives what MsgspecDecoder gives: the encoded message."""
    reference, native = decoders
    frames = Encoder(release="0.25.1").encode(message)
    convert = memoryview if as_memoryview else bytes
    frames = [convert(f) for f in frames]
    expected = normalize(message)
    got_reference = reference.decode(frames)
    got_native = native.decode(frames)
    check_types(got_native)
    assert normalize(got_native) == normalize(got_reference)
    assert normalize(got_native) == expected


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=messages)
def test_msgspec_round_trip(message: p.EngineCoreOutputs) -> None:
    """The reference decoder alone round-trips (runs even without the native decoder)."""
    decoded = make_decoder("msgspec").decode(Encoder(release="0.25.1").encode(message))
    check_types(decoded)
    assert normalize(decoded) == normalize(message)
