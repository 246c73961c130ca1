"""vLLM 0.33.0's own frames, checked in (``tests/data/vllm-0.33.0``), through corewire.

The frames were written by vLLM 0.33.0's ``MsgpackEncoder`` and ``expected.json`` holds
what vLLM 0.33.0's ``MsgpackDecoder`` made of them (``make_golden.py`` beside them
regenerates both). Here, with vLLM 0.25.1 installed, ``NativeDecoder(release="0.33.0")``
must decode each to exactly those values, field by field; ``Encoder(release="0.33.0")``
must write them back byte for byte; and a decoder of the other version must refuse every
frame that carries request outputs (docs/protocol.md, "Versions", for the frames that do
decode under both).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from corewire import ProtocolError, releases
from corewire import protocol as p
from corewire.codec import Encoder, MsgspecDecoder, NativeDecoder
from corewire.wire import layouts
from golden_0_33_0_support import expected, frames, to_structs
from golden_support import jsonable

CASES = sorted(expected())
#: Cases whose message carries request outputs.
WITH_OUTPUTS = [c for c in CASES if expected()[c]["decoded"]["outputs"]]
#: The others: utility replies, FT status, stats only.
WITHOUT_OUTPUTS = [c for c in CASES if c not in WITH_OUTPUTS]


def test_the_cases_cover_the_brief() -> None:
    assert {
        "plain",
        "kv_transfer_params",
        "ec_transfer_params",
        "prefill_stats",
        "scheduler_stats",
        "logprobs_top5",
        "prompt_logprobs",
        "weight_version",
        "error",
        "utility_reply",
        "events",
    } <= set(CASES)
    assert {"utility_reply", "ft_status", "scheduler_stats"} <= set(WITHOUT_OUTPUTS)


def _compare(got: Any, want: dict[str, Any]) -> None:
    got = jsonable(got)
    assert set(got) == set(want)
    for field, value in want.items():
        if field == "outputs":
            assert len(got["outputs"]) == len(value)
            for i, (g, w) in enumerate(zip(got["outputs"], value, strict=True)):
                # The decoded output carries every release's fields; those 0.33.0 lacks
                # (0.34.0's watermarking) are None.
                assert set(g) >= set(w), i
                assert all(g[f] is None for f in set(g) - set(w)), i
                for f in w:
                    assert g[f] == w[f], f"outputs[{i}].{f}"
        else:
            assert got[field] == value, field


@pytest.mark.parametrize("case", CASES)
def test_decodes_to_what_vllm_decoded(case: str) -> None:
    decoded = NativeDecoder(release="0.33.0").decode(frames(case))
    _compare(decoded, expected()[case]["decoded"])


@pytest.mark.parametrize("case", CASES)
def test_reencodes_byte_for_byte(case: str) -> None:
    golden = frames(case)
    decoded = NativeDecoder(release="0.33.0").decode(golden)
    again = Encoder(release="0.33.0").encode(to_structs(decoded, "0.33.0"))
    assert [bytes(f) for f in again] == golden


@pytest.mark.parametrize("case", CASES)
def test_the_0_33_0_structs_decode_alike(case: str) -> None:
    """corewire.wire.layouts' 0.33.0 structs, as msgspec reads them, are vLLM 0.33.0's layout."""
    decoder = MsgspecDecoder(layouts.types_for("0.33.0")["EngineCoreOutputs"])
    _compare(decoder.decode(frames(case)), expected()[case]["decoded"])


def test_new_fields_decode_to_their_types() -> None:
    err = NativeDecoder(release="0.33.0").decode(frames("error")).outputs[0]
    assert err.finish_reason is p.FinishReason.ERROR
    assert isinstance(err.error, layouts.RequestError)
    assert err.error.code == "engine_paused" and err.error.retryable is True
    new = NativeDecoder(release="0.33.0").decode(frames("new_output_fields")).outputs[0]
    assert isinstance(new.new_sampling_mask, layouts.SamplingMaskLists)
    tensors = NativeDecoder(release="0.33.0").decode(frames("prompt_logprobs")).outputs[0]
    plt = tensors.new_prompt_logprobs_tensors
    assert isinstance(plt, layouts.types_for("0.33.0")["LogprobsTensors"])
    assert len(plt) == 5 and plt.cu_num_generated_tokens_tensor is not None


@pytest.mark.parametrize("case", WITH_OUTPUTS)
def test_0_33_0_outputs_fail_under_0_25_1(case: str) -> None:
    with pytest.raises(ProtocolError, match=r"outputs\[0\]"):
        NativeDecoder(release="0.25.1").decode(frames(case))


@pytest.mark.parametrize("case", WITHOUT_OUTPUTS)
def test_frames_without_outputs_decode_under_both(case: str) -> None:
    """The documented limitation: without outputs nothing tells the versions apart.

    0.25.1 reads 0.33.0's trailing weight_version past (vLLM 0.25.1 does the same), so
    the message decodes to the same values, less that field.
    """
    want = dict(expected()[case]["decoded"])
    want["weight_version"] = None
    _compare(NativeDecoder(release="0.25.1").decode(frames(case)), want)


def _0_25_1_frame(outputs: list[p.EngineCoreOutput]) -> list[bytes]:
    message = p.EngineCoreOutputs(engine_index=0, outputs=outputs, timestamp=2.0)
    return [bytes(f) for f in Encoder(release="0.25.1").encode(message)]


@pytest.mark.parametrize(
    "output",
    [
        p.EngineCoreOutput("r", [1]),
        p.EngineCoreOutput("r", [1], kv_transfer_params={"k": 1}, trace_headers={"t": "h"}),
        p.EngineCoreOutput("r", [1], finish_reason=p.FinishReason.ERROR, num_nans_in_logits=3),
    ],
)
def test_0_25_1_outputs_fail_under_0_33_0(output: p.EngineCoreOutput) -> None:
    frame = _0_25_1_frame([output])
    NativeDecoder(release="0.25.1").decode(frame)
    with pytest.raises(ProtocolError, match=r"outputs\[0\]"):
        NativeDecoder(release="0.33.0").decode(frame)


def test_0_25_1_messages_without_outputs_decode_under_both() -> None:
    frame = _0_25_1_frame([])
    old = NativeDecoder(release="0.25.1").decode(frame)
    new = NativeDecoder(release="0.33.0").decode(frame)
    assert jsonable(old) == jsonable(new)


def test_an_encoder_refuses_newer_structs_and_converts_0_25_1s() -> None:
    new = layouts.types_for("0.33.0")["EngineCoreOutputs"]()
    with pytest.raises(TypeError, match=r"vLLM 0\.33\.0"):
        Encoder(release="0.25.1").encode(new)
    # corewire.protocol's message (what engines build) goes out in 0.33.0's layout, as
    # a 0.33.0 engine converts it.
    old = p.EngineCoreOutputs(outputs=[p.EngineCoreOutput("r", [1, 2])])
    frames = Encoder(release="0.33.0").encode(old)
    assert msgspec.msgpack.decode(frames[0])[1][0][:2] == ["r", [1, 2]]
    assert NativeDecoder(release="0.33.0").decode(frames).outputs[0].new_token_ids == [1, 2]
    # the structs both versions share pass either
    reply = p.UtilityOutput(1, None, p.UtilityResult(2))
    assert Encoder(release="0.25.1").encode(reply) == Encoder(release="0.33.0").encode(reply)


def test_unsupported_protocols_are_refused_by_name() -> None:
    for make in (NativeDecoder, Encoder):
        with pytest.raises(releases.UnsupportedProtocolError, match=r"'0\.25\.1', '0\.26\.0'"):
            make(release="0.25.2")
    # By default, the installed vLLM's release (this module also runs in 0.33.0's venv).
    assert NativeDecoder().release == releases.DEFAULT == Encoder().release
    assert NativeDecoder(release="0.33.0").release == "0.33.0"


@pytest.mark.parametrize(
    ("installed", "release"),
    [("0.25.1", "0.25.1"), ("0.33.0", "0.33.0"), ("0.33.0+cpu", "0.33.0")],
)
def test_release_for_vllm(installed: str, release: str) -> None:
    assert releases.for_vllm(installed) == release


@pytest.mark.parametrize("installed", ["0.25.2", "0.33.1", "0.33.0rc1", "0.34.1", "1.0", ""])
def test_other_vllm_versions_are_refused(installed: str) -> None:
    with pytest.raises(releases.UnsupportedProtocolError) as info:
        releases.for_vllm(installed)
    assert "vLLM version" in str(info.value)
    assert all(repr(r.name) in str(info.value) for r in releases.SUPPORTED)
    assert info.value.version == installed


def test_every_supported_release_is_one_registered_object() -> None:
    # Release-dependent branches read a release's attributes (corewire.releases): each
    # release is one object, found by its name, and an unsupported one is refused rather
    # than falling through an if.
    flags = (
        "counts_carry_kv_usage",
        "engine_led_waves",
        "generation_pause_utilities",
        "kv_pressure_routing",
        "session_affinity",
        "request_errors",
        "weight_versions",
    )
    rows = {r.name: {f: getattr(r, f) for f in flags} for r in releases.SUPPORTED}
    assert releases.get(None) is releases.DEFAULT
    assert all(releases.get(r.name) is r for r in releases.SUPPORTED)
    assert not any(rows["0.25.1"].values())  # 0.25.1 is the baseline
    assert all(rows["0.33.0"].values())  # 0.33.0 changed each of them
    assert releases.get("0.25.1").speaks_protocol_structs
    assert not releases.get("0.33.0").speaks_protocol_structs
    # A release without a class of its own behaves as the newest class before it (0.30.0
    # as 0.29.0); its wire facts are its own record's.
    assert rows["0.30.0"] == rows["0.29.0"] and type(releases.get("0.30.0")).NAME == "0.29.0"
    assert not releases.get("0.30.0").native_output and releases.get("0.30.0").vllm_client
    assert all(rows["0.34.0"].values()) and releases.get("0.34.0").verified
    with pytest.raises(releases.UnsupportedProtocolError):
        releases.get("0.25.2")
