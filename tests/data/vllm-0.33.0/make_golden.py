"""Writes the vLLM 0.33.0 golden frames beside this script, with what vLLM decoded of them.

Run it with vLLM 0.33.0 installed (not the project's main environment, which has 0.25.1)::

    python tests/data/vllm-0.33.0/make_golden.py

For each case it builds vLLM's own engine -> front-end objects (``EngineCoreOutputs``),
encodes them with vLLM's ``MsgpackEncoder``, writes the frames as ``<case>.<i>.bin``
(frame 0 the payload, then any aux frames), decodes those bytes back with vLLM's
``MsgpackDecoder(EngineCoreOutputs)`` and stores that result, as plain JSON data
(``tests/golden_support.jsonable``), in ``expected.json``.
``tests/releases/test_vllm_0_33_0_golden.py`` decodes the frames with corewire and compares
both, field by field, then re-encodes.

The output is deterministic: running it again rewrites the same bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import vllm
from vllm.outputs import RequestError
from vllm.v1 import engine as E
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.stats import (
    KVCacheEvictionEvent,
    PrefillStats,
    PrefixCacheStats,
    RequestSpecDecodeMetrics,
    SchedulerIterationDetails,
    SchedulerStats,
)
from vllm.v1.outputs import LogprobsLists, LogprobsTensors, SamplingMaskLists
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/, for golden_support

from golden_support import jsonable  # noqa: E402

VERSION = "0.33.0"


def _out(rid: str, tokens: list[int], **kw: object) -> E.EngineCoreOutput:
    return E.EngineCoreOutput(rid, tokens, **kw)


def _msg(*outputs: E.EngineCoreOutput, **kw: object) -> E.EngineCoreOutputs:
    kw.setdefault("timestamp", 1234.5)
    return E.EngineCoreOutputs(outputs=list(outputs), **kw)


def _top5(n: int) -> LogprobsLists:
    ids = np.arange(n * 6, dtype=np.int32).reshape(n, 6)
    lps = -np.linspace(0.125, 3.0, n * 6, dtype=np.float32).reshape(n, 6)
    ranks = np.arange(n, dtype=np.int32)
    return LogprobsLists(ids, lps, ranks, list(range(n + 1)))


def _prompt(rows: int) -> LogprobsTensors:
    ids = torch.arange(rows * 3, dtype=torch.int32).reshape(rows, 3)
    lps = -torch.linspace(0.5, 2.0, rows * 3, dtype=torch.float32).reshape(rows, 3)
    ranks = torch.arange(rows, dtype=torch.int32)
    cu_tensor = torch.tensor([0, rows], dtype=torch.int32)
    return LogprobsTensors(ids, lps, ranks, [0, rows], cu_tensor)


def _scheduler_stats() -> SchedulerStats:
    prefix = PrefixCacheStats(reset=False, requests=3, queries=96, hits=32)
    prefix.hits_by_source = {CacheHitSource.DEVICE: 30, CacheHitSource.HOST: 2}
    return SchedulerStats(
        num_running_reqs=4,
        num_waiting_reqs=2,
        num_skipped_waiting_reqs=1,
        num_kv_fetch_reqs_by_stage={"waiting_to_start": 1, "in_progress": 0},
        step_counter=17,
        current_wave=3,
        kv_cache_usage=0.375,
        iteration_details=SchedulerIterationDetails(5, 1, 96, 3, 3, 2.5),
        prefix_cache_stats=prefix,
        kv_cache_eviction_events=[KVCacheEvictionEvent(1.5, 0.25, (0.5, 0.75))],
        waiting_lora_adapters={"a": 1},
    )


def cases() -> dict[str, E.EngineCoreOutputs]:
    """Every golden case: its name -> the message vLLM 0.33.0's engine would send."""
    return {
        "plain": _msg(_out("req-0", [11]), _out("req-1", [12, 13]), weight_version="default"),
        "kv_transfer_params": _msg(
            _out(
                "req-kv",
                [7],
                finish_reason=E.FinishReason.LENGTH,
                kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": [1, 2, 3]},
            ),
            finished_requests={"req-kv"},
            weight_version="default",
        ),
        "ec_transfer_params": _msg(
            _out(
                "req-ec",
                [8],
                kv_transfer_params={"k": 1},
                ec_transfer_params={"encoder_cache": {"hash": "abc", "size": 4}},
                trace_headers={"traceparent": "00-ab-cd-01"},
                num_nans_in_logits=2,
            ),
            weight_version="default",
        ),
        "prefill_stats": _msg(
            _out("req-p", [9], prefill_stats=PrefillStats(96, 64, 32, 30, 2, 64)),
            weight_version="default",
        ),
        "scheduler_stats": _msg(
            scheduler_stats=_scheduler_stats(), engine_index=1, weight_version="default"
        ),
        "logprobs_top5": _msg(
            _out("req-lp", [3, 4], new_logprobs=_top5(2)), weight_version="default"
        ),
        # 4 rows of 3: under the 256-byte threshold, so every tensor travels inline
        "prompt_logprobs": _msg(
            _out("req-pl", [5], new_prompt_logprobs_tensors=_prompt(4)), weight_version="default"
        ),
        # 40 rows: the id and logprob tensors go to aux frames
        "prompt_logprobs_aux": _msg(
            _out("req-pla", [5], new_prompt_logprobs_tensors=_prompt(40)),
            weight_version="default",
        ),
        "weight_version": _msg(_out("req-w", [1]), weight_version="step-42/abc"),
        # (finished_requests is a set, written in its iteration order, which depends on
        # the string hash seed: one id per case keeps the bytes reproducible)
        "error": _msg(
            _out(
                "req-err",
                [],
                finish_reason=E.FinishReason.ERROR,
                error=RequestError(
                    "engine_paused", "Generation is paused. Please retry after it resumes.", True
                ),
            ),
            finished_requests={"req-err"},
        ),
        "error_validation": _msg(
            _out(
                "req-bad",
                [],
                finish_reason=E.FinishReason.ERROR,
                error=RequestError("validation_error", "bad structured output"),
            ),
            finished_requests={"req-bad"},
        ),
        "utility_reply": E.EngineCoreOutputs(
            timestamp=1234.5,
            utility_output=E.UtilityOutput(7, None, UtilityResult({"ok": [1, 2.5, "x"]})),
        ),
        "utility_failure": E.EngineCoreOutputs(
            timestamp=1234.5, utility_output=E.UtilityOutput(8, "it broke", None)
        ),
        "ft_status": E.EngineCoreOutputs(
            engine_index=1,
            timestamp=1234.5,
            utility_output=E.UtilityOutput(
                E.FT_STATUS_CALL_ID, None, UtilityResult({"id": 1, "status": "healthy"})
            ),
        ),
        "events": _msg(
            _out(
                "req-ev",
                [2],
                events=[
                    E.EngineCoreEvent(E.EngineCoreEventType.QUEUED, 1.25),
                    E.EngineCoreEvent(E.EngineCoreEventType.SCHEDULED, 1.5),
                ],
                stop_reason="</s>",
                finish_reason=E.FinishReason.STOP,
            ),
            weight_version="default",
        ),
        "new_output_fields": _msg(
            _out(
                "req-new",
                [5],
                mm_cache_miss_hashes=["h1", "h2"],
                new_sampling_mask=SamplingMaskLists(
                    np.array([4, 5, 6], dtype=np.int32), np.array([0, 2], dtype=np.int64), [0, 1]
                ),
                spec_decode_metrics=RequestSpecDecodeMetrics(2, [1, 0, 1], 4, [0, 2], [2, 2]),
                prompt_token_id_logprobs=torch.tensor([[-1.0, -2.0]]),
                routed_experts=np.array([[1, 0]], dtype=np.int16),
                pooling_output=torch.tensor([0.5, 0.25]),
                stop_reason=128001,
            ),
            wave_complete=2,
            start_wave=3,
            weight_version="default",
        ),
    }


def main() -> None:
    if vllm.__version__ != VERSION:
        sys.exit(f"needs vLLM {VERSION}, found {vllm.__version__}")
    encoder = MsgpackEncoder()
    decoder = MsgpackDecoder(E.EngineCoreOutputs)
    expected: dict[str, object] = {"vllm": vllm.__version__}
    for name, message in cases().items():
        frames = [bytes(f) for f in encoder.encode(message)]
        for old in HERE.glob(f"{name}.*.bin"):
            old.unlink()
        for i, frame in enumerate(frames):
            (HERE / f"{name}.{i}.bin").write_bytes(frame)
        decoded = decoder.decode(frames)
        expected[name] = {"frames": len(frames), "decoded": jsonable(decoded)}
    text = json.dumps(expected, indent=1, sort_keys=True) + "\n"
    (HERE / "expected.json").write_text(text)
    print(f"wrote {len(expected) - 1} cases to {HERE}")


if __name__ == "__main__":
    main()
