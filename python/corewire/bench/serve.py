"""``corewire bench serve``: vLLM 0.25.1's API server with vLLM's client vs corewire's.

Run: ``corewire bench serve`` (a few minutes; ``--quick`` for a short run). Needs vLLM
(``vllm==0.25.1``; without it the command says so and stops, exit status 2) and, on a
machine without a GPU, the CPU platform plugin (``scripts/serve`` installs it), and
py-spy for the profile.

Both stacks are the same processes (:class:`corewire.vllm.stack.ServeStack`): vLLM's
OpenAI-compatible API server started front-end only, with a model-free
:class:`~corewire.engine.synthetic.SyntheticEngine` joining it through vLLM's handshake.
The engine takes a fixed step (``--step-delay``, 5 ms) in which every running request gets
a token, as a real engine batches: up to 51k tokens/s at 256 streams, more than the API
server streams on this machine, and 12.8k at 64 streams (where the server is then measured
by its CPU per token rather than by its ceiling). Only the engine-core client inside
the API server differs: vLLM's own (``--client vllm``) or corewire's through its vLLM
plugin (``COREWIRE_VLLM_CLIENT=1``).

For each client and each scenario (concurrent streams x logprobs), the load generator in
this process keeps ``streams`` streaming completions in flight (``max_tokens`` each) and
measures requests/s, output tokens/s, time to first token and inter-token latency (p50 /
p99), and the API server process's CPU seconds per 1,000 output tokens (from the kernel's
accounting of that process alone), and tokens per SSE chunk (a server that falls behind
merges tokens into fewer chunks, which is cheaper per token). Meanwhile py-spy samples
the API server (non-blocking) and the samples are grouped by layer: receive + decode (the
engine-core client), output processing, detokenization, logprobs, stats, OpenAI serving,
HTTP, other (:mod:`corewire.bench.serve_profile`).

CPython's cyclic garbage collector runs inside whichever allocation crosses its threshold
and scans the server's whole young heap, so a sampling profile charges each collection to
the code that triggered it (often a decode, which allocates in a burst). Two measures keep
that apart: the API server's collector is timed from inside the server
(:mod:`corewire.bench.gc_probe`, injected as a ``sitecustomize`` on its ``PYTHONPATH``;
vLLM and corewire untouched): collector CPU seconds, share of the server's CPU and
collections per generation in each window; and ``--native-profile`` (py-spy ``--native``,
which pauses the server at each sample) puts samples inside the collector in a "garbage
collector" layer, so that the client layer reads both as sampled and with collections
apart.

Goal (the vLLM issue): the client layer's share of the API server's CPU at least 3x smaller
with corewire than with vLLM's client, and output tokens/s not lower. The share is read as
sampled, and with ``--native-profile`` also with collections apart; both are printed and
named. ``--plot FILE.png`` draws tokens/s and the latency percentiles, ``--json FILE``
writes the results.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corewire._optional import import_optional
from corewire.bench import common, gc_times
from corewire.bench.serve_profile import (
    CLIENT_LAYER,
    COLLECTOR,
    LAYERS,
    OTHER,
    Profile,
    profiled,
    read_profile,
)

__all__ = ["add_arguments", "run"]

ENGINE = "corewire.engine.synthetic:SyntheticEngine"
PROMPT = "hello tell me a story about the big old house"
#: Under the work directory: the collector probe's sitecustomize, sockets and files.
GC_PROBE_DIR = "gc-probe"


@dataclass
class Result:
    """What one (client, scenario) run measured."""

    client: str
    streams: int
    logprobs: int
    requests: int = 0
    tokens: int = 0
    errors: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    #: SSE chunks that carried tokens (fewer tokens per chunk costs the server more).
    chunks: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    profile: Profile = field(default_factory=Profile)
    #: The API server's collector during the window (None: the probe did not answer).
    gc: gc_times.GcTimes | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_chunk(self) -> float:
        return self.tokens / self.chunks if self.chunks else float("nan")

    @property
    def cpu_per_1k_tokens(self) -> float:
        return 1000 * self.cpu_seconds / self.tokens if self.tokens else float("nan")

    def share(self, layer: str, *, collections_apart: bool = False) -> float:
        """``layer``'s share of the profile's samples (see :meth:`Profile.share`)."""
        return self.profile.share(layer, collections_apart=collections_apart)

    @property
    def gc_share(self) -> float:
        """The collector's CPU seconds over the API server's, both in the window."""
        if self.gc is None or not self.cpu_seconds:
            return float("nan")
        return self.gc.total_cpu_s / self.cpu_seconds


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``, NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# ---------------------------------------------------------------------- load generator


async def _one_request(session: Any, url: str, body: dict, result: Result) -> None:
    start = time.perf_counter()
    last = None
    tokens = 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            result.errors += 1
            await resp.read()
            return
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage")
            if usage:
                tokens = usage["completion_tokens"]
            if not chunk.get("choices"):
                continue
            now = time.perf_counter()
            result.chunks += 1
            if last is None:
                result.ttft.append(now - start)
            else:
                result.itl.append(now - last)
            last = now
    result.requests += 1
    result.tokens += tokens


async def _load(
    base_url: str, model: str, result: Result, max_tokens: int, total: int, seconds: float = 0.0
) -> None:
    """Keep ``result.streams`` requests in flight until ``total`` were started and
    ``seconds`` have passed (a profile needs enough samples)."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if result.logprobs:
        body["logprobs"] = result.logprobs
    url = f"{base_url}/v1/completions"
    left = total
    aiohttp = import_optional("aiohttp", "the serve benchmark's load generator")
    connector = aiohttp.TCPConnector(limit=result.streams + 8)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal left
            while left > 0 or time.perf_counter() < deadline:
                left -= 1
                await _one_request(session, url, body, result)

        await asyncio.gather(*(worker() for _ in range(result.streams)))


