"""vLLM 0.33.0's own requests (``tests/data/vllm-0.33.0/request_*``) through corewire.

The frames were written by vLLM 0.33.0's ``MsgpackEncoder`` from its ``EngineCoreRequest``
and ``expected_requests.json`` holds what vLLM 0.33.0's ``MsgpackDecoder`` made of them
(``make_golden_requests.py`` beside them regenerates both). Here, with vLLM 0.25.1
installed, ``request_decoder("0.33.0")`` must decode each to exactly those
values and ``Encoder(release="0.33.0")`` must write them back byte for byte; each
version's typed ``LoRARequest`` must refuse the other's (the one layout change that does
not decode across versions; 0.25.1's request carries its LoRA untyped).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from corewire import ProtocolError
from corewire import protocol as p
from corewire.codec import Encoder, MsgspecDecoder, request_decoder
from corewire.wire import layouts
from golden_0_33_0_requests_support import expected_requests, request_frames
from golden_support import jsonable

CASES = sorted(expected_requests())


def test_the_cases_cover_the_brief() -> None:
    assert {
        "plain",
        "sampling_new_keys",
        "sampling_aux",
        "pooling",
        "lora",
        "session_kv_hints",
        "prompt_embeds",
    } <= set(CASES)
    # the large prompt_logprob_token_ids travels as its own frame
    assert expected_requests()["sampling_aux"]["frames"] == 2


@pytest.mark.parametrize("case", CASES)
def test_decodes_to_what_vllm_decoded(case: str) -> None:
    decoded = request_decoder("0.33.0").decode(request_frames(case))
    assert isinstance(decoded, layouts.types_for("0.33.0")["EngineCoreRequest"])
    want = expected_requests()[case]["decoded"]
    got = jsonable(decoded, wire_names=True)
    assert set(got) == set(want)
    for field, value in want.items():
        assert got[field] == value, field


@pytest.mark.parametrize("case", CASES)
def test_reencodes_byte_for_byte(case: str) -> None:
    golden = request_frames(case)
    decoded = request_decoder("0.33.0").decode(golden)
    again = Encoder(release="0.33.0").encode(decoded)
    assert [bytes(f) for f in again] == golden


def test_the_new_keys_decode_to_their_types() -> None:
    types = layouts.types_for("0.33.0")
    req = request_decoder("0.33.0").decode(request_frames("sampling_aux"))
    sp = req.sampling_params
    assert isinstance(sp, types["SamplingParams"])
    assert isinstance(sp.prompt_logprob_token_ids, np.ndarray)
    assert sp.prompt_logprob_token_ids.shape == (4, 32)
    assert sp.watermarking is True and sp.watermarking_skipped is True
    assert (sp.prompt_logprob_start, sp.stream_interval) == (1, 4)
    assert sp.trace_decode_token_ids == [5, 6]
    assert sp.routed_experts_prompt_start == 3
    # vLLM 0.33.0's normalisations ran on decode: duplicates dropped
    assert sp.stop_token_ids == [2, 3] and sp.bad_words == ["x", "y"]
    pooled = request_decoder("0.33.0").decode(request_frames("pooling"))
    assert pooled.pooling_params.late_chunking_params == layouts.LateChunkingParams(4)
    assert pooled.pooling_params.normalize is None
    lora = request_decoder("0.33.0").decode(request_frames("lora")).lora_request
    assert lora == types["LoRARequest"]("adapter", 3, "/adapters/a", "base", True, True)
    sess = request_decoder("0.33.0").decode(request_frames("session_kv_hints"))
    assert sess.session_id == "sess-9"
    assert isinstance(sess.kv_hints, layouts.KvHintsEnvelope)
    assert sess.kv_hints.actions[0].payload == {"blocks": [1, 2], "tier": "host"}


def test_0_33_0_layouts_are_vllm_0_33_0s() -> None:
    """Field counts and the positions that moved (docs/vllm-0.33.0-notes.md, §2)."""
    types = layouts.types_for("0.33.0")
    request = types["EngineCoreRequest"].__struct_encode_fields__
    assert len(request) == 22 and request[-2:] == ("session_id", "kv_hints")
    assert request[:20] == p.EngineCoreRequest.__struct_encode_fields__
    pooling = types["PoolingParams"].__struct_encode_fields__
    assert len(pooling) == 11 and pooling[-1] == "late_chunking_params"
    assert pooling[0] == "use_activation"
    lora = types["LoRARequest"].__struct_encode_fields__
    kept = layouts.LoRARequest.__struct_encode_fields__[:4]
    assert lora == (*kept, "load_inplace", "is_3d_lora_weight")
    sampling = types["SamplingParams"].__struct_encode_fields__
    assert len(sampling) == 43
    old = p.SamplingParams.__struct_encode_fields__
    assert set(sampling) - set(old) == {
        "watermarking",
        "prompt_logprob_token_ids",
        "prompt_logprob_start",
        "stream_interval",
        "_watermarking_skipped",
        "trace_decode_token_ids",
    }
    assert (
        sampling.index("routed_experts_prompt_start") == sampling.index("repetition_detection") + 1
    )
    assert types["SamplingParams"].__struct_config__.omit_defaults


def test_the_request_header_tells_the_version() -> None:
    new = layouts.types_for("0.33.0")["EngineCoreRequest"](request_id="r")
    assert Encoder(release="0.33.0").encode(new)[0][:3] == b"\xdc\x00\x16"
    old = p.EngineCoreRequest(request_id="r")
    assert Encoder(release="0.25.1").encode(old)[0][:3] == b"\xdc\x00\x14"


def test_an_encoder_refuses_a_newer_request_and_converts_0_25_1s() -> None:
    new = layouts.types_for("0.33.0")["EngineCoreRequest"](request_id="r")
    with pytest.raises(TypeError, match=r"0\.33\.0 EngineCoreRequest"):
        Encoder(release="0.25.1").encode(new)
    # corewire.protocol's request (what callers build) goes out in 0.33.0's layout, as
    # a 0.33.0 client converts it.
    frames = Encoder(release="0.33.0").encode(p.EngineCoreRequest(request_id="r"))
    assert frames[0][:3] == b"\xdc\x00\x16"
    assert request_decoder("0.33.0").decode(frames).request_id == "r"


def test_a_lora_does_not_decode_across_versions() -> None:
    # 0.33.0's LoRA has a bool where 0.25.1's has tensorizer_config_dict
    old = request_decoder("0.25.1")
    lora_033 = layouts.types_for("0.33.0")["LoRARequest"]
    lora_025 = layouts.types_for("0.25.1")["LoRARequest"]
    frames = request_frames("lora")
    decoded_old = old.decode(frames)  # 0.25.1's request carries its LoRA untyped
    assert decoded_old.lora_request == ["adapter", 3, "/adapters/a", "base", True, True]
    with pytest.raises(ProtocolError, match=re.escape("Expected `object | null`, got `bool`")):
        MsgspecDecoder(lora_025).decode(Encoder(release="0.33.0").encode(lora_033("a", 1, "/p")))
    with pytest.raises(ProtocolError):
        request_decoder("0.33.0").decode(
            Encoder().encode(
                p.EngineCoreRequest(request_id="r", lora_request=lora_025("a", 1, "/p"))
            )
        )


def test_requests_without_a_lora_decode_across_versions() -> None:
    """As vLLM's: a 0.25.1 request reads under 0.33.0 (the two new fields default) and
    back (the extra trailing fields are dropped)."""
    old = p.EngineCoreRequest(
        request_id="r", prompt_token_ids=[1], sampling_params=p.SamplingParams(max_tokens=3)
    )
    new = request_decoder("0.33.0").decode(Encoder().encode(old))
    assert new.session_id is None and new.sampling_params.max_tokens == 3
    back = request_decoder("0.25.1").decode(Encoder(release="0.33.0").encode(new))
    assert isinstance(back, p.EngineCoreRequest)
    assert back.sampling_params.max_tokens == 3


def test_the_ft_status_names() -> None:
    assert layouts.FT_STATUS_CALL_ID == -2 != p.EEP_NOTIFICATION_CALL_ID
    assert [(s.name, int(s)) for s in layouts.EngineStatusType] == [
        ("HEALTHY", 0),
        ("DEAD", 1),
        ("UNHEALTHY", 2),
    ]
    assert layouts.EngineStatusType.UNHEALTHY.wire_name == "unhealthy"
    assert layouts.EngineStatusType.from_wire("dead") is layouts.EngineStatusType.DEAD
    with pytest.raises(ValueError, match="'sick'"):
        layouts.EngineStatusType.from_wire("sick")


def test_request_decoder_refuses_an_unknown_version() -> None:
    with pytest.raises(ValueError, match=r"0\.25\.2"):
        request_decoder("0.25.2")
