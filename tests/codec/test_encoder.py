"""The Encoder writes exactly vLLM 0.25.1's bytes: requests, request payloads and outputs.

Expected payloads are written as literal bytes or as ``msgspec.msgpack.encode`` of plain
lists and dicts laid out by hand as vLLM 0.25.1's real ``MsgpackEncoder`` writes them
(``test_vllm_wire.py`` checks corewire against that encoder itself); the Encoder is given
``corewire.protocol`` structs. Arrays and tensors under 256 bytes must travel inline as
extension type 3, from 256 bytes on as zero-copy aux frames.

Checks ``docs/protocol.md`` §1 (every positional field written), §4.1-§4.7 (request
frames and payloads), §5.2-§5.6 (outputs) and §6.1-§6.2 (inline or aux).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from codec_support import TORCH_DTYPES, ext, nd, normalize, pack, tensor_bytes
from corewire import protocol as p
from corewire.codec import INLINE_THRESHOLD, RAW_VIEW_EXT, Encoder, MsgspecDecoder

# `SamplingParams(max_tokens=8)` as vLLM writes it. msgspec (hence vLLM) writes a map16
# header for a struct of more than 15 fields, however many of them are omitted as defaults.
# vLLM's SamplingParams turns unset stop / stop_token_ids / bad_words into [] and always
# sets skip_reading_prefix_cache, so those are no longer their defaults and are written.
SP8_PAYLOAD = bytes.fromhex(
    "de0005"  # map16 of 5
    "a473746f7090"  # "stop": []
    "ae73746f705f746f6b656e5f69647390"  # "stop_token_ids": []
    "aa6d61785f746f6b656e7308"  # "max_tokens": 8
    "a96261645f776f72647390"  # "bad_words": []
    "b9736b69705f72656164696e675f7072656669785f6361636865c2"  # skip_reading_prefix_cache
)

# `EngineCoreRequest(request_id="r1", prompt_token_ids=[1, 2],
# sampling_params=SamplingParams(max_tokens=8))`, every one of the 20 fields written: vLLM
# declares the struct with omit_defaults, but msgspec ignores that on array-like structs.
R1_PAYLOAD = (
    bytes.fromhex(
        "dc0014"  # array16 of 20 fields
        "a27231"  # 0 request_id "r1"
        "920102"  # 1 prompt_token_ids [1, 2]
        "c0"  # 2 mm_features nil
    )
    + SP8_PAYLOAD  # 3 sampling_params
    + bytes.fromhex(
        "c0"  # 4 pooling_params nil
        "cb0000000000000000"  # 5 arrival_time 0.0 (float64)
        "c0c0c0c0c0"  # 6-10 lora_request, cache_salt, data_parallel_rank, prompt_embeds, ...
        "000000"  # 11-13 client_index, current_wave, priority
        "c0"  # 14 trace_headers nil
        "c2"  # 15 resumable false
        "c0c0c0"  # 16-18 external_req_id, reasoning_ended, reasoning_parser_kwargs
        "c2"  # 19 abort_immediately false
    )
)


def _raw(payload: bytes) -> object:
    """The payload as plain msgpack data (ext 3 stays an Ext)."""
    return msgspec.msgpack.decode(payload)


# --------------------------------------------------------------------------- requests


def test_request_r1_exact_bytes() -> None:
    """The issue's example request encodes to the spec's 20-field array, byte for byte."""
    request = p.EngineCoreRequest(
        request_id="r1", prompt_token_ids=[1, 2], sampling_params=p.SamplingParams(max_tokens=8)
    )
    frames = Encoder(release="0.25.1").encode(request)
    assert len(frames) == 1
    assert bytes(frames[0]) == R1_PAYLOAD


def test_request_all_fields() -> None:
    """Every EngineCoreRequest field lands at its spec index; prompt_embeds goes to aux."""
    embeds = torch.arange(4 * 64, dtype=torch.float32).reshape(4, 64).bfloat16()  # 512 bytes
    request = p.EngineCoreRequest(
        request_id="req-全",
        prompt_token_ids=[1, 2, 3],
        mm_features=None,
        sampling_params=p.SamplingParams(
            max_tokens=8, temperature=0.5, top_k=5, seed=42, stop_token_ids=[2], logprobs=5
        ),
        pooling_params=p.PoolingParams(dimensions=3),
        arrival_time=1.25,
        lora_request=None,
        cache_salt="salt",
        data_parallel_rank=1,
        prompt_embeds=embeds,
        prompt_is_token_ids=None,
        client_index=2,
        current_wave=3,
        priority=-1,
        trace_headers={"traceparent": "x"},
        resumable=True,
        external_req_id="ext-1",
        reasoning_ended=None,
        reasoning_parser_kwargs=None,
        abort_immediately=True,
    )
    frames = Encoder(release="0.25.1").encode(request)
    expected = [
        "req-全",
        [1, 2, 3],
        None,
        {
            "temperature": 0.5,
            "top_k": 5,
            "seed": 42,
            "stop": [],
            "stop_token_ids": [2],
            "max_tokens": 8,
            "logprobs": 5,
            "_all_stop_token_ids": [2],
            "bad_words": [],
            "skip_reading_prefix_cache": False,
        },
        [None, 3, None, None, None, False, None, None, None, 2],
        1.25,
        None,
        "salt",
        1,
        ["bfloat16", [4, 64], 1],
        None,
        2,
        3,
        -1,
        {"traceparent": "x"},
        True,
        "ext-1",
        None,
        None,
        True,
    ]
    assert _raw(frames[0]) == expected
    assert len(frames) == 2
    assert bytes(frames[1]) == tensor_bytes(embeds)
    # Zero copy: the aux frame is the tensor's own memory.
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), embeds.view(torch.uint8).numpy())


# What vLLM's SamplingParams writes for unset stop / stop_token_ids / bad_words and
# skip_reading_prefix_cache: its __post_init__ moves them off their defaults.
UNSET = {"stop": [], "stop_token_ids": [], "bad_words": [], "skip_reading_prefix_cache": False}


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (p.SamplingParams(), UNSET),
        (p.SamplingParams(max_tokens=16, top_k=0, n=1), UNSET),
        (p.SamplingParams(seed=None, stop_token_ids=None, ignore_eos=False, min_tokens=0), UNSET),
        (p.SamplingParams(seed=-1, thinking_token_budget=-1), UNSET),  # -1 means unset
        (p.SamplingParams(max_tokens=None), {**UNSET, "max_tokens": None}),
        (
            p.SamplingParams(ignore_eos=True, min_tokens=2),
            {**UNSET, "ignore_eos": True, "min_tokens": 2},
        ),
        (p.SamplingParams(logprobs=0, seed=0), {**UNSET, "seed": 0, "logprobs": 0}),
        (p.SamplingParams(logprobs=True), {**UNSET, "logprobs": 1}),
        (p.SamplingParams(n=2, top_p=0.9), {**UNSET, "n": 2, "top_p": 0.9}),
        # Greedy: top_p / top_k / min_p are reset to their defaults, so not written.
        (
            p.SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2),
            {**UNSET, "temperature": 0.0},
        ),
        (p.SamplingParams(temperature=0.001), {**UNSET, "temperature": 0.01}),
        (
            p.SamplingParams(stop="abc", stop_token_ids=[7]),
            {
                **UNSET,
                "stop": ["abc"],
                "stop_token_ids": [7],
                "output_text_buffer_length": 2,
                "_all_stop_token_ids": [7],
            },
        ),
        (
            p.SamplingParams(stop=["abc"], include_stop_str_in_output=True),
            {**UNSET, "stop": ["abc"], "include_stop_str_in_output": True},
        ),
        (
            p.SamplingParams(prompt_logprobs=2),
            {**UNSET, "prompt_logprobs": 2, "skip_reading_prefix_cache": True},
        ),
        (
            p.SamplingParams(eos_token_id=2, all_stop_token_ids={2}, output_kind=1),
            {**UNSET, "output_kind": 1, "_eos_token_id": 2, "_all_stop_token_ids": [2]},
        ),
        (
            p.SamplingParams(logit_bias={5: -1.5}, bad_words=["x"]),
            {**UNSET, "logit_bias": {5: -1.5}, "bad_words": ["x"]},
        ),
    ],
)
def test_sampling_params_is_a_map_without_defaults(
    params: p.SamplingParams, expected: dict
) -> None:
    """SamplingParams is a map keyed by field name; default-valued fields are omitted.

    (msgspec, and so vLLM, omits a float only when it is the default object itself: an
    explicit ``temperature=1.0`` is written. Decoders take either form.)
    """
    payload = Encoder(release="0.25.1").encode(params)[0]
    assert _raw(payload) == expected
    assert bytes(payload)[:3] == b"\xde\x00" + bytes([len(expected)])


def test_sampling_params_exact_bytes() -> None:
    """``SamplingParams(max_tokens=8)`` exactly as vLLM writes it."""
    payload = Encoder(release="0.25.1").encode(p.SamplingParams(max_tokens=8))[0]
    assert bytes(payload) == SP8_PAYLOAD
    assert bytes(payload).startswith(b"\xde\x00\x05\xa4stop\x90\xaestop_token_ids\x90")


def test_sampling_params_explicit_default_float_is_written() -> None:
    """An explicit ``temperature=1.0`` is written; the default object is not."""
    explicit = float("1.0")
    assert _raw(Encoder(release="0.25.1").encode(p.SamplingParams(temperature=explicit))[0]) == {
        **UNSET,
        "temperature": 1.0,
    }


def test_pooling_params_bytes() -> None:
    """PoolingParams is positional like vLLM's: 10 fields, output_kind 2 (final only)."""
    assert bytes(Encoder(release="0.25.1").encode(p.PoolingParams())[0]) == (
        b"\x9a" + b"\xc0" * 5 + b"\xc2" + b"\xc0" * 3 + b"\x02"
    )
    params = p.PoolingParams(normalize=True, dimensions=3, task="embed", extra_kwargs={"a": 1})
    assert bytes(Encoder(release="0.25.1").encode(params)[0]) == (
        b"\x9a\xc3\x03\xc0\xc0\xa5embed\xc2\xc0\xc0\x81\xa1a\x01\x02"
    )
    assert params.use_activation is True