# ---------------------------------------------------------------------- runs


def _bench_stack(**kwargs: Any) -> Any:
    """A :class:`corewire.vllm.stack.ServeStack` with the synthetic engine instead of the
    reference model (imported here: it needs vLLM)."""
    from corewire.vllm.stack import ServeStack

    class BenchStack(ServeStack):
        def engine_command(self, index: int) -> list[str]:
            return [*super().engine_command(index), "--engine", ENGINE]

    return BenchStack(**kwargs)


def run_clients(args: argparse.Namespace, model_dir: Path, work: Path) -> list[Result]:
    """Every client's stack is up at once (an idle one costs nothing); each scenario runs
    on one client right after the other, so that both see the same machine."""
    psutil = import_optional("psutil", "the serve benchmark's CPU accounting")
    engine_args = {"step_delay": args.step_delay, "max_batch": 4096}
    try:
        server_env = gc_times.probe_env(work / GC_PROBE_DIR)
    except gc_times.GcProbeError as exc:
        print(f"no collector timing: {exc}")
        server_env = {}
    results = []
    with contextlib.ExitStack() as stacks:
        servers = {}
        for client in args.clients:
            stack = stacks.enter_context(
                _bench_stack(
                    model_dir=model_dir,
                    port=0,
                    client=client,
                    engines=args.engines,
                    engine_args=engine_args,
                    log_dir=work / f"logs-{client}",
                    extra_server_args=("--disable-log-stats",) if args.no_stats else (),
                    server_env=server_env,
                )
            )
            warm = Result(client, 8, 0)
            asyncio.run(_load(stack.base_url, stack.served_model_name, warm, 16, 32))
            if warm.errors or not warm.tokens:
                raise RuntimeError(f"{client}: the warm-up failed ({warm.errors} errors)")
            servers[client] = (stack, psutil.Process(stack.server.pid))
        for streams in args.streams:
            for logprobs in args.logprobs:
                for client, (stack, server) in servers.items():
                    results.append(
                        _measure(args, work, stack, server, Result(client, streams, logprobs))
                    )
    return results


