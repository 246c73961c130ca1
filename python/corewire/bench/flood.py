"""``corewire bench client --flood SECONDS``: a request flood into one engine, corewire's
``AsyncMPClient`` (input backlog bounded, ``max_input_backlog``) vs the installed vLLM's
``AsyncMPClient`` (unbounded), side by side in this process.

Each client drives its own corewire engine process (the synthetic engine: no model, one
token per request here) over ipc. A producer coroutine adds requests (a 64-token prompt,
``max_tokens=1``) as fast as ``add_request_async`` returns, yielding to the loop every
:data:`YIELD_EVERY` requests as a serving front-end's many tasks do, for SECONDS; a
consumer task takes the outputs meanwhile. A thread samples the RSS of this process and
of the engine every 50 ms. Then the run waits (up to :data:`DRAIN_S`) for every request's
answer. Printed per client: the bound, requests added per second, the peak RSS growth of
the client (over its RSS before the flood: in the first half of the flood, and in all; a
flat memory has the two equal) and of the engine, and the requests answered; then the
ratios. corewire's client also runs with ``max_input_backlog=None`` (``no bound``): what
the bound saves.

Each flood runs in a fresh child process (spawned by this run, one after the other): a
process keeps the heap an earlier flood grew, and a later flood would grow into it
without its RSS showing it.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from corewire.client.input_backlog import FROM_ENVIRONMENT, resolve_max_input_backlog
from corewire.engine.launch import run_engine_core

__all__ = ["flood_both"]

SYNTHETIC = "corewire.engine.synthetic:SyntheticEngine"
#: Prompt tokens per request.
PROMPT_LEN = 64
#: Requests added between two yields to the loop (the consumer and output task run then).
YIELD_EVERY = 32
#: Seconds to wait after the flood for every answer.
DRAIN_S = 120.0
#: RSS sampling period, seconds.
SAMPLE_S = 0.05


class _Peak:
    """Peak RSS of this process and of the engine, sampled in a thread."""

    def __init__(self, engine_pid: int) -> None:
        self.procs = [psutil.Process(), psutil.Process(engine_pid)]
        self.base = [p.memory_info().rss for p in self.procs]
        self.peak = list(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            for i, proc in enumerate(self.procs):
                try:
                    self.peak[i] = max(self.peak[i], proc.memory_info().rss)
                except psutil.NoSuchProcess:
                    return

    def client_growth(self) -> int:
        """The client's peak growth so far, in bytes."""
        return self.peak[0] - self.base[0]

    def stop(self) -> tuple[int, int]:
        """Stop; the peak growth of (client, engine) in bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak[0] - self.base[0], self.peak[1] - self.base[1]


async def _flood(
    client: Any, make: Callable[[int], Any], engine_pid: int, seconds: float
) -> dict[str, Any]:
    answered = 0

    async def consume() -> None:
        nonlocal answered
        while True:
            outputs = await client.get_output_async()
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    answered += 1

    consumer = asyncio.get_running_loop().create_task(consume())
    await asyncio.sleep(0.5)  # the output task starts
    gc.collect()
    peak = _Peak(engine_pid)
    sent = 0
    add = client.add_request_async
    start = time.perf_counter()
    half = start + seconds / 2
    end = start + seconds
    half_growth = None
    try:
        while (now := time.perf_counter()) < end:
            if half_growth is None and now >= half:
                half_growth = peak.client_growth()
            for _ in range(YIELD_EVERY):
                await add(make(sent))
                sent += 1
            await asyncio.sleep(0)
        elapsed = time.perf_counter() - start
        drain_end = time.monotonic() + DRAIN_S
        while answered < sent and time.monotonic() < drain_end:
            await asyncio.sleep(0.05)
        drained = time.perf_counter() - start - elapsed
    finally:
        growth = peak.stop()
        consumer.cancel()
    return {
        "sent": sent,
        "seconds": elapsed,
        "rate": sent / elapsed,
        "answered": answered,
        "drain_s": drained,
        "client_peak_mb": growth[0] / 2**20,
        "client_half_mb": (half_growth or 0) / 2**20,
        "engine_peak_mb": growth[1] / 2**20,
    }


def _corewire(seconds: float, bound: int | None) -> dict[str, Any]:
    from corewire.client import AsyncMPClient
    from corewire.protocol import EngineCoreRequest, SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    prompt = list(range(10, 10 + PROMPT_LEN))

    def make(i: int) -> Any:
        return EngineCoreRequest(
            request_id=f"f-{i}", prompt_token_ids=prompt, sampling_params=params
        )

    async def run() -> dict[str, Any]:
        client = AsyncMPClient(engine=SYNTHETIC, max_input_backlog=bound)
        try:
            result = await _flood(client, make, client.engine_pids[0], seconds)
            backlog = client._input_backlog(client.core_engine)
            result["pauses"] = backlog.pauses
            return result
        finally:
            client.shutdown()

    return asyncio.run(run())


def _vllm(seconds: float) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    from corewire.bench.vllm_client import VllmClient

    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    prompt = list(range(10, 10 + PROMPT_LEN))

    def make(i: int) -> Any:
        return EngineCoreRequest(
            request_id=f"f-{i}",
            prompt_token_ids=prompt,
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )

    async def run() -> dict[str, Any]:
        bench = VllmClient("0.25.1", start_engine=_start_synthetic)
        try:
            return await _flood(bench.client, make, bench.proc.pid, seconds)
        finally:
            bench.shutdown()

    return asyncio.run(run())


def _start_synthetic(input_address: str, output_address: str, release: str) -> Any:
    """A corewire engine process (synthetic engine) for vLLM's client to connect to."""
    proc = multiprocessing.get_context("spawn").Process(
        target=run_engine_core,
        kwargs={
            "engine_index": 0,
            "input_address": input_address,
            "output_address": output_address,
            "engine": SYNTHETIC,
            "parent_pid": os.getpid(),
            "release": release,
        },
        name="flood-engine",
        daemon=True,
    )
    proc.start()
    return proc


