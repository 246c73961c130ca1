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
HTTP, other.

Goal (the vLLM issue): the client layer's share of the API server's CPU at least 3x smaller
with corewire than with vLLM's client, and output tokens/s not lower. ``--plot FILE.png``
draws tokens/s and the latency percentiles, ``--json FILE`` writes the results.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corewire._optional import import_optional
from corewire.bench import common

__all__ = ["add_arguments", "run"]

ENGINE = "corewire.engine.synthetic:SyntheticEngine"
PROMPT = "hello tell me a story about the big old house"

#: Layers of the API server's CPU, and the file-path fragments of each. A sample belongs to
#: the layer of its innermost frame that matches (generic modules such as asyncio match
#: nothing, so their time goes to the code that called them).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "receive + decode",
        (
            "vllm/v1/engine/core_client.py",
            "vllm/v1/serial_utils.py",
            "corewire/client/",
            "corewire/codec.py",
            "corewire/vllm/client.py",
            "corewire/vllm/dp_client.py",
            "zmq/",
            "msgspec/",
        ),
    ),
    ("logprobs", ("vllm/v1/engine/logprobs.py", "vllm/logprobs.py")),
    (
        "detokenization",
        ("vllm/v1/engine/detokenizer.py", "vllm/tokenizers/", "tokenizers/", "transformers/"),
    ),
    ("stats", ("vllm/v1/metrics/", "prometheus_client/")),
    (
        "output processing",
        ("vllm/v1/engine/output_processor.py", "vllm/v1/engine/async_llm.py", "vllm/outputs.py"),
    ),
    ("OpenAI serving", ("vllm/entrypoints/", "pydantic/", "pydantic_core/")),
    ("HTTP", ("uvicorn/", "starlette/", "fastapi/", "h11/", "httptools/", "anyio/")),
)
OTHER = "other"
CLIENT_LAYER = "receive + decode"


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
    layers: Counter[str] = field(default_factory=Counter)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_chunk(self) -> float:
        return self.tokens / self.chunks if self.chunks else float("nan")

    @property
    def cpu_per_1k_tokens(self) -> float:
        return 1000 * self.cpu_seconds / self.tokens if self.tokens else float("nan")

    def share(self, layer: str) -> float:
        total = sum(self.layers.values())
        return self.layers[layer] / total if total else float("nan")


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


# ---------------------------------------------------------------------- profile


def classify(stack: str) -> str:
    """The layer of one collapsed py-spy stack (``frame;frame;...``, root first)."""
    for frame in reversed(stack.split(";")):
        for layer, fragments in LAYERS:
            if any(fragment in frame for fragment in fragments):
                return layer
    return OTHER


def read_profile(path: Path) -> Counter[str]:
    """Samples per layer from py-spy's raw (collapsed stacks) output."""
    layers: Counter[str] = Counter()
    if not path.exists():
        return layers
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            layers[classify(stack)] += int(count)
    return layers