def test_abort_payload() -> None:
    """ABORT carries an array of request-id strings."""
    assert p.EngineCoreRequestType.ABORT.value == b"\x01"
    assert [bytes(f) for f in Encoder(release="0.25.1").encode(["r1", "r2"])] == [
        b"\x92\xa2r1\xa2r2"
    ]
    assert bytes(Encoder(release="0.25.1").encode(["ü"])[0]) == b"\x91\xa2\xc3\xbc"


@pytest.mark.parametrize(
    ("call_id", "call_id_bytes"),
    [
        (0, b"\x00"),
        (2**63, b"\xcf\x80" + bytes(7)),
        (2**64 - 1, b"\xcf" + b"\xff" * 8),
        (-1, b"\xff"),
        (300, b"\xcd\x01\x2c"),
    ],
)
def test_utility_payload(call_id: int, call_id_bytes: bytes) -> None:
    """UTILITY is ``[client_index, call_id, method, args]``; call ids are 64-bit."""
    assert p.EngineCoreRequestType.UTILITY.value == b"\x03"
    frames = Encoder(release="0.25.1").encode((1, call_id, "get_stats", ()))
    assert bytes(frames[0]) == b"\x94\x01" + call_id_bytes + b"\xa9get_stats\x90"
    args = Encoder(release="0.25.1").encode((0, call_id, "add_lora", ("name", 3, [1.5])))[0]
    assert _raw(args) == [0, call_id, "add_lora", ["name", 3, [1.5]]]


