"""``corewire bench serve``: vLLM 0.25.1's API server with vLLM's stack vs corewire's.

Run: ``corewire bench serve`` (a few minutes; ``--quick`` for a short run). Needs vLLM
(``vllm==0.25.1``; without it the command says so and stops, exit status 2) and, on a
machine without a GPU, the CPU platform plugin (``scripts/serve`` installs it), and
py-spy for the profile.

Every stack is the same processes (:class:`corewire.vllm.serve.stack.ServeStack`): vLLM's
OpenAI-compatible API server started front-end only, with a model-free
:class:`~corewire.engine.synthetic.SyntheticEngine` joining it through vLLM's handshake.
The engine takes a fixed step (``--step-delay``, 5 ms) in which every running request gets
a token, as a real engine batches: up to 51k tokens/s at 256 streams, more than the API
server streams on this machine, and 12.8k at 64 streams (where the server is then measured
by its CPU per token rather than by its ceiling). Only the API server's own code differs
between the stacks (``--clients``, the first three by default):

- ``vllm``: vLLM's own engine-core client and output processing;
- ``corewire``: corewire's engine-core client through its vLLM plugin
  (``COREWIRE_VLLM_CLIENT=1``), vLLM's output processing;
- ``corewire+output``: corewire's client and corewire's native output processing
  (``COREWIRE_VLLM_CLIENT=1`` and ``COREWIRE_VLLM_OUTPUT=1``: detokenization, stop
  strings, logprobs and stats in Rust). Left out of the default, with a note, where the
  installed corewire or vLLM cannot run it (:func:`native_output_missing`);
- ``corewire+fast`` (on request only, vLLM 0.33.0, 0.34.0): ``corewire+output`` with the per-token
  fast path (``COREWIRE_VLLM_FAST_PATH=1``: each stream's chunks after the first written
  from the native output state, :mod:`corewire.vllm.fast_path`), against the fast-path
  issue's goals (:data:`FAST_GOALS`; the moonshot :data:`RUST_MOONSHOT` reported beside
  the ``rust`` stack);
- ``corewire+fast/router`` (on request only, the same): ``corewire+fast`` with its
  direct routes off (``COREWIRE_VLLM_DIRECT_ROUTE=0``): every request through the app's
  router and FastAPI, as before the direct routes, to measure what they save;
- ``corewire+fast/pool`` (on request only, the same): ``corewire+fast`` with every prompt
  tokenized in vLLM's thread pool (``COREWIRE_VLLM_INLINE_TOKENIZE=0``), to measure what
  tokenizing short prompts on the event loop saves;
- ``corewire+fast/render`` (on request only, the same): ``corewire+fast`` with every chat
  template rendered in vLLM's thread pool (``COREWIRE_VLLM_INLINE_RENDER=0``), to measure
  what rendering short chats on the event loop saves (``--chat``);
- ``corewire+fast/envs`` (on request only, the same): ``corewire+fast`` with vLLM's
  environment variables read on every access (``COREWIRE_VLLM_ENVS_CACHE=0``), to
  measure what reading them once saves;
- ``rust`` (on request only): vLLM's own Rust front-end, ``vllm-rs``
  (``VLLM_USE_RUST_FRONTEND=1``), over the same engines with their stats on; no profile
  (nothing in it is Python), no goal: the reference the Python stacks are read against.

The front-end's CPU is counted over all its processes: the API server and its
descendants (``vllm-rs`` under the Rust front-end, vLLM's DP coordinator with DP > 1).

``--engine vllm`` puts vLLM's *own* engine core under each stack instead
(:mod:`corewire.bench.serve_real`): ``vllm serve`` as users start it, on ``--model DIR`` or a
tiny llama with random weights written for the run, on a GPU or with vLLM's CPU build; the
engine cores' CPU is left out of the front-end's. No goal is read there (they were set
over the synthetic engine) and there is no one-token-per-chunk scenario.

Scenarios: every ``--streams`` x ``--logprobs`` pair at ``--step-delay`` (saturation), and
a named one-token-per-chunk scenario (``--chunk-streams`` streams, no logprobs, engine
steps of ``--chunk-step-delay``, 20 ms): the server keeps up with the engine, so that each
SSE chunk carries one token and the per-chunk work of HTTP and OpenAI serving weighs most.
Its tokens per chunk are checked to be about 1.0 (a stack that falls behind merges tokens
into fewer chunks, and the scenario would then measure something else). Scenarios with
another step delay run on stacks of their own, started after the first ones stop.

For each stack and each scenario, the load generator in this process keeps ``streams``
streaming completions in flight (``max_tokens`` each) and measures requests/s, output
tokens/s, time to first token and inter-token latency (p50 / p99), the API server
process's CPU seconds per 1,000 output tokens and its inverse, output tokens per CPU
second (from the kernel's accounting of that process alone), and tokens per SSE chunk (a
server that falls behind merges tokens into fewer chunks, which is cheaper per token).
Meanwhile py-spy samples the API server (non-blocking) and the samples are grouped by
layer: receive + decode (the engine-core client), output processing (vLLM's), output
processing (corewire's native path), detokenization, logprobs, stats, OpenAI serving,
HTTP, other (:mod:`corewire.bench.serve_profile`). With vLLM's output processing, the
decoding of logprob candidates (``transformers/``, ``vllm/tokenizers/``) is charged to
"detokenization", not to "logprobs": with ``logprobs: 5`` that layer is mostly logprob
work.

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

Goals (read against the ``vllm`` stack in the same run; exit status 1 when one is missed):

- ``corewire`` (the vLLM-plugin issue): the client layer's share of the API server's CPU
  at least 3x smaller, and output tokens/s not lower. The share is read as sampled, and
  with ``--native-profile`` also with collections apart; both are goals.
- ``corewire+output`` (the native-output-processing issue): API-server output tokens per
  CPU second at least 1.5x vLLM's at 256 streams without logprobs, 2x at 256 streams
  with ``logprobs: 5``, 1.2x in the one-token-per-chunk scenario; in those scenarios TTFT
  and inter-token latency p99 no worse (within :data:`LATENCY_SLACK`). Other stream
  counts are reported without a goal, and so is every scenario of a run with
  ``--stream-interval`` above 1 (the goals are set for the default server).

``--repeat N`` runs each scenario N rounds, the stacks taking turns (their order reversed
every other round); a stack's rounds are pooled, and its tokens per API-server CPU second
against another stack's is the median of the rounds' paired ratios
(:func:`per_core_ratio`), goals included.

``--plot FILE.png`` draws tokens/s, tokens per API-server CPU second and the latency
percentiles, ``--json FILE`` writes the results.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from corewire._optional import import_optional, is_installed
from corewire.bench import common, gc_times, serve_real, serve_split
from corewire.bench.serve_profile import (
    CLIENT_LAYER,
    COLLECTOR,
    LAYERS,
    NATIVE_OUTPUT_LAYER,
    NATIVE_RATE,
    OTHER,
    RATE,
    Profile,
    profiled,
    read_profile,
)

__all__ = [
    "CHUNK_GOAL",
    "DEFAULT_CLIENTS",
    "LATENCY_SLACK",
    "OUTPUT_SWITCH",
    "STACKS",
    "TOKENS_PER_CORE_GOALS",
    "Result",
    "Scenario",
    "add_arguments",
    "native_output_missing",
    "requests_at_least",
    "run",
    "scenarios",
]

ENGINE = "corewire.engine.synthetic:SyntheticEngine"
PROMPT = "hello tell me a story about the big old house"
#: The marker tokens the model's tokenizer gets under ``--reasoning-parser`` (those of
#: DeepSeek-R1's and most thinking models' parsers).
REASONING_MARKERS = ("<think>", "</think>")
#: Under the work directory: the collector probe's sitecustomize, sockets and files.
GC_PROBE_DIR = "gc-probe"

#: The plugin's switch for corewire's native output processing in vLLM's ``AsyncLLM``
#: (``corewire.vllm.plugin.OUTPUT_SWITCH``, which cannot be imported without vLLM).
OUTPUT_SWITCH = "COREWIRE_VLLM_OUTPUT"
#: The plugin's switch for the per-token fast path of ``vllm serve``
#: (``corewire.vllm.plugin.FAST_PATH_SWITCH``).
FAST_PATH_SWITCH = "COREWIRE_VLLM_FAST_PATH"
#: The fast path's direct routes' own switch (corewire.vllm.fast_path.direct_route.SWITCH;
#: that module is not imported here, as it is only needed where the server runs).
DIRECT_ROUTE_SWITCH = "COREWIRE_VLLM_DIRECT_ROUTE"
#: The fast path's short-prompt tokenization on the loop, its own switch
#: (corewire.vllm.fast_path.inline_tokenize.SWITCH).
INLINE_TOKENIZE_SWITCH = "COREWIRE_VLLM_INLINE_TOKENIZE"
#: The fast path's short-chat rendering on the loop, its own switch
#: (corewire.vllm.fast_path.inline_render.SWITCH).
INLINE_RENDER_SWITCH = "COREWIRE_VLLM_INLINE_RENDER"
#: The fast path's memo of ``vllm.envs``, its own switch
#: (corewire.vllm.fast_path.envs_cache.SWITCH).
ENVS_CACHE_SWITCH = "COREWIRE_VLLM_ENVS_CACHE"
#: The stacks: name -> (the API server's engine-core client for ``ServeStack``, the
#: environment added to the API server's). The output switch is set either way: a
#: ``COREWIRE_VLLM_OUTPUT=1`` in the caller's environment must not reach the baselines.
STACKS: dict[str, tuple[str, dict[str, str]]] = {
    "vllm": ("vllm", {OUTPUT_SWITCH: "0", FAST_PATH_SWITCH: "0"}),
    "corewire": ("corewire", {OUTPUT_SWITCH: "0", FAST_PATH_SWITCH: "0"}),
    "corewire+output": ("corewire", {OUTPUT_SWITCH: "1", FAST_PATH_SWITCH: "0"}),
    # The above with the per-token fast path (corewire.vllm.fast_path): streaming
    # completions' chunks after the first written from the native output state.
    "corewire+fast": ("corewire", {OUTPUT_SWITCH: "1", FAST_PATH_SWITCH: "1"}),
    # The above with every request through the app's router and FastAPI (no direct
    # routes, corewire.vllm.fast_path.direct_route): what the direct routes save.
    "corewire+fast/router": (
        "corewire",
        {OUTPUT_SWITCH: "1", FAST_PATH_SWITCH: "1", DIRECT_ROUTE_SWITCH: "0"},
    ),
    # The fast path with every prompt tokenized in vLLM's pool (inline tokenization off,
    # corewire.vllm.fast_path.inline_tokenize): what tokenizing short prompts on the loop saves.
    "corewire+fast/pool": (
        "corewire",
        {OUTPUT_SWITCH: "1", FAST_PATH_SWITCH: "1", INLINE_TOKENIZE_SWITCH: "0"},
    ),
    # The fast path with every chat template rendered in vLLM's pool (inline rendering off,
    # corewire.vllm.fast_path.inline_render): what rendering short chats on the loop saves.
    "corewire+fast/render": (
        "corewire",
        {OUTPUT_SWITCH: "1", FAST_PATH_SWITCH: "1", INLINE_RENDER_SWITCH: "0"},
    ),
    # The fast path with vLLM's environment variables read on every access, as vLLM's
    # server reads them (corewire.vllm.fast_path.envs_cache): what reading them once saves.
    "corewire+fast/envs": (
        "corewire",
        {OUTPUT_SWITCH: "1", FAST_PATH_SWITCH: "1", ENVS_CACHE_SWITCH: "0"},
    ),
    # vLLM's own Rust front-end (vllm-rs, VLLM_USE_RUST_FRONTEND=1) over the same
    # corewire engines, their stats on: the reference the Python stacks are read against.
    "rust": ("vllm", {OUTPUT_SWITCH: "0", FAST_PATH_SWITCH: "0", "VLLM_USE_RUST_FRONTEND": "1"}),
}
#: The stacks run without ``--clients``: the Python server's (``rust`` on request).
DEFAULT_CLIENTS = ["vllm", "corewire", "corewire+output"]
#: Stacks whose HTTP serving is not Python: py-spy has nothing of theirs to sample.
UNPROFILED = frozenset({"rust"})
#: Short names for the columns of the layer tables.
_SHORT = {
    "vllm": "vllm",
    "corewire": "cw",
    "corewire+output": "cw+out",
    "corewire+fast": "cw+fast",
    "corewire+fast/router": "cw+f/rtr",
    "corewire+fast/pool": "cw+f/pool",
    "corewire+fast/render": "cw+f/rndr",
    "corewire+fast/envs": "cw+f/envs",
    "rust": "rust",
}

#: The native-output-processing issue's goals: output tokens per API-server CPU second,
#: corewire+output over vllm, by (streams, logprobs) of the saturation scenarios. Other
#: stream counts have no stated goal (reported only).
TOKENS_PER_CORE_GOALS: dict[tuple[int, int], float] = {(256, 0): 1.5, (256, 5): 2.0}
#: The same goal in the one-token-per-chunk scenario.
CHUNK_GOAL = 1.2
#: The fast path's goals, as the per-request issue raised them (its predecessor asked 5x
#: with logprobs): output tokens per front-end CPU second, corewire+fast over vllm, by
#: (streams, logprobs); and its moonshot: corewire+fast's CPU per token (per request, at a
#: fixed length) at most this many times the Rust front-end's (where the rust stack ran).
FAST_GOALS: dict[tuple[int, int], float] = {(256, 0): 2.5, (256, 5): 6.0}
RUST_MOONSHOT = 1.3
#: "TTFT and ITL p99 no worse": corewire+output's p99 over vllm's, at most this (p99s of
#: a few thousand samples move by a few percent between identical runs).
LATENCY_SLACK = 1.05
#: The one-token-per-chunk scenario holds when the chunks carry at most this many tokens
#: on average (1.0 exactly when no chunk merges two steps).
ONE_TOKEN_PER_CHUNK = 1.05
CHUNK_SCENARIO = "one token per chunk"


def native_output_missing() -> str | None:
    """Why the ``corewire+output`` stack cannot run here (None: it can): it needs a vLLM
    release the native output path reproduces (the plugin's ``OUTPUT_VLLM_VERSIONS``:
    0.25.1, 0.33.0, 0.34.0) and ``corewire.vllm.output.processor``."""
    version = common.vllm_version()
    if version is None:
        return "vLLM is not installed"
    if not is_installed("corewire.vllm.output.processor"):
        return "this corewire has no native output processing (corewire.vllm.output.processor)"
    from corewire.vllm.plugin import OUTPUT_VLLM_VERSIONS

    if version.split("+", 1)[0] not in OUTPUT_VLLM_VERSIONS:
        return (
            f"corewire's native output processing runs under vLLM "
            f"{', '.join(OUTPUT_VLLM_VERSIONS)}, not the installed {version}"
        )
    return None


def fast_path_missing() -> str | None:
    """Why the ``corewire+fast`` stack cannot run here (None: it can): it needs native
    output processing (:func:`native_output_missing`) under a vLLM release whose server
    the fast path is held to (0.33.0, 0.34.0)."""
    missing = native_output_missing()
    if missing is not None:
        return missing
    version = common.vllm_version()
    assert version is not None
    from corewire.vllm.plugin import FAST_PATH_VLLM_VERSIONS, fast_path_release

    if fast_path_release(version) is None:
        return (
            f"corewire's fast path runs under vLLM {', '.join(FAST_PATH_VLLM_VERSIONS)}, "
            f"not the installed {version}"
        )
    return None


@dataclass(frozen=True)
class Scenario:
    """One load: ``streams`` concurrent streams asking ``logprobs`` each, over engines
    stepping every ``step_delay`` seconds; ``one_token_chunks``: the one-token-per-chunk
    scenario."""

    streams: int
    logprobs: int
    step_delay: float
    one_token_chunks: bool = False
    #: Tokens per request: None, the run's ``--max-tokens``; a number, the shorter
    #: requests of ``--split-tokens`` (no goal is read on them).
    max_tokens: int | None = None

    @property
    def label(self) -> str:
        """The scenario's name in the report, the goals and the JSON file."""
        if self.one_token_chunks:
            return (
                f"{CHUNK_SCENARIO}: {self.streams} streams, "
                f"{1e3 * self.step_delay:g} ms steps, logprobs {self.logprobs}"
            )
        label = f"{self.streams} streams, logprobs {self.logprobs}"
        return label if self.max_tokens is None else f"{label}, {self.max_tokens} tokens"


