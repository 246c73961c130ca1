"""vLLM 0.33.0's encoder -> corewire's decoder, live (runs only where vLLM 0.33.0 is installed).

The golden test checks corewire against frames vLLM 0.33.0 wrote once; this one runs the
same comparison against the installed vLLM itself, on the golden cases and on a batch of
varied outputs: each message is encoded by vLLM's ``MsgpackEncoder``, decoded by vLLM's
``MsgpackDecoder`` and by ``NativeDecoder(release=release_for_vllm(vllm.__version__))``,
the two results compared field by field, and the frames re-encoded by corewire's
``Encoder`` byte for byte. The front-end -> engine direction likewise: vLLM's requests
(the golden ones and varied ones) through ``corewire.codec.request_decoder``, re-encoded byte for
byte and read back by vLLM's decoder; and corewire's 0.33.0 ready response decoded as vLLM
0.33.0's front-end decodes it. With vLLM 0.25.1 (the main environment) it is skipped.
"""

from __future__ import annotations

import importlib.util
import random
import warnings
from typing import Any

import pytest

from vllm_0_33_0_gate import RELEASE, as_the_client_sends, require_vllm_0_33_0

vllm = require_vllm_0_33_0()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.v1 import engine as E  # noqa: E402
from vllm.v1.outputs import LogprobsLists  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from corewire.codec import Encoder, NativeDecoder, request_decoder  # noqa: E402
from corewire.releases import for_vllm as release_for_vllm  # noqa: E402
from golden_0_33_0_support import DATA, to_structs  # noqa: E402
from golden_support import jsonable  # noqa: E402


def _load_generator(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, DATA / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _golden_cases() -> dict[str, Any]:
    return _load_generator("make_golden").cases()


def _varied_batch(seed: int) -> Any:
    """64 outputs, each with a random mix of fields (one finished id: see make_golden)."""
    rng = random.Random(seed)
    outputs = []
    for i in range(64):
        kw: dict[str, Any] = {}
        if rng.random() < 0.3:
            n = rng.randint(1, 3)
            kw["new_logprobs"] = LogprobsLists(
                np.arange(n * 6, dtype=np.int32).reshape(n, 6),
                np.full((n, 6), -0.5, dtype=np.float32),
                np.zeros(n, dtype=np.int32),
                None,
            )
        if rng.random() < 0.2:
            kw["kv_transfer_params"] = {"remote": i, "ids": [1, 2]}
        if rng.random() < 0.2:
            kw["ec_transfer_params"] = {"e": str(i)}
        if rng.random() < 0.1:
            kw["prompt_token_id_logprobs"] = torch.full((1, 2), -1.5)
        if rng.random() < 0.1:
            kw["mm_cache_miss_hashes"] = [f"h{i}"]
        if rng.random() < 0.1:
            kw["finish_reason"] = E.FinishReason.STOP
            kw["stop_reason"] = rng.choice([None, 7, "</s>"])
        kw["num_nans_in_logits"] = rng.choice([0, 0, 0, 1])
        outputs.append(E.EngineCoreOutput(f"req-{seed}-{i}", [rng.randint(0, 50000)], **kw))
    return E.EngineCoreOutputs(
        engine_index=seed % 2,
        outputs=outputs,
        timestamp=100.0 + seed,
        finished_requests={f"req-{seed}-0"},
        weight_version="default",
    )


MESSAGES = {**_golden_cases(), **{f"varied-{s}": _varied_batch(s) for s in range(8)}}


def _as_the_release_has_it(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """``got`` (a natively decoded message, as data) without the output fields only other
    releases have: the native objects carry every release's fields, and those this
    release lacks must be None."""
    outputs = []
    for output, wanted in zip(got.get("outputs") or (), want.get("outputs") or (), strict=False):
        extra = set(output) - set(wanted)
        assert all(output[f] is None for f in extra), sorted(extra)
        outputs.append({f: v for f, v in output.items() if f not in extra})
    return {**got, "outputs": outputs} if "outputs" in got else got


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_vllm_encodes_corewire_decodes_the_same(name: str) -> None:
    release = release_for_vllm(vllm.__version__)
    frames = [bytes(f) for f in MsgpackEncoder().encode(MESSAGES[name])]
    with warnings.catch_warnings():
        # vLLM's decoder wraps read-only bytes in tensors, which torch warns about
        warnings.simplefilter("ignore", UserWarning)
        want = jsonable(MsgpackDecoder(E.EngineCoreOutputs).decode(frames))
    got = NativeDecoder(release=release).decode(frames)
    assert _as_the_release_has_it(jsonable(got), want) == want
    again = Encoder(release=release).encode(to_structs(got, release))
    assert [bytes(f) for f in again] == frames


# --- the front-end -> engine direction and the ready response -------------------------


def _varied_request(seed: int) -> Any:
    """A request with a random mix of 0.33.0's fields (vLLM's own objects)."""
    from vllm.lora.request import LoRARequest
    from vllm.pooling_params import LateChunkingParams, PoolingParams
    from vllm.sampling_params import SamplingParams
    from vllm.v1.kv_hints.protocol import KvHintAction, KvHintsEnvelope

    rng = random.Random(seed)
    kw: dict[str, Any] = {}
    if rng.random() < 0.5:
        rows = rng.choice([1, 3, 40])
        kw["sampling_params"] = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0]),
            watermarking=rng.choice([None, True, False]),
            stop_token_ids=[rng.randint(0, 9) for _ in range(3)],
            prompt_logprob_token_ids=rng.choice(
                [None, np.arange(rows * 2, dtype=np.int32).reshape(rows, 2)]
            ),
            stream_interval=rng.choice([None, 1, 8]),
            trace_decode_token_ids=rng.choice([None, [1, 2]]),
            max_tokens=rng.randint(1, 100),
        )
    else:
        kw["pooling_params"] = PoolingParams(
            task="token_embed",
            late_chunking_params=rng.choice([None, LateChunkingParams(chunk_size=8)]),
        )
    if rng.random() < 0.3:
        kw["lora_request"] = LoRARequest(f"l{seed}", seed + 1, "/p", None, rng.random() < 0.5)
    if rng.random() < 0.3:
        kw["session_id"] = f"s{seed}"
    if rng.random() < 0.3:
        kw["kv_hints"] = KvHintsEnvelope("1", f"m{seed}", [KvHintAction("a", "t", "1", {})])
    if rng.random() < 0.3:
        kw["prompt_embeds"] = torch.zeros(rng.choice([2, 20]), 8)
    return E.EngineCoreRequest(
        f"req-{seed}", [rng.randint(0, 50000) for _ in range(5)], None,
        kw.pop("sampling_params", None), kw.pop("pooling_params", None), 1.0 + seed,
        kw.pop("lora_request", None), None, None, **kw,
    )  # fmt: skip