def test_start_dp_wave_payload() -> None:
    """START_DP_WAVE is ``[new_wave, exclude_engine_index]``."""
    assert p.EngineCoreRequestType.START_DP_WAVE.value == b"\x02"
    assert bytes(Encoder(release="0.25.1").encode((3, 1))[0]) == b"\x92\x03\x01"


def test_request_type_bytes() -> None:
    """The request-type frame is one byte: ADD 0x00 ... UTILITY 0x03."""
    values = [t.value for t in p.EngineCoreRequestType]
    assert values[:4] == [b"\x00", b"\x01", b"\x02", b"\x03"]
    assert all(len(v) == 1 for v in values)


# --------------------------------------------------------------------------- outputs


def test_outputs_exact_bytes() -> None:
    """A full EngineCoreOutputs encodes to the hand-laid spec array, aux frames included."""
    lp = p.LogprobsLists(
        np.array([[5, 1]], dtype="<i4"), np.array([[-0.5, -1.0]], dtype="<f4"), np.array([0], "<i4")
    )
    prompt = p.LogprobsTensors(
        torch.arange(64, dtype=torch.int64), -torch.ones(64), torch.zeros(64, dtype=torch.int64)
    )
    pooling = torch.tensor([1.0, -2.0]).bfloat16()
    experts = np.arange(128, dtype="<i4").reshape(32, 4)  # 512 bytes: aux
    outs = p.EngineCoreOutputs(
        engine_index=1,
        outputs=[
            p.EngineCoreOutput(
                "r",
                [7, 8],
                new_logprobs=lp,
                new_prompt_logprobs_tensors=prompt,
                pooling_output=pooling,
                finish_reason=p.FinishReason.ABORT,
                stop_reason="eos",
                events=[p.EngineCoreEvent(p.EngineCoreEventType.PREEMPTED, 3.5)],
                kv_transfer_params={"k": 1},
                trace_headers={"t": "v"},
                prefill_stats={"s": 2.5},
                routed_experts=experts,
                num_nans_in_logits=2,
            )
        ],
        scheduler_stats={"num_running_reqs": 1},
        timestamp=99.25,
        utility_output=p.UtilityOutput(2**64 - 1, None, p.UtilityResult({"ok": [1]})),
        finished_requests={"done"},
        wave_complete=3,
        start_wave=None,
    )
    frames = Encoder(release="0.25.1").encode(outs)
    expected = pack(
        [
            1,
            [
                [
                    "r",
                    [7, 8],
                    [
                        nd("<i4", [1, 2], ext(lp[0].tobytes())),
                        nd("<f4", [1, 2], ext(lp[1].tobytes())),
                        nd("<i4", [1], ext(lp[2].tobytes())),
                        None,
                    ],
                    [nd("int64", [64], 1), nd("float32", [64], 2), nd("int64", [64], 3), None],
                    nd("bfloat16", [2], ext(b"\x80\x3f\x00\xc0")),
                    2,
                    "eos",
                    [{"type": 3, "timestamp": 3.5}],
                    {"k": 1},
                    {"t": "v"},
                    {"s": 2.5},
                    nd("<i4", [32, 4], 4),
                    2,
                ]
            ],
            {"num_running_reqs": 1},
            99.25,
            [2**64 - 1, None, [None, {"ok": [1]}]],
            ["done"],
            3,
            None,
        ]
    )
    assert bytes(frames[0]) == expected
    assert [bytes(f) for f in frames[1:]] == [
        tensor_bytes(prompt[0]),
        tensor_bytes(prompt[1]),
        tensor_bytes(prompt[2]),
        experts.tobytes(),
    ]
    # And it decodes back to what was encoded.
    assert normalize(MsgspecDecoder(p.EngineCoreOutputs).decode(frames)) == normalize(outs)