@dataclass
class Result:
    """What one (client, scenario) run measured."""

    client: str
    streams: int
    logprobs: int
    #: The scenario's label (:attr:`Scenario.label`; empty: a warm-up).
    scenario: str = ""
    step_delay: float = 0.0
    #: Whether this is the one-token-per-chunk scenario.
    one_token_chunks: bool = False
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
    #: Tokens per API-server CPU second of each round (``--repeat``), in order (not
    #: ``--rounds``, which is requests per stream).
    per_round: list[float] = field(default_factory=list)
    #: Tokens per request asked (:attr:`Scenario.max_tokens`): None, the run's own.
    max_tokens: int | None = None

    def add_round(self, other: Result) -> None:
        """Pools another round of the same client and scenario into this one."""
        self.requests += other.requests
        self.tokens += other.tokens
        self.errors += other.errors
        self.seconds += other.seconds
        self.cpu_seconds += other.cpu_seconds
        self.chunks += other.chunks
        self.ttft += other.ttft
        self.itl += other.itl
        self.profile = self.profile + other.profile
        self.gc = None if self.gc is None or other.gc is None else self.gc + other.gc
        self.per_round += other.per_round

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_chunk(self) -> float:
        return self.tokens / self.chunks if self.chunks else float("nan")

    @property
    def cpu_per_1k_tokens(self) -> float:
        return 1000 * self.cpu_seconds / self.tokens if self.tokens else float("nan")

    @property
    def tokens_per_cpu_s(self) -> float:
        """Output tokens per CPU second of the API server: tokens per core, when the
        server saturates one."""
        return self.tokens / self.cpu_seconds if self.cpu_seconds else float("nan")

    def share(self, layer: str, *, collections_apart: bool = False) -> float:
        """``layer``'s share of the profile's samples (see :meth:`Profile.share`)."""
        return self.profile.share(layer, collections_apart=collections_apart)

    @property
    def gc_share(self) -> float:
        """The collector's CPU seconds over the API server's, both in the window."""
        if self.gc is None or not self.cpu_seconds:
            return float("nan")
        return self.gc.total_cpu_s / self.cpu_seconds