REQUESTS = {
    name: as_the_client_sends(request)
    for name, request in {
        **_load_generator("make_golden_requests").cases(),
        **{f"varied-{s}": _varied_request(s) for s in range(16)},
    }.items()
}


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_vllm_requests_decode_alike_and_reencode(name: str) -> None:
    release = release_for_vllm(vllm.__version__)
    frames = [bytes(f) for f in MsgpackEncoder().encode(REQUESTS[name])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers in tensors
        want = jsonable(MsgpackDecoder(E.EngineCoreRequest).decode(frames), wire_names=True)
    got = request_decoder(release).decode(frames)
    assert jsonable(got, wire_names=True) == want
    again = [bytes(f) for f in Encoder(release=release).encode(got)]
    assert again == frames
    # and vLLM's engine reads what corewire writes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        back = MsgpackDecoder(E.EngineCoreRequest).decode(again)
    assert jsonable(back, wire_names=True) == want


def test_vllm_0_33_0_accepts_corewires_ready_response() -> None:
    import dataclasses

    import msgspec

    from corewire.engine import EngineInfo
    from corewire.engine.ready import ready_response
    from corewire.engine.ready_layouts import ReadyFacts, ready_response_for

    info = EngineInfo(max_model_len=4096, num_gpu_blocks=12, kv_cache_size_tokens=192)
    ready = ready_response_for(
        RELEASE,
        info,
        engine_index=1,
        data_parallel_size=2,
        facts=ReadyFacts(instance_id="live", max_num_seqs=64),
    )
    payload = msgspec.msgpack.encode(ready)
    # as vLLM 0.33.0's front-end decodes it (core_client)
    got = msgspec.msgpack.decode(payload, type=E.EngineCoreReadyResponse)
    assert (got.max_model_len, got.num_gpu_blocks, got.data_parallel_rank) == (4096, 12, 1)
    assert (got.max_num_seqs, got.instance_id, got.vllm_version) == (64, "live", RELEASE)
    # byte for byte vLLM's own, up to corewire's trailing keys
    ours = {k: v for k, v in ready.items() if k not in ("status", "engine_index", "pid")}
    assert msgspec.msgpack.encode(ours) == msgspec.msgpack.encode(got)
    assert list(ours) == [f.name for f in dataclasses.fields(E.EngineCoreReadyResponse)]
    # a 0.25.1-style response is refused, as observed with `vllm serve`
    old = msgspec.msgpack.encode(ready_response(info, engine_index=0))
    with pytest.raises(msgspec.ValidationError, match="tensor_parallel_size"):
        msgspec.msgpack.decode(old, type=E.EngineCoreReadyResponse)