def test_outputs_default_fields_are_written() -> None:
    """Encoders write every field, defaults included.

    vLLM 0.25.1 declares EngineCoreOutputs and EngineCoreOutput with omit_defaults, but
    msgspec ignores that option on array-like structs: vLLM writes every field too.
    """
    frames = Encoder(release="0.25.1").encode(
        p.EngineCoreOutputs(outputs=[p.EngineCoreOutput("r", [])])
    )
    assert bytes(frames[0]) == (
        b"\x98\x00\x91\x9d\xa1r\x90" + b"\xc0" * 10 + b"\x00" + b"\xc0\xcb" + bytes(8) + b"\xc0" * 4
    )


# --------------------------------------------------------------------------- inline vs aux


def _experts_frames(array: np.ndarray) -> list:
    outs = p.EngineCoreOutputs(outputs=[p.EngineCoreOutput("r", [], routed_experts=array)])
    return Encoder(release="0.25.1").encode(outs)


def test_threshold_constants() -> None:
    """Inline arrays are ext type 3; the threshold is 256 bytes."""
    assert RAW_VIEW_EXT == 3
    assert INLINE_THRESHOLD == 256


def test_ndarray_255_bytes_inline() -> None:
    """255 bytes travel inline: ext8 header ``c7 ff 03`` then the raw bytes."""
    array = np.arange(255, dtype=np.uint8)
    frames = _experts_frames(array)
    assert len(frames) == 1
    assert b"\xa3|u1\x91\xcc\xff\xc7\xff\x03" + array.tobytes() in bytes(frames[0])