def per_core_ratio(r: Result, base: Result) -> float:
    """``r``'s tokens per API-server CPU second over ``base``'s: with rounds
    (``--repeat``), the median of each round's ratio (the two measured back to back;
    rounds without CPU time are left out, NaN when none is left); otherwise the ratio of
    the totals."""
    if len(r.per_round) > 1 and len(r.per_round) == len(base.per_round):
        ratios = [q for q in _round_ratios(r, base) if not math.isnan(q)]
        return statistics.median(ratios) if ratios else float("nan")
    return _ratio(r.tokens_per_cpu_s, base.tokens_per_cpu_s)


def _round_ratios(r: Result, base: Result) -> list[float]:
    return [_ratio(mine, theirs) for mine, theirs in zip(r.per_round, base.per_round, strict=True)]


def round_ratios(r: Result, base: Result) -> str:
    """Each round's ratio of tokens per API-server CPU second, as the report prints them
    (empty without rounds)."""
    if len(r.per_round) < 2 or len(r.per_round) != len(base.per_round):
        return ""
    each = ", ".join(f"{q:.2f}" for q in _round_ratios(r, base))
    return f"rounds {each}x (median {per_core_ratio(r, base):.2f}x)"


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
    base_url: str,
    model: str,
    result: Result,
    max_tokens: int,
    total: int,
    seconds: float = 0.0,
    chat: bool = False,
) -> None:
    """Keep ``result.streams`` requests in flight until ``total`` were started and
    ``seconds`` have passed (a profile needs enough samples); streaming completions, or
    with ``chat`` chat completions."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
        if result.logprobs:
            body |= {"logprobs": True, "top_logprobs": result.logprobs}
    else:
        body["prompt"] = PROMPT
        if result.logprobs:
            body["logprobs"] = result.logprobs
    url = f"{base_url}/v1/chat/completions" if chat else f"{base_url}/v1/completions"
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
    """A :class:`corewire.vllm.serve.stack.ServeStack` with the synthetic engine instead of the
    reference model (imported here: it needs vLLM)."""
    from corewire.vllm.serve.stack import ServeStack

    class BenchStack(ServeStack):
        def engine_command(self, index: int) -> list[str]:
            return [*super().engine_command(index), "--engine", ENGINE]

    return BenchStack(**kwargs)


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    """The run's scenarios, in order: the saturation grid, then one token per chunk."""
    found = []
    for streams in args.streams:
        for logprobs in args.logprobs:
            found.append(Scenario(streams, logprobs, args.step_delay))
            # Right after its longer twin, on the same warm servers: the machine's drift
            # falls on both points of the split alike.
            if args.split_tokens:
                found.append(replace(found[-1], max_tokens=args.split_tokens))
    if args.chunk_streams:
        found.append(Scenario(args.chunk_streams, 0, args.chunk_step_delay, one_token_chunks=True))
    return found


