"""API-server CPU per token over vLLM's *real* engine: vLLM's client against corewire's.

    python benches/real_engine.py [--streams 64] [--tokens 128] [--rounds 3] [--logprobs 0,5]

Run in the venv with vLLM's CPU build (``scripts/test`` keeps one: ``vllm_venv cpu-0.32.0``
after ``source scripts/env.sh``), with corewire installed there. Two ``vllm serve``
servers on vLLM's real engine core and the same tiny llama with seeded weights (the
differential tests' stacks, ``tests/real_engine_support.py``), one per engine-core client,
run side by side; each round sends the same burst of streaming completions to one, then
the other. What is counted is the CPU time of the API-server process alone (the engine
core is a process of its own, and spins the same under either client), per streamed token.
Prints each round and the median ratio of vLLM's client's CPU per token to corewire's
(above 1: corewire's uses less); the answers themselves are held equal by
``tests/real_engine/test_vllm_real_engine.py``.

A plain script, not a ``corewire bench`` command: it needs vLLM's CPU build and the test
stacks, which the wheel does not ship.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

# The test stacks (developer tooling beside this script, not in the wheel).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from real_engine_support import RealEngineServer, started_together, write_real_model
from serve_support import MODEL

CLIENTS = ("vllm", "corewire")


async def _burst(base_url: str, streams: int, tokens: int, logprobs: int) -> int:
    """``streams`` concurrent streamed completions of ``tokens`` tokens; the tokens the
    server reported streaming (its usage: a chunk may carry several)."""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": f"story number {i}", "max_tokens": tokens}
        body |= {"ignore_eos": True, "temperature": 0.0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        if logprobs:
            body["logprobs"] = logprobs
        got = 0
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                    got = json.loads(line[len("data: ") :])["usage"]["completion_tokens"]
        return got

    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(base_url=base_url, timeout=300.0, limits=limits) as client:
        return sum(await asyncio.gather(*(one(client, i) for i in range(streams))))


def _api_server_cpu(server: RealEngineServer) -> float:
    assert server.process is not None
    times = psutil.Process(server.process.pid).cpu_times()
    return times.user + times.system


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--logprobs", default="0,5", help="comma-separated logprob counts")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="corewire-real-engine-") as tmp:
        root = Path(tmp)
        model = write_real_model(root / "model")
        servers = [RealEngineServer(model, root / f"{c}.log", client=c) for c in CLIENTS]
        with started_together(servers):
            by_name = dict(zip(CLIENTS, servers, strict=True))
            # Warm both (first requests compile and allocate).
            for server in servers:
                asyncio.run(_burst(server.base_url, 4, 8, 0))
            print(
                f"{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds; "
                "API-server CPU microseconds per streamed token"
            )
            for logprobs in (int(x) for x in args.logprobs.split(",")):
                ratios = []
                for round_ in range(args.rounds):
                    per_token = {}
                    for name, server in by_name.items():
                        before, start = _api_server_cpu(server), time.monotonic()
                        got = asyncio.run(
                            _burst(server.base_url, args.streams, args.tokens, logprobs)
                        )
                        cpu = _api_server_cpu(server) - before
                        per_token[name] = cpu / got * 1e6
                        wall = time.monotonic() - start
                        print(
                            f"  logprobs {logprobs} round {round_ + 1} {name:8s} "
                            f"{per_token[name]:7.1f} us/token  ({got} tokens, {wall:.1f} s)"
                        )
                    ratios.append(per_token["vllm"] / per_token["corewire"])
                median = statistics.median(ratios)
                print(
                    f"logprobs {logprobs}: vLLM's client's API-server CPU per token / corewire's "
                    f"= {median:.2f}x, median (rounds: {', '.join(f'{r:.2f}' for r in ratios)}; "
                    "above 1: corewire's uses less)"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
