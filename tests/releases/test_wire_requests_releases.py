"""corewire's 0.25.1 ``EngineCoreRequest`` written for each release between 0.27.0 and
0.32.0 (``corewire.wire.requests.converted_writer``), read back with that release's
own request layout (its record): no vLLM needed.

What differs by release, found live (``test_vllm_0_33_0_client.py`` under each release
compares the bytes with vLLM's own): 0.33.0's ``session_id`` exists from 0.28.0 on and
``kv_hints`` from 0.31.0 on; the LoRA keeps 0.25.1's ``tensorizer_config_dict`` until
0.32.0 (so does ``add_lora``'s argument); repeated stop token ids and bad words are
dropped from 0.28.0 on; ``routed_experts_prompt_start`` moves from 0.25.1's place to
0.33.0's in 0.29.0.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from client_support import request
from corewire import protocol as p
from corewire import releases
from corewire.codec import Encoder, request_decoder
from corewire.wire import layouts
from corewire.wire.requests import converted_writer, utility_args_writer

#: The releases whose requests corewire converts into their own layout by field name.
CONVERTED = ("0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")


def _written(release: str, req: p.EngineCoreRequest) -> list[Any]:
    """The request as a release's client writes it, as a msgpack array."""
    frames = Encoder(release=release).encode(converted_writer(releases.get(release))(req))
    return msgspec.msgpack.decode(frames[0])


def _field(release: str, name: str) -> int:
    return layouts.types_for(release)["EngineCoreRequest"].__struct_fields__.index(name)


@pytest.mark.parametrize("release", CONVERTED)
def test_the_request_has_exactly_the_releases_fields(release: str) -> None:
    wire = _written(release, request("r", 3))
    fields = layouts.types_for(release)["EngineCoreRequest"].__struct_fields__
    assert len(wire) == len(fields)
    # session_id from 0.28.0 on, kv_hints from 0.31.0 on (their records).
    assert ("session_id" in fields) is (release not in ("0.27.0", "0.27.1"))
    assert ("kv_hints" in fields) is (release in ("0.31.0", "0.32.0"))
    back = request_decoder(release).decode([msgspec.msgpack.encode(wire)])
    assert back.request_id == "r" and list(back.prompt_token_ids) == [1, 2, 3]


@pytest.mark.parametrize("release", CONVERTED)
def test_a_lora_keeps_its_tensorizer_slot_until_0_32_0(release: str) -> None:
    lora = layouts.LoRARequest("a", 2, "/p")
    wire = _written(release, request("l", 3, lora_request=lora))
    sent = wire[_field(release, "lora_request")]
    own = layouts.types_for(release)["LoRARequest"].__struct_fields__
    assert len(sent) == len(own) and sent[:3] == ["a", 2, "/p"]
    keeps = "tensorizer_config_dict" in own
    assert keeps is (release != "0.32.0")
    # add_lora's argument: as given where the LoRA is 0.25.1's, converted otherwise.
    assert (utility_args_writer(release) is None) is keeps


@pytest.mark.parametrize("release", CONVERTED)
def test_repeated_stops_are_dropped_from_0_28_0_on(release: str) -> None:
    sampling = {"stop_token_ids": [2, 2, 3], "bad_words": ["a", "a"]}
    wire = _written(release, request("s", 3, sampling=sampling))
    params = wire[_field(release, "sampling_params")]
    drops = release not in ("0.27.0", "0.27.1")
    assert releases.get(release).drops_repeated_stops is drops
    assert params["stop_token_ids"] == ([2, 3] if drops else [2, 2, 3])
    assert params["bad_words"] == (["a"] if drops else ["a", "a"])


@pytest.mark.parametrize("release", CONVERTED)
def test_routed_experts_start_sits_where_the_release_writes_it(release: str) -> None:
    req = request("re", 3)
    req.sampling_params.routed_experts_prompt_start = 4
    keys = list(_written(release, req)[_field(release, "sampling_params")])
    order = layouts.types_for(release)["SamplingParams"].__struct_fields__
    # The map's keys in the release's own order (its record), whichever place it has.
    assert keys == sorted(keys, key=order.index)
    before = keys.index("routed_experts_prompt_start") < keys.index("bad_words")
    assert before is (release in ("0.27.0", "0.27.1", "0.28.0"))