def _measure(
    args: argparse.Namespace, work: Path, stack: Any, server: Any, result: Result
) -> Result:
    total = max(result.streams * args.rounds, 32)
    # The collector's totals are taken just outside the CPU window: the server is idle
    # there, so no collection falls between the two.
    gc0 = _gc_snapshot(work, server.pid)
    cpu0 = sum(server.cpu_times()[:2])
    t0 = time.perf_counter()
    profile_dir = Path(args.profile_dir) if args.profile_dir else work
    profile = profile_dir / f"profile-{result.client}-{result.streams}-{result.logprobs}.txt"
    with profiled(server.pid, profile, args.profile, native=args.native_profile):
        asyncio.run(
            _load(
                stack.base_url,
                stack.served_model_name,
                result,
                args.max_tokens,
                total,
                args.seconds,
            )
        )
    result.seconds = time.perf_counter() - t0
    result.cpu_seconds = sum(server.cpu_times()[:2]) - cpu0
    gc1 = _gc_snapshot(work, server.pid)
    result.gc = gc1 - gc0 if gc0 is not None and gc1 is not None else None
    result.profile = read_profile(profile, native=args.native_profile)
    stack.check_alive()
    print(
        f"  {result.client:9} {result.streams:4} streams  logprobs {result.logprobs}: "
        f"{result.tokens_per_s:9,.0f} tok/s  {result.tokens_per_chunk:5.1f} tok/chunk  "
        f"collector {100 * result.gc_share:4.1f}% of CPU  "
        f"{result.profile.samples:6} samples"
        + (f" ({result.profile.idle} waiting left out)" if result.profile.native else "")
        + f"  {result.errors} errors",
        flush=True,
    )
    return result


def _gc_snapshot(work: Path, pid: int) -> gc_times.GcTimes | None:
    """The API server's collector totals so far, or None (said once) when the probe is
    missing: the rest of the benchmark stands without them."""
    try:
        return gc_times.snapshot(work / GC_PROBE_DIR, pid)
    except gc_times.GcProbeError as exc:
        if pid not in _GC_PROBE_REPORTED:
            _GC_PROBE_REPORTED.add(pid)
            print(f"  no collector timing for the API server: {exc}", flush=True)
        return None


_GC_PROBE_REPORTED: set[int] = set()


