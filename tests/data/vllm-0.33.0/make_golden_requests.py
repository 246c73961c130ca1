"""Writes the vLLM 0.33.0 golden *requests* beside this script, with what vLLM decoded of them.

Run it with vLLM 0.33.0 installed (not the project's main environment, which has 0.25.1)::

    python tests/data/vllm-0.33.0/make_golden_requests.py

The front-end -> engine sibling of ``make_golden.py``: for each case it builds vLLM's own
``EngineCoreRequest``, encodes it with vLLM's ``MsgpackEncoder``, writes the frames as
``request_<case>.<i>.bin`` (frame 0 the payload, then any aux frames), decodes those bytes
back with vLLM's ``MsgpackDecoder(EngineCoreRequest)`` and stores that result as plain
JSON data (``tests/golden_support.jsonable`` with wire names) in ``expected_requests.json``.
``tests/releases/test_vllm_0_33_0_requests.py`` decodes the frames with corewire, compares, and
re-encodes byte for byte. It also writes ``ready_response.bin``: vLLM 0.33.0's own
``EngineCoreReadyResponse`` for a plain engine (:data:`READY`), as its engine encodes it
(``tests/engine/test_ready_layouts.py`` builds the same map with corewire).

The output is deterministic: running it again rewrites the same bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import numpy as np
import torch
import vllm
from vllm.lora.request import LoRARequest
from vllm.pooling_params import LateChunkingParams, PoolingParams
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1 import engine as E
from vllm.v1.kv_hints.protocol import KvHintAction, KvHintsEnvelope
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/, for golden_support

from golden_support import jsonable  # noqa: E402

VERSION = "0.33.0"
PREFIX = "request_"


def _req(rid: str, **kw: object) -> E.EngineCoreRequest:
    fields: dict[str, object] = {
        "request_id": rid,
        "prompt_token_ids": [1, 2, 3, 4],
        "mm_features": None,
        "sampling_params": None,
        "pooling_params": None,
        "arrival_time": 1234.5,
        "lora_request": None,
        "cache_salt": None,
        "data_parallel_rank": None,
    }
    fields.update(kw)
    return E.EngineCoreRequest(**fields)  # type: ignore[arg-type]


def _all_new_keys(ids: np.ndarray) -> SamplingParams:
    params = SamplingParams(
        temperature=0.5,
        watermarking=True,
        top_p=0.9,
        seed=7,
        stop=["</s>", "###"],
        stop_token_ids=[2, 2, 3],
        max_tokens=32,
        logprobs=2,
        prompt_logprobs=1,
        prompt_logprob_token_ids=ids,
        prompt_logprob_start=1,
        output_kind=RequestOutputKind.DELTA,
        stream_interval=4,
        bad_words=["x", "x", "y"],
        trace_decode_token_ids=[5, 6],
        extra_args={"k": [1, "v"]},
    )
    params._eos_token_id = 2
    params._all_stop_token_ids.add(2)
    params._watermarking_skipped = True
    params.routed_experts_prompt_start = 3
    return params


def cases() -> dict[str, E.EngineCoreRequest]:
    """Every golden request: its name -> the request vLLM 0.33.0's front-end would send."""
    small_ids = np.arange(6, dtype=np.int32).reshape(3, 2)  # 24 bytes: inline
    big_ids = np.arange(128, dtype=np.int32).reshape(4, 32)  # 512 bytes: an aux frame
    return {
        "plain": _req("req-0", sampling_params=SamplingParams()),
        # what the OpenAI server sends without sampling arguments (docs: fake2.log)
        "openai_default": _req(
            "req-oa",
            sampling_params=SamplingParams(
                presence_penalty=0.0,
                frequency_penalty=0.0,
                repetition_penalty=1.0,
                temperature=1.0,
                top_p=1.0,
                min_p=0.0,
                watermarking=False,
                skip_clone=True,
                output_kind=RequestOutputKind.DELTA,
            ),
            external_req_id="cmpl-1",
            client_index=1,
            current_wave=2,
            priority=-1,
        ),
        "sampling_new_keys": _req("req-s", sampling_params=_all_new_keys(small_ids)),
        "sampling_aux": _req("req-sa", sampling_params=_all_new_keys(big_ids)),
        "pooling": _req(
            "req-pool",
            pooling_params=PoolingParams(
                task="token_embed",
                dimensions=8,
                late_chunking_params=LateChunkingParams(chunk_size=4),
            ),
        ),
        "lora": _req(
            "req-lora",
            sampling_params=SamplingParams(max_tokens=3),
            lora_request=LoRARequest("adapter", 3, "/adapters/a", "base", True, True),
        ),
        "session_kv_hints": _req(
            "req-sess",
            sampling_params=SamplingParams(temperature=0.0),
            session_id="sess-9",
            kv_hints=KvHintsEnvelope(
                "1",
                "msg-1",
                [
                    KvHintAction("a1", "prefetch", "1", {"blocks": [1, 2], "tier": "host"}),
                    KvHintAction("a2", "pin", "2", {}),
                ],
            ),
            trace_headers={"traceparent": "00-ab-cd-01"},
            cache_salt="salt",
            data_parallel_rank=1,
        ),
        "prompt_embeds": _req(
            "req-emb",
            prompt_token_ids=None,
            sampling_params=SamplingParams(max_tokens=2),
            prompt_embeds=torch.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16),
        ),
        "prompt_embeds_mixed": _req(
            "req-mix",
            prompt_token_ids=[1, 0, 3],
            sampling_params=SamplingParams(max_tokens=2),
            prompt_embeds=torch.ones(3, 4, dtype=torch.float16),
            prompt_is_token_ids=[True, False, True],
            resumable=True,
            reasoning_ended=False,
            abort_immediately=True,
        ),
    }


#: The ready response of a 2048-token engine without a KV cache (the values
#: ``tests/engine/test_ready_layouts.py`` passes to corewire).
READY = E.EngineCoreReadyResponse(
    max_model_len=2048,
    num_gpu_blocks=0,
    block_size=16,
    dp_stats_address=None,
    dtype="float32",
    vllm_version=VERSION,
    world_size=1,
    data_parallel_size=1,
    tensor_parallel_size=1,
    pipeline_parallel_size=1,
    decode_context_parallel_size=1,
    data_parallel_rank=0,
    max_num_seqs=256,
    max_num_batched_tokens=2048,
    instance_id="golden",
    supports_lora=False,
    max_loras=0,
)


def main() -> None:
    if vllm.__version__.split("+")[0] != VERSION:
        sys.exit(f"needs vLLM {VERSION}, found {vllm.__version__}")
    encoder = MsgpackEncoder()
    decoder = MsgpackDecoder(E.EngineCoreRequest)
    expected: dict[str, object] = {"vllm": vllm.__version__}
    for name, request in cases().items():
        frames = [bytes(f) for f in encoder.encode(request)]
        for old in HERE.glob(f"{PREFIX}{name}.*.bin"):
            old.unlink()
        for i, frame in enumerate(frames):
            (HERE / f"{PREFIX}{name}.{i}.bin").write_bytes(frame)
        decoded = decoder.decode(frames)
        expected[name] = {"frames": len(frames), "decoded": jsonable(decoded, wire_names=True)}
    text = json.dumps(expected, indent=1, sort_keys=True) + "\n"
    (HERE / "expected_requests.json").write_text(text)
    (HERE / "ready_response.bin").write_bytes(msgspec.msgpack.encode(READY))
    print(f"wrote {len(expected) - 1} cases to {HERE}")


if __name__ == "__main__":
    main()
