"""corewire's decoded outputs inside vLLM 0.25.1's own output processing.

Frames come from vLLM's real ``MsgpackEncoder``; each is decoded twice, by vLLM's
``MsgpackDecoder`` and by the native decoder that corewire's vLLM client uses, and both
results go through vLLM's real ``OutputProcessor`` (and its stats objects). Every
``RequestOutput``, every finished-request stat and every scheduler stat must come out the
same.

Checks ``docs/protocol.md`` §5.2-§5.5 (outputs, finish and stop reasons, events, stats)
and §5.7 (logprobs) by their meaning to vLLM's output processing.
"""

from __future__ import annotations

import dataclasses
import random
import re

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from vllm.v1.engine.output_processor import (
    OutputProcessor,
    RequestOutputCollector,
)
from vllm.v1.metrics.stats import (
    IterationStats,
    PrefillStats,
    PrefixCacheStats,
    SchedulerStats,
)
from vllm.v1.outputs import LogprobsLists
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from corewire.vllm.adapters.client import make_output_decoder
from vllm_support import require_vllm_0_25_1

require_vllm_0_25_1()

# Measured against the wall clock when the output is processed, so never equal twice.
_WALL_CLOCK = re.compile(r"first_token_latency=[-0-9.e]+")

KINDS = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)


def _request(rng: random.Random, index: int) -> EngineCoreRequest:
    logprobs = rng.choice([None, 0, 2, 5])
    params = SamplingParams(
        max_tokens=rng.randint(1, 12),
        logprobs=logprobs,
        output_kind=rng.choice(KINDS),
        detokenize=False,
    )
    return EngineCoreRequest(
        request_id=f"req-{index}",
        prompt_token_ids=[rng.randrange(1, 4096) for _ in range(rng.randint(1, 6))],
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=1000.0 + index,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=f"req-{index}",
    )


def _logprobs(rng: random.Random, k: int, sampled: int) -> LogprobsLists:
    ids = np.array([[sampled] + [rng.randrange(4096) for _ in range(k)]], dtype=np.int32)
    values = np.sort(np.array([[rng.uniform(-9, 0) for _ in range(k + 1)]], dtype=np.float32))
    return LogprobsLists(ids, values[:, ::-1].copy(), np.array([rng.randint(1, 9)], np.int32))


def _step(
    rng: random.Random, live: dict[str, tuple[EngineCoreRequest, int]], t: float
) -> EngineCoreOutputs:
    """One engine step: a token for every live request; some finish."""
    outputs = []
    for request_id, (request, produced) in list(live.items()):
        params = request.sampling_params
        token = rng.randrange(4096)
        finish = None
        produced += 1
        if produced >= params.max_tokens:
            finish = FinishReason.LENGTH
        elif rng.random() < 0.1:
            finish = rng.choice([FinishReason.STOP, FinishReason.ABORT])
        first = produced == 1
        outputs.append(
            EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[token],
                new_logprobs=None
                if params.logprobs is None
                else _logprobs(rng, params.logprobs, token),
                finish_reason=finish,
                stop_reason=rng.choice([None, 7, "stop-word"])
                if finish is FinishReason.STOP
                else None,
                events=[
                    EngineCoreEvent(EngineCoreEventType.QUEUED, t - 0.02),
                    EngineCoreEvent(EngineCoreEventType.SCHEDULED, t - 0.01),
                ]
                if first
                else None,
                prefill_stats=PrefillStats(
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_computed_tokens=len(request.prompt_token_ids),
                    num_cached_tokens=rng.randint(0, len(request.prompt_token_ids)),
                )
                if first
                else None,
                kv_transfer_params={"step": produced} if rng.random() < 0.1 else None,
            )
        )
        if finish is None:
            live[request_id] = (request, produced)
        else:
            del live[request_id]
    stats = SchedulerStats(
        num_running_reqs=len(live),
        num_waiting_reqs=rng.randint(0, 3),
        kv_cache_usage=rng.random(),
        prefix_cache_stats=PrefixCacheStats(requests=2, queries=10, hits=rng.randint(0, 10)),
    )
    return EngineCoreOutputs(engine_index=0, outputs=outputs, scheduler_stats=stats, timestamp=t)


