"""``corewire bench dp --backend ray``: one DP group on local engine processes and on Ray
actors, side by side in one process.

For each backend, ``rounds`` times: start a :class:`~corewire.DPLBAsyncMPClient` of
``engines`` synthetic engines (no model: what is measured is the client, the transport
and the routing, not a forward pass) and time it until every engine is ready; send a
burst of requests of 8 tokens each at once and time it until the last one finished
(requests per second, the latency of each request from its send to its last token, p50
and p99, and how evenly the router spread them: requests per engine, max/min); then
time the shutdown. The local backend's engines are child processes on ``ipc://``
sockets; Ray's are actors in a placement group (``SPREAD``) that connect back over TCP,
behind CURVE when the node's address is not loopback. Printed: the median of the rounds
per backend, then Ray / local ratios (above 1: Ray costs more).

Ray joins the cluster ``--ray-address`` names, else starts a local one (its own start is
timed and reported apart: it is paid once per process, not per client).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import Counter
from typing import Any

__all__ = ["BACKENDS", "bench_backends", "print_backends"]

#: The backends compared, in the order printed.
BACKENDS = ("local", "ray")
SYNTHETIC = "corewire.engine.synthetic:SyntheticEngine"
TOKENS_PER_REQUEST = 8


def _request(request_id: str) -> Any:
    from corewire.protocol import EngineCoreRequest, SamplingParams

    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(
            max_tokens=TOKENS_PER_REQUEST, ignore_eos=True, temperature=0.0
        ),
    )


def _client(backend: str, engines: int, ray_address: str | None) -> Any:
    from corewire import DPLBAsyncMPClient, RayPlacement

    options: dict[str, Any] = {}
    if backend == "ray":
        cpus = os.cpu_count() or 1
        options = {
            "data_parallel_backend": "ray",
            "ray_placement": RayPlacement(
                address=ray_address,
                strategy="SPREAD",
                # Engines share the machine's CPUs when the cluster is this machine.
                bundle={"CPU": min(1.0, cpus / engines)},
            ),
        }
    return DPLBAsyncMPClient(
        data_parallel_size=engines, engine=SYNTHETIC, ready_timeout=120, **options
    )


async def _burst(client: Any, n_requests: int) -> dict[str, Any]:
    sent: dict[str, float] = {}
    latencies: list[float] = []
    per_engine: Counter[int] = Counter()
    started = time.perf_counter()
    for i in range(n_requests):
        rid = f"b{i}"
        sent[rid] = time.perf_counter()
        await client.add_request_async(_request(rid))
    while len(latencies) < n_requests:
        outputs = await client.get_output_async()
        now = time.perf_counter()
        for out in outputs.outputs:
            if out.finish_reason is not None:
                latencies.append(now - sent[out.request_id])
                per_engine[outputs.engine_index] += 1
    elapsed = time.perf_counter() - started
    latencies.sort()
    counts = [per_engine.get(i, 0) for i in range(len(client.engine_indices))]
    return {
        "requests_per_s": n_requests / elapsed,
        "latency_p50_ms": 1e3 * latencies[len(latencies) // 2],
        "latency_p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "spread": max(counts) / max(1, min(counts)),
    }


def _one_round(backend: str, engines: int, n_requests: int, ray_address: str | None) -> dict:
    started = time.perf_counter()
    client = _client(backend, engines, ray_address)
    start_s = time.perf_counter() - started
    try:
        result = asyncio.run(_burst(client, n_requests))
    finally:
        stopping = time.perf_counter()
        client.shutdown()
        shutdown_s = time.perf_counter() - stopping
    return {"start_s": start_s, "shutdown_s": shutdown_s, **result}


def bench_backends(
    engines: int, n_requests: int, rounds: int, ray_address: str | None
) -> dict[str, Any]:
    """Run both backends ``rounds`` times, alternating; the medians per backend and the
    time Ray took to start or join its cluster (``ray_init_s``)."""
    import ray

    from corewire.client.ray_engines import import_ray

    import_ray()  # the error names the extra
    started = time.perf_counter()
    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
    ray_init_s = time.perf_counter() - started
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in BACKENDS}
    for _ in range(rounds):
        for backend in BACKENDS:
            runs[backend].append(_one_round(backend, engines, n_requests, ray_address))
    medians = {
        backend: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        for backend, rows in runs.items()
    }
    return {
        "engines": engines,
        "requests": n_requests,
        "rounds": rounds,
        "ray_init_s": ray_init_s,
        "nodes": len(ray.nodes()),
        "median": medians,
    }


def print_backends(result: dict[str, Any]) -> None:
    """The side-by-side table and the Ray / local ratios."""
    local, on_ray = result["median"]["local"], result["median"]["ray"]
    print(
        f"\nDP backends: {result['engines']} synthetic engines, a burst of "
        f"{result['requests']} requests x {TOKENS_PER_REQUEST} tokens, median of "
        f"{result['rounds']} rounds (Ray: {result['nodes']} node(s), joined or started in "
        f"{result['ray_init_s']:.2f} s, once)"
    )
    rows = [
        ("start until every engine is ready, s", "start_s", "{:.3f}"),
        ("burst, requests/s", "requests_per_s", "{:,.0f}"),
        ("request latency p50, ms", "latency_p50_ms", "{:.1f}"),
        ("request latency p99, ms", "latency_p99_ms", "{:.1f}"),
        ("routing spread, max/min requests per engine", "spread", "{:.3f}"),
        ("shutdown, s", "shutdown_s", "{:.3f}"),
    ]
    print(f"  {'':46} {'local':>10} {'ray':>10} {'ray/local':>10}")
    for label, key, fmt in rows:
        ratio = on_ray[key] / local[key] if local[key] else float("nan")
        print(
            f"  {label:46} {fmt.format(local[key]):>10} {fmt.format(on_ray[key]):>10} "
            f"{ratio:>9.2f}x"
        )
