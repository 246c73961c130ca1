#!/usr/bin/env python3
"""The CUDA paths end to end, in a few minutes: what ``scripts/device-check`` runs on a
machine with a GPU (``--device cpu`` runs the same checks here, without one).

Each check starts real engine processes (corewire's reference engine, its torch model
on ``--device``) behind corewire's clients over real ZeroMQ sockets, and holds what
comes back to the same engine run on the CPU in float32 where the numbers must agree:

1. ``AsyncMPClient``: the engine reports the device; concurrent greedy requests with
   sampled and prompt logprobs (tensors made on the device) all finish with every token;
   the greedy tokens are the CPU engine's (a count of the ones that differ is printed:
   the GPU's reductions may round otherwise, so there only a majority is required; on
   the CPU every one).
2. Pooling: embeddings made on the device cross as tensors and equal the CPU engine's
   within 1e-3.
3. The codec: a tensor made on the device (float32 and bfloat16) encoded and decoded is
   the same tensor, back on the CPU.
4. ``DPLBAsyncMPClient``: two engines on the device, a burst reaches both, and each
   engine says it runs on the device.

One line per check, ``PASS`` or ``FAIL`` with the reason; the exit status is the number
of failed checks. Not a benchmark: the throughput printed is for orientation only.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from corewire import AsyncMPClient, DPLBAsyncMPClient, Encoder, MsgspecDecoder
from corewire.protocol import (
    EngineCoreRequest,
    FinishReason,
    PoolingParams,
    SamplingParams,
)

#: The reference model's size for the checks: small enough to start in seconds.
MODEL = {"vocab_size": 4096, "d_model": 256, "num_layers": 2, "seed": 0, "max_logprobs": 8}
#: Requests per burst and tokens per request.
REQUESTS, TOKENS = 32, 24
#: Where the CPU's and the device's embeddings may differ (float32 both).
EMBEDDING_TOLERANCE = 1e-3


def _engine_args(device: str) -> dict[str, Any]:
    return {**MODEL, "device": device, "dtype": "float32"}


def _prompt(i: int) -> list[int]:
    return [(7 * i + j * 13) % MODEL["vocab_size"] for j in range(1, 9 + i % 5)]


def _generate(request_id: str, prompt: list[int]) -> EngineCoreRequest:
    params = SamplingParams(
        max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=3
    )
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params)


def _pool(request_id: str, prompt: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=prompt, pooling_params=PoolingParams()
    )


async def _run(client: Any, requests: list[EngineCoreRequest]) -> dict[str, dict[str, Any]]:
    """Send ``requests`` at once; per request its tokens, logprob rows, prompt logprob
    rows, pooling output, finish reason and engine."""
    seen: dict[str, dict[str, Any]] = {
        r.request_id: {"tokens": [], "logprob_rows": 0, "prompt_rows": 0} for r in requests
    }
    for req in requests:
        await client.add_request_async(req)
    pending = set(seen)
    while pending:
        outputs = await asyncio.wait_for(client.get_output_async(), 120)
        for out in outputs.outputs:
            got = seen[out.request_id]
            got["tokens"] += list(out.new_token_ids)
            if out.new_logprobs is not None:
                got["logprob_rows"] += len(out.new_logprobs.logprobs)
            if out.new_prompt_logprobs_tensors is not None:
                got["prompt_rows"] += len(out.new_prompt_logprobs_tensors.logprobs)
            if out.pooling_output is not None:
                got["pooling"] = out.pooling_output
            if out.finish_reason is not None:
                got["finish"], got["engine"] = out.finish_reason, outputs.engine_index
                pending.discard(out.request_id)
    return seen


async def _on(device: str, work: Callable[[Any], Awaitable[Any]], **kwargs: Any) -> Any:
    client = AsyncMPClient(engine_args=_engine_args(device), **kwargs)
    try:
        return await work(client)
    finally:
        client.shutdown()


async def check_generation(device: str) -> str:
    """Concurrent greedy requests with logprobs on ``device``, against the CPU."""
    requests = [_generate(f"g{i}", _prompt(i)) for i in range(REQUESTS)]

    async def work(client: Any) -> tuple[str, dict[str, Any], float]:
        where = (await client.collective_rpc_async("device"))[0]
        start = time.perf_counter()
        seen = await _run(client, requests)
        return where, seen, time.perf_counter() - start

    where, seen, took = await _on(device, work)
    if not where.startswith(device):
        raise AssertionError(f"the engine runs on {where}, not {device}")
    for rid, got in seen.items():
        prompt_len = len(next(r for r in requests if r.request_id == rid).prompt_token_ids)
        if got["finish"] != FinishReason.LENGTH or len(got["tokens"]) != TOKENS:
            raise AssertionError(f"{rid}: {got['finish']}, {len(got['tokens'])} tokens")
        if got["logprob_rows"] != TOKENS or got["prompt_rows"] != prompt_len - 1:
            raise AssertionError(f"{rid}: logprob rows {got['logprob_rows']}/{got['prompt_rows']}")
    _, on_cpu, _ = await _on("cpu", work)
    differ = sum(seen[rid]["tokens"] != on_cpu[rid]["tokens"] for rid in seen)
    # On the CPU both runs are the same computation: every answer must agree. A GPU's
    # reductions round otherwise, which may flip a near tie: a majority must agree.
    allowed = 0 if device == "cpu" else REQUESTS // 2
    if differ > allowed:
        raise AssertionError(f"{differ} of {REQUESTS} greedy answers differ from the CPU's")
    rate = REQUESTS * TOKENS / took
    return f"on {where}: {REQUESTS} requests, {rate:,.0f} tokens/s, {differ} differ from the CPU's"


async def check_pooling(device: str) -> str:
    """Embeddings made on ``device`` cross to the client and equal the CPU's."""
    requests = [_pool(f"p{i}", _prompt(i)) for i in range(8)]

    async def work(client: Any) -> dict[str, torch.Tensor]:
        seen = await _run(client, requests)
        return {rid: got["pooling"] for rid, got in seen.items()}

    here, on_cpu = await _on(device, work), await _on("cpu", work)
    worst = 0.0
    for rid, emb in here.items():
        if emb.device.type != "cpu" or emb.shape != (MODEL["d_model"],):
            raise AssertionError(f"{rid}: {emb.shape} on {emb.device}")
        worst = max(worst, float((emb - on_cpu[rid]).abs().max()))
    if worst > EMBEDDING_TOLERANCE:
        raise AssertionError(f"embeddings differ from the CPU's by {worst:.2e}")
    return f"{len(here)} embeddings of {MODEL['d_model']}, largest difference {worst:.1e}"