def _run(decode, frames_per_step, requests) -> tuple[list, list, list]:
    """Feed decoded steps through a fresh OutputProcessor; what it produced."""
    processor = OutputProcessor(None, log_stats=True)
    queues = {}
    for request in requests:
        queue = RequestOutputCollector(request.sampling_params.output_kind, request.request_id)
        queues[request.request_id] = queue
        processor.add_request(request, None, queue=queue)
    produced, finished, sched = [], [], []
    for frames in frames_per_step:
        decoded = decode(frames)
        stats = IterationStats()
        result = processor.process_outputs(decoded.outputs, decoded.timestamp, stats)
        processor.update_scheduler_stats(decoded.scheduler_stats)
        for request_id, queue in queues.items():
            out = queue.get_nowait()
            if out is not None:
                produced.append((request_id, _WALL_CLOCK.sub("", repr(out))))
        finished.append(
            (
                result.reqs_to_abort,
                stats.num_generation_tokens,
                stats.num_prompt_tokens,
                # e2e_latency is measured against the wall clock: everything else.
                [dataclasses.replace(f, e2e_latency=0.0) for f in stats.finished_requests],
                stats.prompt_token_stats.cached_tokens,
            )
        )
        sched.append(decoded.scheduler_stats)
    return produced, finished, sched


@pytest.mark.parametrize("seed", range(6))
def test_output_processor_sees_the_same_outputs(seed: int) -> None:
    rng = random.Random(seed)
    requests = [_request(rng, i) for i in range(24)]
    live = {r.request_id: (r, 0) for r in requests}
    encoder = MsgpackEncoder()
    steps = []
    t = 5000.0
    while live:
        t += 0.01
        steps.append(encoder.encode(_step(rng, live, t)))
    vllm_decoder = MsgpackDecoder(EngineCoreOutputs)
    native = make_output_decoder()
    expected = _run(vllm_decoder.decode, steps, requests)
    actual = _run(native.decode, steps, requests)
    assert actual[0] == expected[0]
    assert actual[1] == expected[1]
    assert actual[2] == expected[2]
    assert all(isinstance(s, SchedulerStats) for s in actual[2])
    assert len(expected[0]) > 24  # every request produced outputs


def test_stats_are_vllm_objects_by_attribute() -> None:
    encoder = MsgpackEncoder()
    message = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(
                request_id="r",
                new_token_ids=[1],
                prefill_stats=PrefillStats(num_prompt_tokens=3, num_cached_tokens=2),
            )
        ],
        scheduler_stats=SchedulerStats(
            num_running_reqs=1, prefix_cache_stats=PrefixCacheStats(queries=4, hits=3)
        ),
    )
    decoded = make_output_decoder().decode(encoder.encode(message))
    assert decoded.outputs[0].prefill_stats.num_cached_tokens == 2
    assert decoded.scheduler_stats.prefix_cache_stats.hits == 3
    assert decoded.scheduler_stats == message.scheduler_stats


def test_bad_stats_map_rejects_only_that_frame() -> None:
    """A stats map vLLM's typed decoder would refuse is a ProtocolError; the decoder
    goes on with the next frame."""
    import msgspec

    from corewire import ProtocolError

    decoder = make_output_decoder()
    good = MsgpackEncoder().encode(EngineCoreOutputs(outputs=[EngineCoreOutput("r", [1])]))
    bad_payload = msgspec.msgpack.encode([0, [], {"num_running_reqs": "many"}, 0.0])
    with pytest.raises(ProtocolError, match="num_running_reqs"):
        decoder.decode([bad_payload])
    assert decoder.decode(good).outputs[0].new_token_ids == [1]