def _slug(client: str) -> str:
    return client.replace("+", "-").replace("/", "-")


def run_clients(args: argparse.Namespace, model_dir: Path, work: Path) -> list[Result]:
    """Scenarios run in groups of one engine step delay. For each group every client's
    stack is up at once (an idle one costs nothing), and each scenario runs on one stack
    right after the other, so that all see the same machine; the stacks stop before the
    next group's start."""
    psutil = import_optional("psutil", "the serve benchmark's CPU accounting")
    try:
        probe_env = gc_times.probe_env(work / GC_PROBE_DIR)
    except gc_times.GcProbeError as exc:
        print(f"no collector timing: {exc}")
        probe_env = {}
    groups: dict[float, list[Scenario]] = {}
    for scenario in scenarios(args):
        groups.setdefault(scenario.step_delay, []).append(scenario)
    results = []
    for step_delay, group in groups.items():
        with contextlib.ExitStack() as stacks:
            servers = {}
            for client, stack in _start_stacks(args, model_dir, work, step_delay, probe_env):
                stacks.callback(stack.stop)
                servers[client] = (stack, psutil.Process(stack.server.pid))
            for scenario in group:
                pooled: dict[str, Result] = {}
                # Rounds alternate the stacks, so that a slow spell of the machine
                # falls on all of them; each round's ratio is read against its own. Every
                # other round reverses their order, so that going first or last evens out.
                for round_ in range(args.repeat):
                    turns = list(servers.items())
                    for client, (stack, server) in turns if round_ % 2 == 0 else turns[::-1]:
                        result = Result(
                            client,
                            scenario.streams,
                            scenario.logprobs,
                            scenario.label,
                            scenario.step_delay,
                            scenario.one_token_chunks,
                            max_tokens=scenario.max_tokens,
                        )
                        _measure(args, work, stack, server, result, round_)
                        if client in pooled:
                            pooled[client].add_round(result)
                        else:
                            pooled[client] = result
                results.extend(pooled.values())
    return results


def _start_stacks(
    args: argparse.Namespace,
    model_dir: Path,
    work: Path,
    step_delay: float,
    probe_env: dict[str, str],
) -> list[tuple[str, Any]]:
    """Every client's stack (:func:`_start_stack`), started side by side: a stack spends
    its start-up waiting on its server (vLLM's own engine: a minute or more), and the
    stacks do not share a process. If any fails, the others are stopped and the first
    failure raised."""
    with concurrent.futures.ThreadPoolExecutor(len(args.clients)) as pool:
        starts = [
            (
                client,
                pool.submit(_start_stack, args, model_dir, work, client, step_delay, probe_env),
            )
            for client in args.clients
        ]
        concurrent.futures.wait([future for _, future in starts])
    failed = [future.exception() for _, future in starts if future.exception() is not None]
    started = [(client, future.result()) for client, future in starts if not future.exception()]
    if failed:
        for _, stack in started:
            stack.stop()
        raise failed[0]
    return started


def _start_stack(
    args: argparse.Namespace,
    model_dir: Path,
    work: Path,
    client: str,
    step_delay: float,
    probe_env: dict[str, str],
) -> Any:
    """``client``'s stack, started and warmed up (the caller stops it; a failed warm-up
    stops it here)."""
    engine_client, switches = STACKS[client]
    if args.engine == "vllm":
        stack = serve_real.real_engine_stack(
            args,
            model_dir,
            work / f"logs-{_slug(client)}-vllm-engine" / "server.log",
            engine_client,
            _server_args(args),
            {**probe_env, **switches},
        )
    else:
        stack = _bench_stack(
            model_dir=model_dir,
            port=0,
            client=engine_client,
            engines=args.engines,
            engine_args={"step_delay": step_delay, "max_batch": 4096},
            log_dir=work / f"logs-{_slug(client)}-{1e3 * step_delay:g}ms",
            extra_server_args=_server_args(args),
            server_env={**probe_env, **switches},
        )
    stack.start()
    try:
        warm = Result(client, 8, 0)
        asyncio.run(_load(stack.base_url, stack.served_model_name, warm, 16, 32, chat=args.chat))
        if warm.errors or not warm.tokens:
            raise RuntimeError(f"{client}: the warm-up failed ({warm.errors} errors)")
    except BaseException:
        stack.stop()
        raise
    return stack


