"""``corewire demo``: stream concurrent requests through the reference engine.

Starts one engine process (the built-in reference model unless ``--engine`` names
another), sends ``--requests`` streaming requests with at most ``--concurrency`` in
flight, shows a progress bar on stderr, and prints throughput and latency percentiles:
time to first token (TTFT) and inter-token latency (ITL).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from corewire.errors import EngineDeadError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the demo's flags."""
    parser.add_argument("--requests", type=int, default=256, help="requests to send (256)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (32)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request (128)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (32)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts (0)")
    parser.add_argument(
        "--engine", default=None, help="engine class as module:Class (default: reference)"
    )
    parser.add_argument(
        "--engine-args", default=None, help="JSON object of engine constructor arguments"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")


@dataclass
class _Stream:
    """Timestamps of one request."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    done: asyncio.Future[None] | None = None


def _percentiles(values: list[float], points: tuple[int, ...] = (50, 90, 99)) -> list[float]:
    """Nearest-rank percentiles (0.0 for an empty list)."""
    if not values:
        return [0.0 for _ in points]
    ordered = sorted(values)
    last = len(ordered) - 1
    return [ordered[min(last, round(p / 100 * last))] for p in points]


class _Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()
        self._drawn = 0.0

    def update(self, done: int, tokens: int, force: bool = False) -> None:
        """Redraw with ``done`` finished requests and ``tokens`` tokens so far."""
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._drawn < 0.1):
            return
        self._drawn = now
        width = 30
        filled = width * done // max(1, self.total)
        rate = tokens / max(1e-9, now - self.start)
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests "
            f"{tokens} tokens {rate:,.0f} tok/s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        """End the line."""
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


async def _demo(args: argparse.Namespace) -> dict[str, Any]:
    from corewire.client import AsyncMPClient
    from corewire.protocol import EngineCoreRequest, SamplingParams

    engine_args = json.loads(args.engine_args) if args.engine_args else None
    started = time.perf_counter()
    client = AsyncMPClient(engine=args.engine, engine_args=engine_args)
    startup = time.perf_counter() - started
    try:
        rng = random.Random(args.seed)
        streams: dict[str, _Stream] = {}
        progress = _Progress(args.requests, not args.no_progress)
        finished = 0
        tokens = 0

        async def dispatch() -> None:
            nonlocal finished, tokens
            while finished < args.requests:
                outputs = await client.get_output_async()
                now = time.perf_counter()
                for out in outputs.outputs:
                    stream = streams[out.request_id]
                    stream.token_times.extend([now] * len(out.new_token_ids))
                    tokens += len(out.new_token_ids)
                    if out.finish_reason is not None:
                        finished += 1
                        assert stream.done is not None
                        stream.done.set_result(None)
                progress.update(finished, tokens)

        slots = asyncio.Semaphore(args.concurrency)
        loop = asyncio.get_running_loop()

        async def one(index: int) -> None:
            prompt = [rng.randrange(3, 4096) for _ in range(args.prompt_len)]
            params = SamplingParams(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                ignore_eos=True,  # every request streams exactly max_tokens tokens
            )
            async with slots:
                request_id = f"demo-{index}"
                stream = streams[request_id] = _Stream(sent=time.perf_counter())
                stream.done = loop.create_future()
                await client.add_request_async(
                    EngineCoreRequest(
                        request_id=request_id,
                        prompt_token_ids=prompt,
                        sampling_params=params,
                        arrival_time=time.time(),
                    )
                )
                await stream.done

        t0 = time.perf_counter()
        # The dispatcher is gathered too: when the engine dies it raises at once, while
        # the requests would wait for outputs that never come.
        await asyncio.gather(dispatch(), *(one(i) for i in range(args.requests)))
        elapsed = time.perf_counter() - t0
        progress.update(finished, tokens, force=True)
        progress.close()
    finally:
        client.shutdown()
    ttft = [(s.token_times[0] - s.sent) * 1e3 for s in streams.values() if s.token_times]
    itl = [
        (b - a) * 1e3
        for s in streams.values()
        for a, b in zip(s.token_times, s.token_times[1:], strict=False)
    ]
    return {
        "startup_s": startup,
        "elapsed_s": elapsed,
        "requests": args.requests,
        "tokens": tokens,
        "ttft_ms": _percentiles(ttft),
        "itl_ms": _percentiles(itl),
    }


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    for name in ("requests", "concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            print(f"corewire demo: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.prompt_len < 1:
        print("corewire demo: --prompt-len must be at least 1", file=sys.stderr)
        return 2
    try:
        if args.uvloop:
            import uvloop

            result = uvloop.run(_demo(args))
        else:
            result = asyncio.run(_demo(args))
    except EngineDeadError as exc:
        print(f"corewire demo: the engine core died: {exc}", file=sys.stderr)
        return 1
    engine = args.engine or "reference engine"
    print(
        f"corewire demo: {result['requests']} requests x {args.max_tokens} tokens, "
        f"concurrency {args.concurrency}, prompt {args.prompt_len} tokens ({engine})"
    )
    elapsed = result["elapsed_s"]
    print(f"  engine start     {result['startup_s']:8.2f} s")
    print(f"  run time         {elapsed:8.2f} s")
    print(f"  requests/s       {result['requests'] / elapsed:8.2f}")
    print(f"  tokens/s         {result['tokens'] / elapsed:8.1f}")
    for label, key in (("TTFT", "ttft_ms"), ("ITL ", "itl_ms")):
        p50, p90, p99 = result[key]
        print(f"  {label} ms         p50 {p50:7.2f}   p90 {p90:7.2f}   p99 {p99:7.2f}")
    return 0
