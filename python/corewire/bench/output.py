"""``corewire bench output``: the installed vLLM's ``OutputProcessor`` vs corewire's
``NativeOutputProcessor`` for that release, side by side in one process (any release the
native path is verified against: 0.25.1, 0.33.0, 0.34.0).

Both processors get the same tokenizer (a byte-level BPE trained at run time, wrapped in
vLLM's tokenizer thread pool as vLLM's renderer wraps it), the same requests (DELTA
outputs, stats on, as ``vllm serve`` streams) and the same engine outputs: one token per
request per step, in chunks of 128 as ``AsyncLLM``'s output handler cuts them. Each step
gets a fresh ``IterationStats`` and every collector is drained after it, as the serving
tasks would; releases that stamp each step with the engine's weight version (0.33.0 on) get
vLLM's default one, as ``AsyncLLM``'s output handler passes it. The first (prefill) step
is not timed. Reported: CPU ns per output, median of
interleaved trials, and the ratio. The texts both processors produced are compared.

The scoring case (``prompt logprobs 5``) brings a new batch of one-token requests every
step, each output carrying its prompt's logprobs, and is reported per request; the prompt
logprobs both processors produced are compared too.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from corewire.bench import bpe, common

__all__ = ["add_arguments", "run"]

#: case name -> (top logprobs per token or None, stop strings, flat_logprobs)
CASES: dict[str, tuple[int | None, list[str] | None, bool]] = {
    "plain": (None, None, False),
    "stop strings": (None, ["\x00never", "nor\x00this"], False),
    "logprobs 5": (5, None, False),
    "flat logprobs 5": (5, None, True),
}

#: Scoring cases (case name -> prompt logprobs per position): every timed step brings a
#: new batch of one-token requests whose only output carries the prompt's logprobs, as
#: an evaluation harness scores prompts (``prompt_logprobs`` with ``max_tokens=1``).
#: Reported per request.
SCORING_CASES: dict[str, int] = {"prompt logprobs 5": 5}

#: Prompt tokens of each request (the scoring cases' prompts have this many minus one
#: scored positions).
PROMPT_LEN = 32

#: The output handler's chunk (vLLM's VLLM_V1_OUTPUT_PROC_CHUNK_SIZE default).
CHUNK = 128


@dataclass
class Workload:
    """Pre-built requests and engine steps of one case."""

    requests: list[Any]
    steps: list[list[Any]]


def _workload(
    tok: Any, vocabulary: list[str], case: str, batch: int, steps: int, seed: int
) -> Workload:
    import numpy as np
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.outputs import LogprobsLists

    logprobs, stop, flat = CASES[case]
    rng = random.Random(seed)
    vocab = len(tok)
    requests, texts = [], []
    for i in range(batch):
        ids = tok.encode(bpe.sample_text(rng, 120, vocabulary))
        params = SamplingParams(
            max_tokens=10_000,
            logprobs=logprobs,
            stop=stop,
            output_kind=RequestOutputKind.DELTA,
            flat_logprobs=flat,
        )
        requests.append(_request(i, ids[:PROMPT_LEN], params))
        texts.append(ids[PROMPT_LEN:])
    all_steps = []
    for s in range(steps + 1):
        outputs = []
        for request, generated in zip(requests, texts, strict=True):
            token = generated[s % len(generated)]
            lists = None
            if logprobs is not None:
                ids = [token] + [rng.randrange(vocab) for _ in range(logprobs)]
                values = sorted((rng.uniform(-8.0, 0.0) for _ in ids), reverse=True)
                lists = LogprobsLists(
                    np.array([ids], dtype=np.int32),
                    np.array([values], dtype=np.float32),
                    np.array([rng.randint(1, 20)], dtype=np.int32),
                )
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id, new_token_ids=[token], new_logprobs=lists
                )
            )
        all_steps.append(outputs)
    return Workload(requests, all_steps)


def _request(index: int, ids: list[int], params: Any) -> Any:
    """A vLLM ``EngineCoreRequest`` of prompt ``ids`` (ids ``req-N`` / ``ext-N``)."""
    from vllm.v1.engine import EngineCoreRequest

    request = EngineCoreRequest(
        request_id=f"req-{index}",
        prompt_token_ids=ids,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    request.external_req_id = f"ext-{index}"
    return request


def _scoring_workload(
    tok: Any, vocabulary: list[str], case: str, batch: int, steps: int, seed: int
) -> list[Workload]:
    """One workload per step (the first untimed): ``batch`` new requests, each with one
    output that carries its prompt logprobs (torch tensors, as corewire's decoder hands
    them over) and its only token, finished by length."""
    import torch
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.outputs import LogprobsTensors

    k = SCORING_CASES[case]
    rng = random.Random(seed)
    vocab = len(tok)
    work = []
    for s in range(steps + 1):
        requests, outputs = [], []
        for i in range(batch):
            ids = tok.encode(bpe.sample_text(rng, 120, vocabulary))[: PROMPT_LEN + 1]
            params = SamplingParams(
                max_tokens=1, prompt_logprobs=k, output_kind=RequestOutputKind.DELTA
            )
            request = _request(s * batch + i, ids[:PROMPT_LEN], params)
            rows = [[t] + [rng.randrange(vocab) for _ in range(k)] for t in ids[1:PROMPT_LEN]]
            values = [sorted((rng.uniform(-8.0, 0.0) for _ in r), reverse=True) for r in rows]
            tensors = LogprobsTensors(
                torch.tensor(rows, dtype=torch.int32),
                torch.tensor(values, dtype=torch.float32),
                torch.tensor([rng.randint(1, 20) for _ in rows], dtype=torch.int64),
            )
            requests.append(request)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[ids[PROMPT_LEN]],
                    new_prompt_logprobs_tensors=tensors,
                    finish_reason=FinishReason.LENGTH,
                )
            )
        work.append(Workload(requests, [outputs]))
    return work


def _step_kwargs() -> dict[str, Any]:
    # What AsyncLLM's output handler passes beyond 0.25.1's arguments: the step's weight
    # version (vLLM's engine stamps "default" on every step until weights are updated).
    import vllm

    from corewire import releases

    return {"weight_version": "default"} if releases.installed(vllm).weight_versions else {}


def _measure_scoring(
    processor_cls: type, tok: Any, work: list[Workload]
) -> tuple[float, list[Any]]:
    """CPU ns per request (added, its output processed and collected) over the timed
    steps, and what each request's output carried (text and prompt logprobs)."""
    from vllm.v1.engine.output_processor import RequestOutputCollector
    from vllm.v1.metrics.stats import IterationStats

    processor = processor_cls(tok, log_stats=True)
    got: list[Any] = []
    extra = _step_kwargs()

    def step(batch: Workload) -> None:
        queues = []
        for request in batch.requests:
            queue = RequestOutputCollector(request.sampling_params.output_kind, request.request_id)
            processor.add_request(request, None, None, 0, queue)
            queues.append(queue)
        (outputs,) = batch.steps
        stats = IterationStats()
        for start in range(0, len(outputs), CHUNK):
            processor.process_outputs(outputs[start : start + CHUNK], time.time(), stats, **extra)
        for queue in queues:
            out = queue.get_nowait()
            got.append((out.outputs[0].text, _prompt_logprobs(out.prompt_logprobs)))

    step(work[0])
    gc.collect()
    begin = time.process_time_ns()
    for batch in work[1:]:
        step(batch)
    spent = time.process_time_ns() - begin
    return spent / sum(len(b.requests) for b in work[1:]), got


