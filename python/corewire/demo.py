"""``corewire demo``: stream concurrent requests through the reference engine.

Starts one engine process (the built-in reference model unless ``--engine`` names
another), sends ``--requests`` streaming requests with at most ``--concurrency`` in
flight, shows its progress on stderr, and prints throughput and latency percentiles:
time to first token (TTFT) and inter-token latency (ITL).

The progress is tqdm's bar when stderr is a terminal (redrawn in place, with throughput
and recent TTFT/ITL percentiles after it) and a plain line every few seconds otherwise
(logs and CI keep no carriage returns). tqdm rather than rich: the demo needs one line
redrawn in place, which tqdm does in one small pure-Python package without dependencies
(rich brings pygments and markdown-it-py for layouts the demo does not use), and it
already sits in every vLLM installation. Its redraw pads over a shorter line, so no
characters of an old one stay behind.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs shipped

from corewire._optional import MissingDependency
from corewire.engine.startup import describe_error
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
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
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


class _Bar(tqdm):
    """tqdm's bar without its monitor thread: the demo redraws it itself, often enough."""

    monitor_interval = 0


class _Progress:
    """Progress on ``stream``: tqdm's bar, redrawn in place, on a terminal; a plain line
    every :attr:`PLAIN_INTERVAL_S` seconds otherwise. Both show throughput and the
    percentiles of the most recent TTFT and ITL samples."""

    #: Seconds between redraws of the bar, and between plain lines.
    LIVE_INTERVAL_S = 0.2
    PLAIN_INTERVAL_S = 2.0
    #: Latency samples the live percentiles cover (the most recent ones).
    WINDOW = 4096

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        live = enabled and self.stream.isatty()
        self.plain = enabled and not live
        self.interval = self.LIVE_INTERVAL_S if live else self.PLAIN_INTERVAL_S
        self.start = time.perf_counter()
        self._drawn = self.start
        self.ttft_ms: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self.itl_ms: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self.bar: _Bar | None = None
        if live:
            # smoothing=0: the rate is the run's average, as in the final summary.
            self.bar = _Bar(
                total=total, unit="req", desc="demo", file=self.stream, dynamic_ncols=True,
                smoothing=0, mininterval=0, leave=True,
            )  # fmt: skip

    def _stats(self, tokens: int, now: float) -> str:
        rate = tokens / max(1e-9, now - self.start)
        parts = [f"{rate:,.0f} tok/s"]
        for label, samples in (("TTFT", self.ttft_ms), ("ITL", self.itl_ms)):
            if samples:
                p50, p99 = _percentiles(list(samples), (50, 99))
                parts.append(f"{label} p50 {p50:.1f} p99 {p99:.1f} ms")
        return ", ".join(parts)

    def update(self, done: int, tokens: int, force: bool = False) -> None:
        """Show ``done`` finished requests and ``tokens`` tokens so far (at most once per
        interval unless ``force``)."""
        now = time.perf_counter()
        if not (self.bar or self.plain) or (not force and now - self._drawn < self.interval):
            return
        self._drawn = now
        stats = self._stats(tokens, now)
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix_str(stats, refresh=False)
            self.bar.refresh()
        else:
            print(f"corewire demo: {done}/{self.total} requests, {stats}", file=self.stream)
            self.stream.flush()

    def close(self) -> None:
        """End the bar's line (nothing to do for plain lines)."""
        if self.bar is not None:
            self.bar.close()


class _StartFailed(Exception):
    """The engine did not start; the message is the one line the user sees."""


def _start_client(args: argparse.Namespace) -> tuple[Any, float]:
    """The demo's client and its start-up time; :class:`_StartFailed` when it fails."""
    from corewire.client import AsyncMPClient

    try:
        engine_args = json.loads(args.engine_args) if args.engine_args else None
        started = time.perf_counter()
        client = AsyncMPClient(engine=args.engine, engine_args=engine_args)
    except MissingDependency as exc:
        raise _StartFailed(str(exc)) from exc
    except RuntimeError as exc:  # the engine process's own error is in the message
        raise _StartFailed(str(exc)) from exc
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        # Found in this process before any engine started (corewire.engine.startup).
        raise _StartFailed(f"the engine failed to start: {describe_error(exc)}") from exc
    return client, time.perf_counter() - started


def _demo_request(args: argparse.Namespace, rng: random.Random, request_id: str) -> Any:
    """One demo request: a random prompt, streaming exactly ``max_tokens`` tokens."""
    from corewire.protocol import EngineCoreRequest, SamplingParams

    prompt = [rng.randrange(3, 4096) for _ in range(args.prompt_len)]
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=True,  # every request streams exactly max_tokens tokens
    )
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        arrival_time=time.time(),
    )


def _latencies(streams: Iterable[_Stream]) -> tuple[list[float], list[float]]:
    """Time to first token and inter-token latencies of ``streams``, in ms."""
    streams = list(streams)
    ttft = [(s.token_times[0] - s.sent) * 1e3 for s in streams if s.token_times]
    itl = [
        (b - a) * 1e3
        for s in streams
        for a, b in zip(s.token_times, s.token_times[1:], strict=False)
    ]
    return ttft, itl


async def _demo(args: argparse.Namespace) -> dict[str, Any]:
    client, startup = _start_client(args)
    progress = _Progress(args.requests, not args.no_progress)
    try:
        rng = random.Random(args.seed)
        streams: dict[str, _Stream] = {}
        finished = 0
        tokens = 0

        async def dispatch() -> None:
            nonlocal finished, tokens
            while finished < args.requests:
                outputs = await client.get_output_async()
                now = time.perf_counter()
                for out in outputs.outputs:
                    stream = streams[out.request_id]
                    count = len(out.new_token_ids)
                    if count:
                        times = stream.token_times
                        if times:
                            progress.itl_ms.append((now - times[-1]) * 1e3)
                        else:
                            progress.ttft_ms.append((now - stream.sent) * 1e3)
                        times.extend([now] * count)
                    tokens += count
                    if out.finish_reason is not None:
                        finished += 1
                        assert stream.done is not None
                        stream.done.set_result(None)
                progress.update(finished, tokens)

        slots = asyncio.Semaphore(args.concurrency)
        loop = asyncio.get_running_loop()

        async def one(index: int) -> None:
            request = _demo_request(args, rng, f"demo-{index}")
            async with slots:
                stream = streams[request.request_id] = _Stream(sent=time.perf_counter())
                stream.done = loop.create_future()
                await client.add_request_async(request)
                await stream.done

        t0 = time.perf_counter()
        # The dispatcher is gathered too: when the engine dies it raises at once, while
        # the requests would wait for outputs that never come.
        await asyncio.gather(dispatch(), *(one(i) for i in range(args.requests)))
        elapsed = time.perf_counter() - t0
        progress.update(finished, tokens, force=True)
    finally:
        progress.close()
        client.shutdown()
    ttft, itl = _latencies(streams.values())
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
    except _StartFailed as exc:
        print(f"corewire demo: {exc}", file=sys.stderr)
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