@contextlib.contextmanager
def profiled(pid: int, out: Path, enabled: bool):
    """Sample ``pid`` with py-spy (non-blocking: the server is never paused) meanwhile."""
    proc = None
    if enabled:
        proc = subprocess.Popen(
            [
                shutil.which("py-spy") or "py-spy",
                "record",
                "--pid",
                str(pid),
                "--nonblocking",
                "--rate",
                "200",
                "--format",
                "raw",
                "--output",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    try:
        yield
    finally:
        if proc is not None:
            proc.send_signal(2)  # SIGINT: py-spy writes what it has and exits
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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
    cpu0 = sum(server.cpu_times()[:2])
    t0 = time.perf_counter()
    profile = work / f"profile-{result.client}-{result.streams}-{result.logprobs}.txt"
    with profiled(server.pid, profile, args.profile):
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
    result.layers = read_profile(profile)
    stack.check_alive()
    print(
        f"  {result.client:9} {result.streams:4} streams  logprobs {result.logprobs}: "
        f"{result.tokens_per_s:9,.0f} tok/s  {result.tokens_per_chunk:5.1f} tok/chunk  "
        f"{sum(result.layers.values()):6} samples  {result.errors} errors",
        flush=True,
    )
    return result


def report(results: list[Result]) -> list[common.Goal]:
    """Prints the results, the layers and the goals; returns the goals."""
    by_key = {(r.client, r.streams, r.logprobs): r for r in results}
    print()
    print(
        "client    streams lp   req/s    tok/s tok/chunk  TTFT p50/p99 ms   ITL p50/p99 ms"
        "  CPU s/1k tok  client layer  client ms/1k tok"
    )
    for r in results:
        print(
            f"{r.client:9} {r.streams:7} {r.logprobs:2} {r.requests / r.seconds:7.1f}"
            f" {r.tokens_per_s:8,.0f} {r.tokens_per_chunk:9.1f}"
            f" {1e3 * percentile(r.ttft, 50):7.1f}/{1e3 * percentile(r.ttft, 99):7.1f}"
            f"  {1e3 * percentile(r.itl, 50):6.2f}/{1e3 * percentile(r.itl, 99):7.2f}"
            f"  {r.cpu_per_1k_tokens:11.3f}  {100 * r.share(CLIENT_LAYER):10.1f}%"
            f"  {1e3 * r.cpu_per_1k_tokens * r.share(CLIENT_LAYER):16.2f}"
        )
    names = [name for name, _ in LAYERS] + [OTHER]
    print()
    print("API server CPU by layer (% of samples)")
    print(
        f"{'layer':18}"
        + "".join(f" {r.client[:4]}/{r.streams}/{r.logprobs}".rjust(13) for r in results)
    )
    for name in names:
        print(f"{name:18}" + "".join(f"{100 * r.share(name):13.1f}" for r in results))
    print()
    found: list[common.Goal] = []
    for (client, streams, logprobs), r in by_key.items():
        if client != "corewire" or ("vllm", streams, logprobs) not in by_key:
            continue
        base = by_key[("vllm", streams, logprobs)]
        share_ratio = (
            base.share(CLIENT_LAYER) / r.share(CLIENT_LAYER)
            if r.share(CLIENT_LAYER)
            else float("inf")
        )
        tok_ratio = r.tokens_per_s / base.tokens_per_s if base.tokens_per_s else float("nan")
        cpu_ratio = base.cpu_per_1k_tokens / r.cpu_per_1k_tokens
        ok_share = share_ratio >= 3 or not r.layers
        ok_tok = tok_ratio >= 0.97  # within noise of "not lower"
        scenario = f"{streams} streams, logprobs {logprobs}"
        if r.layers:
            found.append(common.Goal(f"{scenario}: client layer share x smaller", share_ratio, 3))
        found.append(common.Goal(f"{scenario}: tokens/s x vllm (not lower)", tok_ratio, 0.97))
        print(
            f"{streams:4} streams, logprobs {logprobs}: client layer {share_ratio:5.1f}x smaller "
            f"({'met' if ok_share else 'MISS'} >= 3x), tokens/s {tok_ratio:.2f}x "
            f"({'met' if ok_tok else 'MISS'} not lower), "
            f"API server CPU per token {cpu_ratio:.2f}x less"
        )
    return found


def as_case(r: Result) -> dict[str, Any]:
    """One (client, scenario) result as the JSON file holds it."""
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
        "api_server_cpu_s_per_1k_tokens": r.cpu_per_1k_tokens,
        "cpu_share_by_layer": {name: r.share(name) for name in [n for n, _ in LAYERS] + [OTHER]},
        "profile_samples": sum(r.layers.values()),
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
    parser.add_argument("--no-stats", action="store_true", help="vllm serve --disable-log-stats")


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
    from corewire.vllm.model_dir import write_model_dir

    if args.quick:
        args.rounds = 1
        args.seconds = 0.0
    if args.profile and shutil.which("py-spy") is None:
        print("py-spy not found: no profile (pip install py-spy)")
        args.profile = False
    print(
        f"serve benchmark  {time.strftime('%Y-%m-%d')}  {os.cpu_count()} cores  "
        f"python {platform.python_version()}  max_tokens {args.max_tokens}"
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