def _prompt_logprobs(positions: Any) -> Any:
    return [
        None if p is None else [(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in p.items()]
        for p in positions
    ]


def _measure(processor_cls: type, tok: Any, work: Workload) -> tuple[float, list[str]]:
    """CPU ns per output over the timed steps, and each request's text."""
    from vllm.v1.engine.output_processor import RequestOutputCollector
    from vllm.v1.metrics.stats import IterationStats

    processor = processor_cls(tok, log_stats=True)
    extra = _step_kwargs()
    queues = []
    texts: list[list[str]] = []
    for request in work.requests:
        queue = RequestOutputCollector(request.sampling_params.output_kind, request.request_id)
        processor.add_request(request, None, None, 0, queue)
        queues.append(queue)
        texts.append([])

    def step(outputs: list[Any]) -> None:
        stats = IterationStats()
        for start in range(0, len(outputs), CHUNK):
            processor.process_outputs(outputs[start : start + CHUNK], time.time(), stats, **extra)
        for i, queue in enumerate(queues):
            out = queue.get_nowait()
            if out is not None:
                texts[i].append(out.outputs[0].text)

    step(work.steps[0])
    gc.collect()
    begin = time.process_time_ns()
    for outputs in work.steps[1:]:
        step(outputs)
    spent = time.process_time_ns() - begin
    outputs_timed = sum(len(s) for s in work.steps[1:])
    return spent / outputs_timed, ["".join(t) for t in texts]


def _compare(
    case: str, unit: str, measure: Any, tok: Any, work: Any, trials: int, note: str
) -> dict[str, Any]:
    """Interleaved trials of both processors on ``work`` through ``measure``; prints the
    case's line and returns its row (medians under ``unit``)."""
    import vllm
    from vllm.v1.engine.output_processor import OutputProcessor

    from corewire import releases

    # The installed release's class (a subclass per release that changed vLLM's).
    from corewire.vllm.output.by_release import native_output_processor

    NativeOutputProcessor = native_output_processor(releases.installed(vllm))
    ns: dict[str, list[float]] = {"vllm": [], "corewire": []}
    same = True
    for _ in range(trials):
        base, base_got = measure(OutputProcessor, tok, work)
        ours, our_got = measure(NativeOutputProcessor, tok, work)
        ns["vllm"].append(base)
        ns["corewire"].append(ours)
        same = same and base_got == our_got
    vllm_ns, ours_ns = statistics.median(ns["vllm"]), statistics.median(ns["corewire"])
    ratio = vllm_ns / ours_ns
    print(
        f"{case:<16} {vllm_ns:>12,.0f} {ours_ns:>10,.0f} {ratio:>6.2f}x  "
        f"{'identical' if same else 'DIFFERENT'}{note}"
    )
    return {
        "case": case,
        unit: {"vllm": vllm_ns, "corewire": ours_ns},
        "ratio": ratio,
        "identical_texts": same,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--batch", type=int, default=256, help="concurrent requests (256)")
    parser.add_argument("--steps", type=int, default=32, help="timed engine steps (32)")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials (5)")
    common.add_common_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run every case; print the table and the ratios."""
    if not common.check_plot_possible("corewire bench output", args):
        return 2
    from corewire.bench.serve import native_output_missing

    missing = native_output_missing()
    if missing is not None:
        print(f"corewire bench output: {missing}")
        return 2
    baseline = f"vLLM {common.vllm_version()}"
    from vllm.tokenizers.hf import maybe_make_thread_pool

    steps, trials = (8, 3) if args.quick else (args.steps, args.trials)
    trained, vocabulary = bpe.train()
    # As vLLM's renderer does (renderer_num_workers + 1 copies).
    tok = maybe_make_thread_pool(trained, 2)
    print(
        f"output processing, {args.batch} requests x {steps} steps, one token each, "
        f"DELTA, stats on; CPU ns per output, median of {trials} interleaved trials"
    )
    print(f"{'case':<16} {baseline:>12} {'corewire':>10} {'ratio':>7}  texts")
    rows = []
    for case in CASES:
        work = _workload(tok, vocabulary, case, args.batch, steps, seed=1)
        rows.append(_compare(case, "ns_per_output", _measure, tok, work, trials, ""))
    for case in SCORING_CASES:
        scoring = _scoring_workload(tok, vocabulary, case, args.batch, steps, seed=2)
        note = f" (per request: {PROMPT_LEN - 1} scored prompt positions, one token)"
        rows.append(_compare(case, "ns_per_request", _measure_scoring, tok, scoring, trials, note))
    if args.plot:
        plt = common.pyplot()
        fig, ax = plt.subplots(figsize=(6, 3.5))
        x = range(len(rows))
        ax.bar(
            [i - 0.2 for i in x],
            [_ns(r)["vllm"] for r in rows],
            0.4,
            label=baseline,
        )
        ax.bar(
            [i + 0.2 for i in x],
            [_ns(r)["corewire"] for r in rows],
            0.4,
            label="corewire",
        )
        ax.set_xticks(list(x), [r["case"] for r in rows])
        ax.set_ylabel("CPU ns per output (scoring: per request)")
        ax.set_yscale("log")
        ax.legend()
        common.save_figure(fig, args.plot)
    if args.json:
        common.write_json(
            args.json,
            "output",
            baseline=f"{baseline} OutputProcessor",
            options={"batch": args.batch, "steps": steps, "trials": trials},
            cases=rows,
            goals=[],
        )
    return 0 if all(r["identical_texts"] for r in rows) else 1


def _ns(row: dict[str, Any]) -> dict[str, float]:
    return row.get("ns_per_output") or row["ns_per_request"]