def report(results: list[Result]) -> list[common.Goal]:
    """Prints the results, the collector, the layers and the goals; returns the goals."""
    by_key = {(r.client, r.streams, r.logprobs): r for r in results}
    native = any(r.profile.native for r in results)
    print()
    print(
        "client    streams lp   req/s    tok/s tok/chunk  TTFT p50/p99 ms   ITL p50/p99 ms"
        "  CPU s/1k tok  GC % CPU  client layer  w/o GC  client ms/1k tok"
    )
    for r in results:
        apart = r.share(CLIENT_LAYER, collections_apart=True)
        print(
            f"{r.client:9} {r.streams:7} {r.logprobs:2} {r.requests / r.seconds:7.1f}"
            f" {r.tokens_per_s:8,.0f} {r.tokens_per_chunk:9.1f}"
            f" {1e3 * percentile(r.ttft, 50):7.1f}/{1e3 * percentile(r.ttft, 99):7.1f}"
            f"  {1e3 * percentile(r.itl, 50):6.2f}/{1e3 * percentile(r.itl, 99):7.2f}"
            f"  {r.cpu_per_1k_tokens:11.3f}  {100 * r.gc_share:7.1f}%"
            f"  {100 * r.share(CLIENT_LAYER):10.1f}%"
            + (f" {100 * apart:6.1f}%" if r.profile.native else "       -")
            + f"  {1e3 * r.cpu_per_1k_tokens * r.share(CLIENT_LAYER):16.2f}"
        )
    print(
        "(client layer: as sampled, a collection charged to the code that triggered it; "
        "w/o GC: with collections apart, --native-profile only)"
    )
    _report_collector(results)
    names = [name for name, _ in LAYERS] + [OTHER]
    _report_layers(
        results,
        names,
        "API server CPU by layer (% of samples, as sampled: a collection is charged to the "
        "layer whose allocation triggered it)",
        collections_apart=False,
    )
    if native:
        _report_layers(
            results,
            [*names, COLLECTOR],
            "API server CPU by layer (% of samples, collections apart: samples inside "
            "CPython's gc_collect_* in 'garbage collector')",
            collections_apart=True,
        )
    print()
    found: list[common.Goal] = []
    for (client, streams, logprobs), r in by_key.items():
        if client != "corewire" or ("vllm", streams, logprobs) not in by_key:
            continue
        base = by_key[("vllm", streams, logprobs)]
        scenario = f"{streams} streams, logprobs {logprobs}"
        tok_ratio = r.tokens_per_s / base.tokens_per_s if base.tokens_per_s else float("nan")
        cpu_ratio = base.cpu_per_1k_tokens / r.cpu_per_1k_tokens
        parts = []
        # The goal is read on the client layer as sampled; with a native profile
        # it is also read with collections apart, and both are goals.
        views = [(False, "as sampled")] + ([(True, "collections apart")] if native else [])
        explain = {
            "as sampled": "collections charged to the code that triggered them",
            "collections apart": "samples inside a collection in the collector's own layer",
        }
        for apart, label in views if r.profile.samples else []:
            ratio = _ratio(
                base.share(CLIENT_LAYER, collections_apart=apart),
                r.share(CLIENT_LAYER, collections_apart=apart),
            )
            goal = common.Goal(f"{scenario}: client layer share x smaller ({label})", ratio, 3)
            found.append(goal)
            parts.append(
                f"client layer share {ratio:4.1f}x smaller, {label} ({explain[label]}):"
                f" {'met' if goal.met else 'MISS'} (>= 3x)"
            )
        goal = common.Goal(f"{scenario}: tokens/s x vllm (not lower)", tok_ratio, 0.97)
        found.append(goal)
        parts.append(
            f"tokens/s {tok_ratio:.2f}x vLLM's: {'met' if goal.met else 'MISS'} (not lower)"
        )
        parts.append(f"API server CPU per token {cpu_ratio:.2f}x less")
        print(f"{scenario}:" + "".join(f"\n    {part}" for part in parts))
    if native:
        print(
            "(--native-profile: py-spy paused the API server at every sample, so tokens/s, "
            "latencies and CPU per token of this run are below an unprofiled run's)"
        )
    return found


def _ratio(base: float, value: float) -> float:
    if value != value or base != base:  # NaN: no samples
        return float("nan")
    return base / value if value else float("inf")


def _report_collector(results: list[Result]) -> None:
    """The API server's collector in each window, timed inside the server."""
    if all(r.gc is None for r in results):
        return
    print()
    print(
        "API server's garbage collector (timed in the server by gc.callbacks in the measured "
        "window: CPU time of the collecting thread; wall time also counts waits for a core)"
    )
    print(
        "client    streams lp  GC CPU s  GC wall s  % of server CPU  GC ms/1k tok"
        "  collections gen0/gen1/gen2  GC CPU s gen0/gen1/gen2"
    )
    for r in results:
        if r.gc is None:
            print(f"{r.client:9} {r.streams:7} {r.logprobs:2}  (probe did not answer)")
            continue
        per_1k = 1e3 * 1e3 * r.gc.total_cpu_s / r.tokens if r.tokens else float("nan")
        counts = "/".join(str(c) for c in r.gc.collections)
        seconds = "/".join(f"{s:.2f}" for s in r.gc.cpu_s)
        print(
            f"{r.client:9} {r.streams:7} {r.logprobs:2} {r.gc.total_cpu_s:9.2f}"
            f" {sum(r.gc.wall_s):10.2f} {100 * r.gc_share:15.1f}% {per_1k:13.2f}"
            f"  {counts:>27}  {seconds:>22}"
        )


def _report_layers(
    results: list[Result], names: list[str], title: str, *, collections_apart: bool
) -> None:
    print()
    print(title)
    print(
        f"{'layer':18}"
        + "".join(f" {r.client[:4]}/{r.streams}/{r.logprobs}".rjust(13) for r in results)
    )
    for name in names:
        print(
            f"{name:18}"
            + "".join(
                f"{100 * r.share(name, collections_apart=collections_apart):13.1f}" for r in results
            )
        )