def _server_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The ``vllm serve`` flags every stack gets from this run's options."""
    flags: tuple[str, ...] = ("--disable-log-stats",) if args.no_stats else ()
    if args.stream_interval != 1:
        flags += ("--stream-interval", str(args.stream_interval))
    if args.tool_call_parser:
        flags += ("--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser)
    if args.reasoning_parser:
        flags += ("--reasoning-parser", args.reasoning_parser)
    if args.serve_args and args.engine != "vllm":
        # Last, so that they win (vLLM's engine's stacks add them themselves).
        flags += tuple(shlex.split(args.serve_args))
    return flags


def requests_at_least(args: argparse.Namespace, streams: int) -> int:
    """How many requests a scenario's load starts at least (it also runs ``--seconds``):
    ``--rounds`` per stream, but one per stream with ``--native-profile``, where the
    server, paused at every sample, would take many minutes over ``--rounds``' requests."""
    if args.native_profile:
        return streams
    return max(streams * args.rounds, 32)


def front_end_cpu(server: Any) -> dict[int, float]:
    """User + system CPU seconds so far of every process of the front-end: the API
    server (a ``psutil.Process``) and its descendants (``vllm-rs`` under the Rust
    front-end; vLLM's DP coordinator with DP > 1) but vLLM's own engine cores under it
    (``--engine vllm``) and theirs, by pid."""
    import psutil

    processes = [server, *server.children(recursive=True)]
    engines = serve_real.engine_pids(processes)
    seconds = {}
    for proc in processes:
        if proc.pid in engines:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            seconds[proc.pid] = sum(proc.cpu_times()[:2])
    return seconds


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """The front-end's CPU seconds between two :func:`front_end_cpu` readings (a process
    started in between counts from 0)."""
    return sum(value - before.get(pid, 0.0) for pid, value in after.items())


def _measure(
    args: argparse.Namespace, work: Path, stack: Any, server: Any, result: Result, round_: int = 0
) -> Result:
    total = requests_at_least(args, result.streams)
    # The collector's totals are taken just outside the CPU window: the server is idle
    # there, so no collection falls between the two.
    gc0 = _gc_snapshot(work, server.pid)
    cpu0 = front_end_cpu(server)
    t0 = time.perf_counter()
    profile_dir = Path(args.profile_dir) if args.profile_dir else work
    kind = "chunks-" if result.one_token_chunks else ""
    suffix = f"-round{round_ + 1}" if args.repeat > 1 else ""
    length = "" if result.max_tokens is None else f"-{result.max_tokens}t"
    name = (
        f"profile-{_slug(result.client)}-{kind}{result.streams}-{result.logprobs}"
        f"{length}{suffix}.txt"
    )
    profile = profile_dir / name
    sampled = args.profile and result.client not in UNPROFILED
    with profiled(server.pid, profile, sampled, native=args.native_profile):
        asyncio.run(
            _load(
                stack.base_url,
                stack.served_model_name,
                result,
                args.max_tokens if result.max_tokens is None else result.max_tokens,
                total,
                args.seconds,
                chat=args.chat,
            )
        )
    result.seconds = time.perf_counter() - t0
    result.cpu_seconds = cpu_between(cpu0, front_end_cpu(server))
    gc1 = _gc_snapshot(work, server.pid)
    result.gc = gc1 - gc0 if gc0 is not None and gc1 is not None else None
    result.profile = read_profile(profile, native=args.native_profile)
    result.per_round = [result.tokens_per_cpu_s]
    stack.check_alive()
    print(
        f"  {result.client:15} {result.scenario}: "
        f"{result.tokens_per_s:9,.0f} tok/s  {result.tokens_per_chunk:5.2f} tok/chunk  "
        f"{result.tokens_per_cpu_s:7,.0f} tok/CPU s  "
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


def report(results: list[Result], *, goals: bool = True) -> list[common.Goal]:
    """Prints the results, the collector, the layers and the goals; returns the goals.
    Without ``goals`` (a server option the goals were not set for) the ratios are
    printed without one."""
    results, short = by_length(results)
    by_key = {(r.client, r.scenario): r for r in results}
    native = any(r.profile.native for r in results)
    print()
    print(
        "client          streams lp step ms   req/s    tok/s tok/chunk  tok/CPU s x vllm"
        "  TTFT p50/p99 ms   ITL p50/p99 ms  CPU s/1k tok  GC % CPU  client layer  w/o GC"
        "  client ms/1k tok"
    )
    for r in results:
        apart = r.share(CLIENT_LAYER, collections_apart=True)
        base = by_key.get(("vllm", r.scenario))
        vs = per_core_ratio(r, base) if base else float("nan")
        print(
            f"{r.client:15} {r.streams:7}{'c' if r.one_token_chunks else ' '}{r.logprobs:2}"
            f" {1e3 * r.step_delay:7g} {r.requests / r.seconds:7.1f}"
            f" {r.tokens_per_s:8,.0f} {r.tokens_per_chunk:9.2f} {r.tokens_per_cpu_s:10,.0f}"
            f" {vs:6.2f}"
            f" {1e3 * percentile(r.ttft, 50):7.1f}/{1e3 * percentile(r.ttft, 99):7.1f}"
            f"  {1e3 * percentile(r.itl, 50):6.2f}/{1e3 * percentile(r.itl, 99):7.2f}"
            f"  {r.cpu_per_1k_tokens:11.3f}  {100 * r.gc_share:7.1f}%"
            f"  {100 * r.share(CLIENT_LAYER):10.1f}%"
            + (f" {100 * apart:6.1f}%" if r.profile.native else "       -")
            + f"  {1e3 * r.cpu_per_1k_tokens * r.share(CLIENT_LAYER):16.2f}"
        )
    print(
        "(c: the one-token-per-chunk scenario; tok/CPU s: output tokens per CPU second of "
        "the API server, over all rounds; x vllm: over the vllm stack's in the same scenario "
        "(with --repeat, the median of the rounds' ratios); client layer: "
        "as sampled, a collection charged to the code that triggered it; w/o GC: with "
        "collections apart, --native-profile only)"
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
    if any(r.logprobs for r in results):
        print(
            "(logprobs: vLLM's output processing decodes each candidate token through "
            "transformers/ and vllm/tokenizers/, so that work shows as 'detokenization', not "
            f"'logprobs'; corewire's native path does it inside '{NATIVE_OUTPUT_LAYER}')"
        )
    splits, unsplit = cost_splits(results, short)
    for problem in unsplit:
        print(f"no CPU split: {problem}")
    serve_split.report(splits)
    print()
    found: list[common.Goal] = []
    for r in results:
        base = by_key.get(("vllm", r.scenario))
        if r.client == "vllm" or base is None:
            continue
        if not goals:
            parts = [
                f"tokens per CPU s {per_core_ratio(r, base):.2f}x, "
                f"tokens/s {_ratio(r.tokens_per_s, base.tokens_per_s):.2f}x (no goal: the "
                "goals are set for the default server options)"
            ]
        elif r.client == "rust":
            parts = [
                f"tokens per CPU s {per_core_ratio(r, base):.2f}x, "
                f"tokens/s {_ratio(r.tokens_per_s, base.tokens_per_s):.2f}x (no goal: vLLM's "
                "own Rust front-end, for reference)"
            ]
        elif r.client == "corewire+output":
            parts = _output_goals(r, base, by_key.get(("corewire", r.scenario)), found)
        elif r.client == "corewire+fast":
            parts = _fast_goals(r, base, by_key, found)
        elif not r.one_token_chunks:
            parts = _client_goals(r, base, found)
        else:
            parts = [f"tokens per CPU s {per_core_ratio(r, base):.2f}x"]
        if rounds := round_ratios(r, base):
            parts.append(f"tokens per CPU s by round: {rounds}")
        print(f"{r.client} vs vllm, {r.scenario}:" + "".join(f"\n    {part}" for part in parts))
    for r in results:
        if r.one_token_chunks:
            goal = common.Goal(
                f"{r.scenario}: {r.client} tokens per chunk (about 1)",
                r.tokens_per_chunk,
                ONE_TOKEN_PER_CHUNK,
                lower_is_better=True,
            )
            found.append(goal)
            print(
                f"{r.client} {r.scenario}: {r.tokens_per_chunk:.3f} tokens per chunk: "
                f"{'met' if goal.met else 'MISS'} (<= {ONE_TOKEN_PER_CHUNK}; more: the stack "
                "fell behind the engine and merged steps, not the scenario asked for)"
            )
    if native:
        print(
            "(--native-profile: py-spy paused the API server at every sample, so tokens/s, "
            "latencies and CPU per token of this run are below an unprofiled run's)"
        )
    return found


def by_length(results: list[Result]) -> tuple[list[Result], list[Result]]:
    """``results`` at the run's ``--max-tokens``, and the shorter ``--split-tokens`` ones."""
    return (
        [r for r in results if r.max_tokens is None],
        [r for r in results if r.max_tokens is not None],
    )


def cost_splits(
    results: list[Result], short: list[Result]
) -> tuple[list[serve_split.CostSplit], list[str]]:
    """Each stack's CPU per request and per token in each scenario that ran at both
    lengths (``--split-tokens``): ``short`` the shorter requests' results. Also why a
    pair could not be split, one line each."""
    long_by_key = {(r.client, r.streams, r.logprobs): r for r in results if not r.one_token_chunks}
    splits, problems = [], []
    for r in short:
        long = long_by_key.get((r.client, r.streams, r.logprobs))
        if long is None:
            continue
        try:
            splits.append(serve_split.fit(long, r))
        except ValueError as exc:
            problems.append(f"{r.scenario}: {exc}")
    return splits, problems


def _client_goals(r: Result, base: Result, found: list[common.Goal]) -> list[str]:
    """The vLLM-plugin issue's goals for corewire's client (appended to ``found``); the
    lines that report them."""
    native = r.profile.native
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
        goal = common.Goal(f"{r.scenario}: client layer share x smaller ({label})", ratio, 3)
        found.append(goal)
        parts.append(
            f"client layer share {ratio:4.1f}x smaller, {label} ({explain[label]}):"
            f" {'met' if goal.met else 'MISS'} (>= 3x)"
        )
    goal = common.Goal(f"{r.scenario}: tokens/s x vllm (not lower)", tok_ratio, 0.97)
    found.append(goal)
    parts.append(f"tokens/s {tok_ratio:.2f}x vLLM's: {'met' if goal.met else 'MISS'} (not lower)")
    parts.append(f"API server CPU per token {cpu_ratio:.2f}x less")
    return parts


def _output_goals(
    r: Result, base: Result, client_only: Result | None, found: list[common.Goal]
) -> list[str]:
    """The native-output-processing issue's goals for the corewire+output stack, where the
    issue sets them (appended to ``found``); the lines that report them."""
    per_core = per_core_ratio(r, base)
    target = (
        CHUNK_GOAL if r.one_token_chunks else TOKENS_PER_CORE_GOALS.get((r.streams, r.logprobs))
    )
    parts = _per_core_goals(r, base, per_core, target, found)
    tok_ratio = _ratio(r.tokens_per_s, base.tokens_per_s)
    parts.append(f"tokens/s {tok_ratio:.2f}x vLLM's")
    if client_only is not None:
        parts.append(
            "output tokens per API-server CPU second "
            f"{per_core_ratio(r, client_only):.2f}x the corewire "
            "stack's (its client, vLLM's output processing)"
        )
    return parts


def _per_core_goals(
    r: Result, base: Result, per_core: float, target: float | None, found: list[common.Goal]
) -> list[str]:
    """Output tokens per front-end CPU second ``per_core`` times ``base``'s against
    ``target`` (None: no goal in this scenario), and then TTFT and ITL p99 no worse
    (appended to ``found``); the lines that report them."""
    if target is None:
        return [f"output tokens per front-end CPU second {per_core:.2f}x vLLM's (no goal)"]
    goal = common.Goal(f"{r.scenario}: {r.client} tokens per CPU s x vllm", per_core, target)
    found.append(goal)
    return [
        f"output tokens per front-end CPU second {per_core:.2f}x vLLM's: "
        f"{'met' if goal.met else 'MISS'} (>= {target}x)",
        *_latency_goals(r, base, found),
    ]


def _latency_goals(r: Result, base: Result, found: list[common.Goal]) -> list[str]:
    """ "TTFT and ITL p99 no worse" than ``base``'s (appended to ``found``); the lines
    that report them."""
    parts = []
    for attr, what in (("ttft", "TTFT"), ("itl", "ITL")):
        ratio = _ratio(percentile(getattr(r, attr), 99), percentile(getattr(base, attr), 99))
        goal = common.Goal(
            f"{r.scenario}: {r.client} {what} p99 x vllm (no worse)",
            ratio,
            LATENCY_SLACK,
            lower_is_better=True,
        )
        found.append(goal)
        parts.append(
            f"{what} p99 {ratio:.2f}x vLLM's: {'met' if goal.met else 'MISS'} "
            f"(no worse: <= {LATENCY_SLACK}x)"
        )
    return parts


def _fast_goals(
    r: Result, base: Result, by_key: dict[tuple[str, str], Result], found: list[common.Goal]
) -> list[str]:
    """The fast-path issue's goals for the corewire+fast stack where it sets them (appended
    to ``found``): tokens per CPU second over vllm's, TTFT and ITL p99 no worse; and, where
    the rust stack ran, the moonshot (CPU per token within :data:`RUST_MOONSHOT` of vLLM's
    Rust front-end's). The lines that report them."""
    per_core = per_core_ratio(r, base)
    target = None if r.one_token_chunks else FAST_GOALS.get((r.streams, r.logprobs))
    parts = _per_core_goals(r, base, per_core, target, found)
    rust = by_key.get(("rust", r.scenario))
    if rust is not None:
        # CPU per token over the Rust front-end's: its tokens per CPU s over ours.
        vs_rust = per_core_ratio(r, rust)
        over_rust = 1 / vs_rust if vs_rust else float("inf")
        goal = common.Goal(
            f"{r.scenario}: {r.client} CPU per token x rust (moonshot)",
            over_rust,
            RUST_MOONSHOT,
            lower_is_better=True,
        )
        parts.append(
            f"CPU per token {over_rust:.2f}x vLLM's Rust front-end's: "
            f"{'met' if goal.met else 'not met'} (moonshot: <= {RUST_MOONSHOT}x; reported, "
            "the run's status does not depend on it)"
        )
    output = by_key.get(("corewire+output", r.scenario))
    if output is not None:
        parts.append(
            "output tokens per front-end CPU second "
            f"{per_core_ratio(r, output):.2f}x the corewire+output stack's (the same without "
            "the fast path)"
        )
    return parts


def _ratio(num: float, den: float) -> float:
    """``num / den``: NaN when either is NaN (no samples, no tokens)."""
    if num != num or den != den:
        return float("nan")
    return num / den if den else float("inf")


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
        "client          streams lp  GC CPU s  GC wall s  % of server CPU  GC ms/1k tok"
        "  collections gen0/gen1/gen2  GC CPU s gen0/gen1/gen2"
    )
    for r in results:
        if r.gc is None:
            print(f"{r.client:15} {_streams(r):>8}{r.logprobs:2}  (probe did not answer)")
            continue
        per_1k = 1e3 * 1e3 * r.gc.total_cpu_s / r.tokens if r.tokens else float("nan")
        counts = "/".join(str(c) for c in r.gc.collections)
        seconds = "/".join(f"{s:.2f}" for s in r.gc.cpu_s)
        print(
            f"{r.client:15} {_streams(r):>8}{r.logprobs:2} {r.gc.total_cpu_s:9.2f}"
            f" {sum(r.gc.wall_s):10.2f} {100 * r.gc_share:15.1f}% {per_1k:13.2f}"
            f"  {counts:>27}  {seconds:>22}"
        )


def _report_layers(
    results: list[Result], names: list[str], title: str, *, collections_apart: bool
) -> None:
    print()
    print(title)
    print(
        f"{'layer':29}"
        + "".join(
            f" {_SHORT.get(r.client, r.client)}/{_streams(r)}/{r.logprobs}".rjust(15)
            for r in results
        )
    )
    for name in names:
        print(
            f"{name:29}"
            + "".join(
                f"{100 * r.share(name, collections_apart=collections_apart):15.1f}" for r in results
            )
        )


def _streams(r: Result) -> str:
    """The streams column: "c" marks the one-token-per-chunk scenario."""
    return f"{r.streams}{'c' if r.one_token_chunks else ''}"


def _vllm_result(results: list[Result], r: Result) -> Result | None:
    """The vllm stack's result in ``r``'s scenario (None: not run)."""
    return next((b for b in results if b.client == "vllm" and b.scenario == r.scenario), None)


def as_case(r: Result, base: Result | None = None) -> dict[str, Any]:
    """One (client, scenario) result as the JSON file holds it; ``base``: the vllm stack's
    result in the same scenario, for the ratios."""
    names = [n for n, _ in LAYERS] + [OTHER]
    return {
        "client": r.client,
        "scenario": r.scenario,
        "one_token_per_chunk_scenario": r.one_token_chunks,
        "streams": r.streams,
        "logprobs": r.logprobs,
        "max_tokens": r.max_tokens,
        "step_delay_s": r.step_delay,
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
        "tokens_per_api_server_cpu_s": r.tokens_per_cpu_s,
        "tokens_per_api_server_cpu_s_by_round": r.per_round,
        "vs_vllm": (
            {
                "tokens_per_api_server_cpu_s": per_core_ratio(r, base),
                "tokens_per_s": _ratio(r.tokens_per_s, base.tokens_per_s),
                "ttft_p99": _ratio(percentile(r.ttft, 99), percentile(base.ttft, 99)),
                "itl_p99": _ratio(percentile(r.itl, 99), percentile(base.itl, 99)),
            }
            if base is not None
            else None
        ),
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
    """Output tokens/s, output tokens per API-server CPU second, then TTFT and ITL
    p50/p99, per scenario and client (matplotlib)."""
    plt = common.pyplot()
    scenarios = list(dict.fromkeys(r.scenario for r in results))
    clients = list(dict.fromkeys(r.client for r in results))
    by_key = {(r.client, r.scenario): r for r in results}
    labels = {
        "vllm": "vLLM 0.25.1's client and output processing",
        "corewire": "corewire's client (plugin)",
        "corewire+output": "corewire's client and output processing (plugin)",
    }
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    width = 0.8 / len(clients)
    ticks = [j + 0.4 - width / 2 for j in range(len(scenarios))]
    tick_labels = [_tick_label(next(r for r in results if r.scenario == s)) for s in scenarios]
    for i, client in enumerate(clients):
        xs = [j + i * width for j in range(len(scenarios))]
        rows = [by_key.get((client, s)) for s in scenarios]
        label = labels.get(client, client)
        axes[0].bar(xs, [r.tokens_per_s if r else 0.0 for r in rows], width, label=label)
        per_core = [r.tokens_per_cpu_s if r and r.cpu_seconds else 0.0 for r in rows]
        axes[1].bar(xs, per_core, width, label=label)
        for ax, attr in ((axes[2], "ttft"), (axes[3], "itl")):
            p50 = [1e3 * percentile(getattr(r, attr), 50) if r else 0.0 for r in rows]
            p99 = [1e3 * percentile(getattr(r, attr), 99) if r else 0.0 for r in rows]
            ax.bar(xs, p99, width, alpha=0.35, label=f"{label} p99")
            ax.bar(xs, p50, width, label=f"{label} p50")
    axes[0].set_ylabel("output tokens/s (higher is better)")
    axes[0].set_title("throughput")
    axes[1].set_ylabel("output tokens per CPU second (higher is better)")
    axes[1].set_title("API server: tokens per core")
    axes[2].set_ylabel("ms (lower is better)")
    axes[2].set_title("time to first token, p50 and p99")
    axes[3].set_ylabel("ms (lower is better)")
    axes[3].set_title("inter-token latency, p50 and p99")
    for ax in axes:
        ax.set_xticks(ticks, tick_labels)
        ax.legend(fontsize=7)
    fig.suptitle("vLLM's API server (front-end only) over a synthetic engine")
    common.save_figure(fig, path)


def _tick_label(r: Result) -> str:
    if r.one_token_chunks:
        return f"1 token/chunk\n{r.streams} streams, {1e3 * r.step_delay:g} ms"
    label = f"{r.streams} streams\nlogprobs {r.logprobs}"
    return label if r.max_tokens is None else f"{label}\n{r.max_tokens} tokens"


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
    if not clients or any(c not in STACKS for c in clients):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a subset of {','.join(STACKS)}")
    return list(dict.fromkeys(clients))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``corewire bench serve``'s flags."""
    common.add_common_arguments(parser)
    parser.add_argument(
        "--streams", type=_ints, default=[64, 256], help="concurrent streams (64,256)"
    )
    parser.add_argument("--logprobs", type=_ints, default=[0, 5], help="logprobs per token (0,5)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request (128)")
    parser.add_argument(
        "--split-tokens",
        type=int,
        default=0,
        metavar="N",
        help="also run each saturation scenario with N-token requests (no goal read there), "
        "and split each stack's front-end CPU into a part per request and a part per token, "
        "fitted from the two lengths (0: no split)",
    )
    parser.add_argument(
        "--rounds", type=int, default=4, help="at least this many requests per stream (4)"
    )
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="and at least this long per scenario (20)"
    )
    parser.add_argument(
        "--clients",
        type=_clients,
        default=None,
        help=f"the stacks ({','.join(DEFAULT_CLIENTS)}): vllm: vLLM's client and output "
        "processing; corewire: corewire's client (COREWIRE_VLLM_CLIENT=1); corewire+output: "
        f"corewire's client and native output processing (and {OUTPUT_SWITCH}=1), left out "
        "of the default with a note where it cannot run; corewire+fast (not in the default, "
        f"vLLM 0.33.0, 0.34.0): corewire+output with the per-token fast path "
        f"({FAST_PATH_SWITCH}=1); "
        f"corewire+fast/router (the same): corewire+fast with its direct routes off "
        f"({DIRECT_ROUTE_SWITCH}=0); corewire+fast/pool (the same): corewire+fast with every "
        f"prompt tokenized in vLLM's pool ({INLINE_TOKENIZE_SWITCH}=0); corewire+fast/render "
        f"(the same): corewire+fast with every chat template rendered in vLLM's pool "
        f"({INLINE_RENDER_SWITCH}=0); corewire+fast/envs "
        f"(the same): corewire+fast with vLLM's environment read on each access "
        f"({ENVS_CACHE_SWITCH}=0); "
        "rust (not in the default): vLLM's own Rust front-end, vllm-rs "
        "(VLLM_USE_RUST_FRONTEND=1), over the same engines",
    )
    parser.add_argument("--engines", type=int, default=1, help="engine processes (1)")
    parser.add_argument(
        "--engine",
        choices=serve_real.ENGINES,
        default="synthetic",
        help="synthetic (the default): corewire's engine, stepping every --step-delay; vllm: "
        "vLLM's own engine core under each stack's vllm serve (a GPU, or vLLM's CPU build), "
        "its CPU left out of the front-end's; no goal is read and there is no "
        "one-token-per-chunk scenario",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="with --engine vllm: the model every stack serves (default: a tiny llama with "
        "random weights written for the run)",
    )
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="with --model: its name in the API (default: the directory's name)",
    )
    parser.add_argument(
        "--serve-args",
        metavar="FLAGS",
        default="",
        help="more vllm serve flags for every stack, as one string (e.g. "
        "--serve-args='--tensor-parallel-size 2 --max-model-len 4096' with --engine vllm, "
        "--serve-args=--enable-force-include-usage with either; they come last and win)",
    )
    # A model-free engine without a step time steps each request alone as soon as it
    # arrives: one-token frames, a front-end drowned in per-frame work, nothing like a
    # real engine. 5 ms is a fast GPU decode step and makes it batch like one.
    parser.add_argument(
        "--step-delay", type=float, default=0.005, help="engine seconds per step (0.005)"
    )
    # At 20 ms steps and 256 streams the engine asks for 12.8k tokens/s, well under what
    # each stack's server streams: each step's token leaves in a chunk of its own, and the
    # per-chunk work (HTTP, OpenAI serving) weighs most (the third column).
    parser.add_argument(
        "--chunk-streams",
        type=int,
        default=256,
        help="streams of the one-token-per-chunk scenario (256; 0: no such scenario)",
    )
    parser.add_argument(
        "--chunk-step-delay",
        type=float,
        default=0.02,
        help="engine seconds per step in the one-token-per-chunk scenario (0.02)",
    )
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="no py-spy")
    parser.add_argument(
        "--native-profile",
        action="store_true",
        help="py-spy --native: samples inside CPython's garbage collector go to a 'garbage "
        "collector' layer, and the client layer is read both as sampled and with collections "
        "apart. py-spy cannot read native stacks without stopping the process, so this PAUSES "
        f"the API server at every sample ({NATIVE_RATE} a second, not {RATE}): tokens/s and "
        "latencies of such a run are lower, and each scenario runs for --seconds (--rounds "
        "ignored)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds per scenario (1): the stacks take turns each round, the results are "
        "pooled, and tokens per CPU second is read as the median of the rounds' ratios "
        "(this machine's speed drifts between runs)",
    )
    parser.add_argument("--no-stats", action="store_true", help="vllm serve --disable-log-stats")
    # Above 1, each SSE chunk carries that many tokens: the per-chunk layers (HTTP, OpenAI
    # serving) weigh less and output processing more. The goals are set for 1.
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="vllm serve --stream-interval for every stack (1); above 1 no goal is read and "
        "there is no one-token-per-chunk scenario",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="stream chat completions (logprobs as top_logprobs) instead of completions",
    )
    parser.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        default=None,
        help="vllm serve --enable-auto-tool-choice --tool-call-parser NAME for every stack "
        "(with --chat; the requests send no tools)",
    )
    parser.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        default=None,
        help="vllm serve --reasoning-parser NAME for every stack (with --chat; the model's "
        f"tokenizer gets the markers {' and '.join(REASONING_MARKERS)})",
    )
    parser.add_argument(
        "--profile-dir",
        metavar="DIR",
        default=None,
        help="keep py-spy's raw profiles (profile-CLIENT-[chunks-]STREAMS-LOGPROBS.txt) in DIR",
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
    if args.split_tokens < 0 or args.split_tokens >= args.max_tokens:
        print(
            f"{prog}: --split-tokens must be at least 0 and below --max-tokens (the shorter "
            "of the split's two lengths)",
            file=sys.stderr,
        )
        return 2
    if args.repeat < 1:
        print(f"{prog}: --repeat must be at least 1", file=sys.stderr)
        return 2
    if (args.tool_call_parser or args.reasoning_parser) and not args.chat:
        print(
            f"{prog}: --tool-call-parser and --reasoning-parser act on chat completions: "
            "add --chat",
            file=sys.stderr,
        )
        return 2
    if args.stream_interval < 1:
        print(f"{prog}: --stream-interval must be at least 1", file=sys.stderr)
        return 2
    if (unsupported := serve_real.real_engine_unsupported(args)) is not None:
        print(f"{prog}: {unsupported}", file=sys.stderr)
        return 2
    if args.stream_interval > 1 and args.chunk_streams:
        print(f"--stream-interval {args.stream_interval}: no one-token-per-chunk scenario")
        args.chunk_streams = 0
    if args.engine == "vllm":
        # vLLM's engine steps at its own pace: no step time, and no scenario paced by one.
        args.step_delay = 0.0
        if args.chunk_streams:
            print("--engine vllm: no one-token-per-chunk scenario")
            args.chunk_streams = 0
    if args.chunk_streams < 0 or (args.chunk_streams and args.chunk_step_delay <= 0):
        print(
            f"{prog}: --chunk-streams must be at least 0, and --chunk-step-delay positive "
            "(without a step time the engine does not pace the chunks)",
            file=sys.stderr,
        )
        return 2
    missing = native_output_missing()
    if args.clients is None:
        args.clients = list(DEFAULT_CLIENTS)
        if missing is not None:
            args.clients.remove("corewire+output")
            print(f"no corewire+output stack: {missing}")
    elif "corewire+output" in args.clients and missing is not None:
        print(f"{prog}: --clients corewire+output: {missing}", file=sys.stderr)
        return 2
    fast = [c for c in args.clients if c.startswith("corewire+fast")]
    if fast and (no_fast := fast_path_missing()) is not None:
        print(f"{prog}: --clients {fast[0]}: {no_fast}", file=sys.stderr)
        return 2
    if "rust" in args.clients:
        from corewire.vllm.serve.stack import rust_frontend_binary

        if rust_frontend_binary() is None:
            print(f"{prog}: --clients rust: the installed vLLM has no vllm-rs", file=sys.stderr)
            return 2
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    from corewire.vllm.serve.model_dir import write_model_dir

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
        + (f" (and {args.split_tokens} for the CPU split)" if args.split_tokens else "")
        + ("  chat" if args.chat else "")
        + (f"  tool-call parser {args.tool_call_parser}" if args.tool_call_parser else "")
        + (f"  reasoning parser {args.reasoning_parser}" if args.reasoning_parser else "")
        + (
            f"  vLLM's engine ({args.model or 'a tiny llama'}, vLLM {common.vllm_version()})"
            if args.engine == "vllm"
            else ""
        )
    )
    if args.native_profile:
        print(
            f"profile: py-spy --native, which pauses the API server at every sample "
            f"({NATIVE_RATE}/s): collections are seen apart, but throughput and latency are "
            "lower than unprofiled; each scenario runs --seconds, --rounds ignored"
        )
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="corewire-serve-bench-") as tmp:
        work = Path(tmp)
        markers = REASONING_MARKERS if args.reasoning_parser else ()
        if args.engine == "vllm":
            model_dir = serve_real.model_for_run(args, work, markers)
        else:
            model_dir = write_model_dir(work / "model", markers=markers)
        results = run_clients(args, model_dir, work)
    # The goals were set over the synthetic engine, at one token per chunk.
    found = report(results, goals=args.stream_interval == 1 and args.engine == "synthetic")
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
                "split_tokens": args.split_tokens,
                "rounds": args.rounds,
                "seconds": args.seconds,
                "clients": args.clients,
                "engines": args.engines,
                "engine": args.engine,
                "model": args.model,
                "serve_args": args.serve_args,
                "step_delay": args.step_delay,
                "chunk_streams": args.chunk_streams,
                "chunk_step_delay": args.chunk_step_delay,
                "profile": args.profile,
                "native_profile": args.native_profile,
                "stats": not args.no_stats,
                "stream_interval": args.stream_interval,
                "repeat": args.repeat,
                "chat": args.chat,
                "tool_call_parser": args.tool_call_parser,
                "reasoning_parser": args.reasoning_parser,
            },
            cases=[as_case(r, _vllm_result(results, r)) for r in results],
            goals=found,
            cost_splits=[dataclasses.asdict(s) for s in cost_splits(*by_length(results))[0]],
        )
        print(f"results written to {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}")
    return 1 if any(not g.met for g in found) else 0