def test_ndarray_256_bytes_aux() -> None:
    """256 bytes go to aux frame 1, referenced by the int 1, as a zero-copy view."""
    array = np.arange(256, dtype=np.uint8)
    frames = _experts_frames(array)
    assert len(frames) == 2
    assert b"\x93\xa3|u1\x91\xcd\x01\x00\x01" in bytes(frames[0])
    assert bytes(frames[1]) == array.tobytes()
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), array)


@pytest.mark.parametrize(
    ("dtype", "count", "aux"),
    [
        (torch.float32, 63, False),
        (torch.float32, 64, True),
        (torch.bfloat16, 127, False),
        (torch.bfloat16, 128, True),
        (torch.uint8, 255, False),
        (torch.uint8, 256, True),
        (torch.int64, 31, False),
        (torch.int64, 32, True),
    ],
)
def test_tensor_threshold(dtype: torch.dtype, count: int, aux: bool) -> None:
    """Tensors follow the same 256-byte rule, counted in bytes, not elements."""
    tensor = torch.arange(count).to(dtype)
    outs = p.EngineCoreOutputs(outputs=[p.EngineCoreOutput("r", [], pooling_output=tensor)])
    frames = Encoder(release="0.25.1").encode(outs)
    name = str(dtype).removeprefix("torch.")
    pooling = _raw(frames[0])[1][0][4]  # type: ignore[index]
    if aux:
        assert pooling == [name, [count], 1]
        assert bytes(frames[1]) == tensor_bytes(tensor)
    else:
        assert len(frames) == 1
        assert pooling == [name, [count], ext(tensor_bytes(tensor))]


@pytest.mark.parametrize("threshold", [0, 1, 16, 2**40])
def test_custom_inline_threshold(threshold: int) -> None:
    """``Encoder(inline_threshold=n)`` inlines exactly the arrays smaller than n bytes."""
    arrays = [np.zeros(n, dtype=np.uint8) for n in (0, 1, 15, 16, 17, 300)]
    outs = p.EngineCoreOutputs(
        outputs=[p.EngineCoreOutput(f"r{i}", [], routed_experts=a) for i, a in enumerate(arrays)]
    )
    # 0.25.1's layout, whatever vLLM is installed: routed_experts is its field 11.
    frames = Encoder(inline_threshold=threshold, release="0.25.1").encode(outs)
    refs = [o[11][2] for o in _raw(frames[0])[1]]  # type: ignore[index]
    aux_index = 1
    for array, ref in zip(arrays, refs, strict=True):
        if array.nbytes < threshold:
            assert ref == ext(array.tobytes())
        else:
            assert ref == aux_index
            aux_index += 1
    assert len(frames) == aux_index