def as_case(r: Result) -> dict[str, Any]:
    """One (client, scenario) result as the JSON file holds it."""
    names = [n for n, _ in LAYERS] + [OTHER]
    return {
        "client": r.client,
        "streams": r.streams,
        "logprobs": r.logprobs,
        "requests": r.requests,
        "tokens": r.tokens,
        "errors": r.errors,
        "seconds": r.seconds,
        "requests_per_s": r.requests / r.seconds if r.seconds else None,
        "tokens_per_s": r.tokens_per_s,
        "tokens_per_chunk": r.tokens_per_chunk,
        "ttft_ms": {f"p{q}": 1e3 * percentile(r.ttft, q) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": 1e3 * percentile(r.itl, q) for q in (50, 90, 99)},
        "api_server_cpu_s": r.cpu_seconds,
        "api_server_cpu_s_per_1k_tokens": r.cpu_per_1k_tokens,
        # As sampled: a collection counts in the layer that triggered it.
        "cpu_share_by_layer": {name: r.share(name) for name in names},
        "cpu_share_by_layer_collections_apart": (
            {name: r.share(name, collections_apart=True) for name in [*names, COLLECTOR]}
            if r.profile.native
            else None
        ),
        "profile_samples": r.profile.samples,
        "profile_native": r.profile.native,
        "profile_waiting_samples_left_out": r.profile.idle,
        "gc": (
            {**r.gc.as_dict(), "share_of_api_server_cpu": r.gc_share} if r.gc is not None else None
        ),
    }


def plot(results: list[Result], path: str) -> None:
    """Output tokens/s, then TTFT and ITL p50/p99, per scenario and client (matplotlib)."""
    plt = common.pyplot()
    scenarios = list(dict.fromkeys((r.streams, r.logprobs) for r in results))
    clients = list(dict.fromkeys(r.client for r in results))
    by_key = {(r.client, r.streams, r.logprobs): r for r in results}
    labels = {"vllm": "vLLM 0.25.1's client", "corewire": "corewire's client (plugin)"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / len(clients)
    ticks = [j + 0.4 - width / 2 for j in range(len(scenarios))]
    tick_labels = [f"{s} streams\nlogprobs {lp}" for s, lp in scenarios]
    for i, client in enumerate(clients):
        xs = [j + i * width for j in range(len(scenarios))]
        rows = [by_key.get((client, s, lp)) for s, lp in scenarios]
        label = labels.get(client, client)
        axes[0].bar(xs, [r.tokens_per_s if r else 0.0 for r in rows], width, label=label)
        for ax, attr in ((axes[1], "ttft"), (axes[2], "itl")):
            p50 = [1e3 * percentile(getattr(r, attr), 50) if r else 0.0 for r in rows]
            p99 = [1e3 * percentile(getattr(r, attr), 99) if r else 0.0 for r in rows]
            ax.bar(xs, p99, width, alpha=0.35, label=f"{label} p99")
            ax.bar(xs, p50, width, label=f"{label} p50")
    axes[0].set_ylabel("output tokens/s (higher is better)")
    axes[0].set_title("throughput")
    axes[1].set_ylabel("ms (lower is better)")
    axes[1].set_title("time to first token, p50 and p99")
    axes[2].set_ylabel("ms (lower is better)")
    axes[2].set_title("inter-token latency, p50 and p99")
    for ax in axes:
        ax.set_xticks(ticks, tick_labels)
        ax.legend(fontsize=7)
    fig.suptitle("vLLM's API server (front-end only) over a synthetic engine")
    common.save_figure(fig, path)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a list of integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected non-negative integers")
    return values


def _clients(text: str) -> list[str]:
    clients = [c for c in text.split(",") if c]
    if not clients or any(c not in ("vllm", "corewire") for c in clients):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a subset of vllm,corewire")
    return clients


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``corewire bench serve``'s flags."""
    common.add_common_arguments(parser)
    parser.add_argument(
        "--streams", type=_ints, default=[64, 256], help="concurrent streams (64,256)"
    )
    parser.add_argument("--logprobs", type=_ints, default=[0, 5], help="logprobs per token (0,5)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request (128)")
    parser.add_argument(
        "--rounds", type=int, default=4, help="at least this many requests per stream (4)"
    )
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="and at least this long per scenario (20)"
    )
    parser.add_argument(
        "--clients", type=_clients, default=["vllm", "corewire"], help="vllm,corewire"
    )
    parser.add_argument("--engines", type=int, default=1, help="engine processes (1)")
    # A model-free engine without a step time steps each request alone as soon as it
    # arrives: one-token frames, a front-end drowned in per-frame work, nothing like a
    # real engine. 5 ms is a fast GPU decode step and makes it batch like one.
    parser.add_argument(
        "--step-delay", type=float, default=0.005, help="engine seconds per step (0.005)"
    )
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="no py-spy")
    parser.add_argument(
        "--native-profile",
        action="store_true",
        help="py-spy --native: samples inside CPython's garbage collector go to a 'garbage "
        "collector' layer, and the client layer is read both as sampled and with collections "
        "apart. py-spy cannot read native stacks without stopping the process, so this PAUSES "
        "the API server at every sample: tokens/s and latencies of such a run are lower",
    )
    parser.add_argument("--no-stats", action="store_true", help="vllm serve --disable-log-stats")
    parser.add_argument(
        "--profile-dir",
        metavar="DIR",
        default=None,
        help="keep py-spy's raw profiles (profile-CLIENT-STREAMS-LOGPROBS.txt) in DIR",
    )


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark; exit status 1 if a goal is missed, 2 if it cannot run."""
    prog = "corewire bench serve"
    if common.vllm_version() is None:
        print(
            f"{prog}: vLLM is not installed, and this benchmark measures vLLM's own API server"
            f" (no in-house baseline can stand in): pip install vllm=={common.VLLM_VERSION}",
            file=sys.stderr,
        )
        return 2
    if not common.check_plot_possible(prog, args):
        return 2
    if args.max_tokens < 1 or args.rounds < 1 or args.engines < 1:
        print(f"{prog}: --max-tokens, --rounds and --engines must be at least 1", file=sys.stderr)
        return 2
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    from corewire.vllm.model_dir import write_model_dir

    if args.quick:
        args.rounds = 1
        args.seconds = 0.0
    if args.native_profile and not args.profile:
        print(f"{prog}: --native-profile and --no-profile contradict each other", file=sys.stderr)
        return 2
    if args.profile and shutil.which("py-spy") is None:
        print("py-spy not found: no profile (pip install py-spy)")
        args.profile = args.native_profile = False
    print(
        f"serve benchmark  {time.strftime('%Y-%m-%d')}  {os.cpu_count()} cores  "
        f"python {platform.python_version()}  max_tokens {args.max_tokens}"
    )
    if args.native_profile:
        print(
            "profile: py-spy --native, which pauses the API server at every sample (200/s): "
            "collections are seen apart, but throughput and latency are lower than unprofiled"
        )
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="corewire-serve-bench-") as tmp:
        work = Path(tmp)
        model_dir = write_model_dir(work / "model")
        results = run_clients(args, model_dir, work)
    found = report(results)
    if args.json:
        common.write_json(
            args.json,
            "serve",
            baseline="vllm" if "vllm" in args.clients else "corewire",
            options={
                "quick": args.quick,
                "streams": args.streams,
                "logprobs": args.logprobs,
                "max_tokens": args.max_tokens,
                "rounds": args.rounds,
                "seconds": args.seconds,
                "clients": args.clients,
                "engines": args.engines,
                "step_delay": args.step_delay,
                "profile": args.profile,
                "native_profile": args.native_profile,
                "stats": not args.no_stats,
            },
            cases=[as_case(r) for r in results],
            goals=found,
        )
        print(f"results written to {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}")
    return 1 if any(not g.met for g in found) else 0