def _line(name: str, bound: str, r: dict[str, Any]) -> str:
    return (
        f"{name:<24} bound {bound:>7}  {r['rate']:>8,.0f} req/s  client peak "
        f"+{r['client_half_mb']:.1f} MB at half time, +{r['client_peak_mb']:.1f} MB in all  "
        f"engine peak +{r['engine_peak_mb']:.1f} MB  "
        f"answered {r['answered']:,}/{r['sent']:,} ({r['drain_s']:.1f} s after)"
    )


def _variant(name: str, seconds: float, bound: int | None, conn: Any) -> None:
    """Child process: run one flood, send its results back."""
    try:
        result = _vllm(seconds) if name == "vllm" else _corewire(seconds, bound)
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    conn.send(result)


def _run_variant(name: str, seconds: float, bound: int | None) -> dict[str, Any]:
    """One flood in a fresh child process: its RSS growth is its own (a process that ran
    an earlier flood keeps that heap, and a later flood would grow into it unseen)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_variant, args=(name, seconds, bound, child), name=f"flood-{name}")
    proc.start()
    child.close()
    try:
        result: dict[str, Any] = parent.recv()
    except EOFError:
        result = {"error": f"the {name} flood process died (exit status {proc.exitcode})"}
    proc.join(30)
    if "error" in result:
        raise RuntimeError(f"{name} flood: {result['error']}")
    return result


def flood_both(seconds: float, use_vllm: bool) -> dict[str, Any]:
    """Run the flood with corewire's client (its default bound, or
    ``COREWIRE_MAX_INPUT_BACKLOG``), vLLM's, and corewire's without a bound, each in a
    fresh child process, one after the other; print and return the results."""
    bound = resolve_max_input_backlog(FROM_ENVIRONMENT)
    bound_text = "none" if bound is None else f"{bound / 2**20:g} MiB"
    print(
        f"flood: {seconds:g} s per client into one synthetic engine, prompt {PROMPT_LEN} "
        "tokens, max_tokens 1"
    )
    results: dict[str, Any] = {"bound": bound}
    c = results["corewire"] = _run_variant("corewire", seconds, bound)
    print(_line("corewire", bound_text, c))
    if use_vllm:
        v = results["vllm"] = _run_variant("vllm", seconds, None)
        print(_line("vllm (AsyncMPClient)", "none", v))
    if bound is not None:
        u = results["unbounded"] = _run_variant("corewire", seconds, None)
        print(_line("corewire, no bound", "none", u))
    growth = max(c["client_peak_mb"], 0.1)
    if use_vllm:
        print(
            f"ratios: req/s corewire/vllm {c['rate'] / v['rate']:.2f}x; client peak growth "
            f"vllm/corewire {v['client_peak_mb'] / growth:.2f}x"
            + (
                f"; corewire unbounded/bounded {u['client_peak_mb'] / growth:.2f}x"
                if bound is not None
                else ""
            )
        )
    return results