async def check_codec(device: str) -> str:
    """Tensors made on ``device`` through corewire's encoder and decoder."""
    encoder, decoder = Encoder(), MsgspecDecoder(torch.Tensor)
    shapes = []
    for dtype in (torch.float32, torch.bfloat16):
        made = torch.arange(4096, device=device, dtype=torch.float32).reshape(64, 64).to(dtype)
        back = decoder.decode([bytes(f) for f in encoder.encode(made)])
        if back.device.type != "cpu" or not torch.equal(back, made.cpu()):
            raise AssertionError(f"{dtype}: the tensor came back as {back.dtype} {back.shape}")
        shapes.append(str(dtype).removeprefix("torch."))
    return "a 64x64 tensor made on the device, " + " and ".join(shapes) + ", unchanged"


async def check_data_parallel(device: str) -> str:
    """Two engines on ``device`` behind the load-balancing DP client."""
    client = DPLBAsyncMPClient(data_parallel_size=2, engine_args=_engine_args(device))
    try:
        seen = await _run(client, [_generate(f"d{i}", _prompt(i)) for i in range(REQUESTS)])
        engines = sorted({got["engine"] for got in seen.values()})
        if engines != [0, 1]:
            raise AssertionError(f"the burst reached engines {engines}")
        # Every engine's answer (a plain collective_rpc asks the first, as vLLM's).
        where = await client.call_utility_consensus_async(
            "collective_rpc", "device", None, (), None
        )
        if not where[0].startswith(device):
            raise AssertionError(f"the engines run on {where}")
        split = [sum(got["engine"] == e for got in seen.values()) for e in engines]
        return f"{REQUESTS} requests over engines {split}, both on {where[0]}"
    finally:
        client.shutdown()


CHECKS = (check_generation, check_pooling, check_codec, check_data_parallel)


def main(argv: list[str] | None = None) -> int:
    """Run every check; the number that failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="torch device (cuda)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("FAIL no CUDA device here (torch.cuda.is_available() is False)")
        return 1
    if args.device.startswith("cuda"):
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    failed = 0
    for check in CHECKS:
        start = time.perf_counter()
        try:
            said = asyncio.run(check(args.device))
        except Exception as exc:  # each check reports; the others still run
            failed += 1
            print(f"FAIL {check.__name__}: {exc!r}")
            traceback.print_exc()
        else:
            print(f"PASS {check.__name__} ({time.perf_counter() - start:.1f} s): {said}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