# --------------------------------------------------------------------------- dtypes


_ALL_TORCH_DTYPES = [
    *TORCH_DTYPES.values(),
    torch.complex64,
    torch.complex128,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.mark.parametrize("dtype", _ALL_TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("count", [3, 200])
def test_tensor_every_dtype(dtype: torch.dtype, count: int) -> None:
    """Every torch dtype encodes as ``[name, shape, raw bytes]`` and decodes back."""
    tensor = torch.arange(count * 2).reshape(count, 2).to(torch.float32).to(dtype)
    outs = p.EngineCoreOutputs(outputs=[p.EngineCoreOutput("r", [], pooling_output=tensor)])
    frames = Encoder(release="0.25.1").encode(outs)
    name, shape, data = _raw(frames[0])[1][0][4]  # type: ignore[index,misc]
    assert name == str(dtype).removeprefix("torch.")
    assert shape == [count, 2]
    raw = data.data if isinstance(data, msgspec.msgpack.Ext) else bytes(frames[data])
    assert raw == tensor_bytes(tensor)
    decoded = MsgspecDecoder(p.EngineCoreOutputs).decode(frames)
    assert normalize(decoded) == normalize(outs)


@pytest.mark.parametrize(
    "dtype", ["<f2", "<f4", "<f8", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "|b1"]
)
def test_ndarray_dtype_strings(dtype: str) -> None:
    """ndarrays carry numpy's ``dtype.str``."""
    array = np.ones((2, 3), dtype=dtype)
    name, shape, data = _raw(_experts_frames(array)[0])[1][0][11]  # type: ignore[index,misc]
    assert (name, shape, data) == (dtype, [2, 3], ext(array.tobytes()))


def test_zero_size_and_scalar() -> None:
    """Zero-size arrays are an empty ext 3; 0-dim tensors have shape ``[]``."""
    empty = np.zeros((0, 4), dtype="<f4")
    assert _raw(_experts_frames(empty)[0])[1][0][11] == ["<f4", [0, 4], ext(b"")]  # type: ignore[index]
    assert b"\xc7\x00\x03" in bytes(_experts_frames(empty)[0])
    scalar = torch.tensor(2.0)
    outs = p.EngineCoreOutputs(outputs=[p.EngineCoreOutput("r", [], pooling_output=scalar)])
    pooling = _raw(Encoder(release="0.25.1").encode(outs)[0])[1][0][4]  # type: ignore[index]
    assert pooling == ["float32", [], ext(tensor_bytes(scalar))]


def test_non_contiguous_inputs_are_sent_in_c_order() -> None:
    """Transposed or strided arrays and tensors are sent as C-contiguous data."""
    array = np.arange(200, dtype="<i4").reshape(10, 20).T  # 800 bytes, Fortran order
    frames = _experts_frames(array)
    assert _raw(frames[0])[1][0][11] == ["<i4", [20, 10], 1]  # type: ignore[index]
    assert bytes(frames[1]) == np.ascontiguousarray(array).tobytes()
    tensor = torch.arange(20.0).reshape(4, 5)[:, ::2]
    outs = p.EngineCoreOutputs(outputs=[p.EngineCoreOutput("r", [], pooling_output=tensor)])
    pooling = _raw(Encoder(release="0.25.1").encode(outs)[0])[1][0][4]  # type: ignore[index]
    assert pooling == ["float32", [4, 3], ext(tensor.contiguous().numpy().tobytes())]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_is_copied_to_host() -> None:
    """CUDA tensors are copied to host memory and always sent as aux frames (as vLLM)."""
    host = torch.arange(300, dtype=torch.float32).bfloat16()
    small = torch.arange(3, dtype=torch.float32)  # 12 bytes: inline on CPU, aux on CUDA
    frames = Encoder(release="0.25.1").encode(
        p.EngineCoreOutputs(
            outputs=[
                p.EngineCoreOutput("r", [], pooling_output=host.cuda()),
                p.EngineCoreOutput("s", [], pooling_output=small.cuda()),
            ]
        )
    )
    assert _raw(frames[0])[1][0][4] == ["bfloat16", [300], 1]  # type: ignore[index]
    assert _raw(frames[0])[1][1][4] == ["float32", [3], 2]  # type: ignore[index]
    assert bytes(frames[1]) == tensor_bytes(host)
    assert bytes(frames[2]) == tensor_bytes(small)


@pytest.mark.parametrize("threshold", [0, 1, 8])
def test_zero_dim_ndarray_always_inline(threshold: int) -> None:
    """A 0-d ndarray travels inline whatever the threshold (vLLM's rule); 1-d ones do not."""
    scalar = np.full((), 2.5, dtype="<f8")
    vector = np.full((1,), 2.5, dtype="<f8")
    frames = Encoder(inline_threshold=threshold).encode([scalar, vector])
    raw = _raw(frames[0])
    assert raw[0] == ["<f8", [], ext(scalar.tobytes())]  # type: ignore[index]
    assert raw[1] == ["<f8", [1], 1]  # type: ignore[index]
    assert len(frames) == 2


def test_void_ndarray_refused() -> None:
    """Structured (void) arrays have no wire form (vLLM would pickle them)."""
    with pytest.raises(TypeError, match="pickled"):
        Encoder(release="0.25.1").encode(np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")]))


# --------------------------------------------------------------------------- misuse


@pytest.mark.parametrize(
    "bad",
    [object(), np.array([object()]), complex(1, 2), [1, object()], {"k": object()}],
    ids=["object", "object_array", "complex", "list_with_object", "dict_with_object"],
)
def test_unencodable_objects_raise_type_error(bad: object) -> None:
    """Nothing is pickled: objects with no wire form raise TypeError.

    The encoder is reusable afterwards and carries no aux frame over from the failure.
    """
    encoder = Encoder(release="0.25.1")
    with pytest.raises(TypeError):
        encoder.encode([np.zeros(300, np.uint8), bad])
    frames = encoder.encode(_big_outputs())
    assert len(frames) == 2
    assert _raw(frames[0])[1][0][11][2] == 1  # type: ignore[index]


def _big_outputs() -> p.EngineCoreOutputs:
    array = np.arange(100, dtype="<i4")
    return p.EngineCoreOutputs(outputs=[p.EngineCoreOutput("r", [], routed_experts=array)])


def test_encode_into_reuses_the_buffer() -> None:
    """``encode_into`` writes the payload into the given bytearray; aux frames follow."""
    encoder = Encoder(release="0.25.1")
    buf = bytearray(b"stale contents that must disappear")
    frames = encoder.encode_into(_big_outputs(), buf)
    assert frames[0] is buf
    assert bytes(buf) == bytes(encoder.encode(_big_outputs())[0])
    assert bytes(frames[1]) == np.arange(100, dtype="<i4").tobytes()
    small = encoder.encode_into(p.EngineCoreOutputs(engine_index=4), buf)
    assert len(small) == 1
    assert _raw(bytes(buf))[0] == 4  # type: ignore[index]


def test_utility_result_and_sets() -> None:
    """UtilityResult encodes as ``[nil, value]``; sets encode as arrays."""
    encoder = Encoder(release="0.25.1")
    assert _raw(encoder.encode(p.UtilityResult({"a": 1}))[0]) == [None, {"a": 1}]
    assert _raw(encoder.encode(p.UtilityResult())[0]) == [None, None]
    assert sorted(_raw(encoder.encode({"x", "y"})[0])) == ["x", "y"]  # type: ignore[type-var]
    assert _raw(encoder.encode(frozenset({"z"}))[0]) == ["z"]
