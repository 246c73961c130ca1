"""Data parallel with several API servers, vLLM's default, over vLLM's real engines.

``vllm serve --data-parallel-size 2`` starts two API server processes (``api_server_count``
defaults to the DP size), vLLM's DP coordinator and two real engine cores; each API server
has its own engine-core client routing over both engines. Two such servers run side by
side on vLLM's CPU build, one with vLLM's client and one with corewire's, then one with
corewire's and ``--api-server-count 3``. Checked: every answer equals vLLM's client's in
the same layout; bursts of concurrent requests reach both engines from every front-end
(the spread per burst is printed next to vLLM's); a client that hangs up is aborted on
the engine that ran its request (each engine's running count comes back to zero).

Last, hybrid load balancing (``--data-parallel-hybrid-lb``) as vLLM runs it on two nodes,
here two ``vllm serve`` on loopback with two local ranks each: every answer equal to vLLM's
client's, each node's bursts reach only and every one of its own ranks, and each node's
``/metrics`` counts its engines' requests.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from real_engine_support import require_cpu_build

require_cpu_build()

import httpx  # noqa: E402

from port_support import unused_tcp_port  # noqa: E402
from real_engine_support import (  # noqa: E402
    RealEngineServer,
    one_server_per_client,
    started_together,
    write_real_model,
)
from serve_support import (  # noqa: E402
    MODEL,
    PLUGIN_LOG_LINE,
    SharedPids,
    completion,
    first_difference,
    metric_values,
    output_workload,
    sse_events,
)

_SHARED_PIDS = SharedPids()
LEAK_ALLOWED_PIDS = _SHARED_PIDS.tree
DP_ARGS = ("--data-parallel-size", "2", "--max-num-seqs", "16")
#: Bursts of concurrent requests, and their size.
BURSTS, BURST = 4, 32

pytestmark = pytest.mark.timeout(900)

#: What each layout answered, by name, across the module's tests.
_ANSWERS: dict[str, list[Any]] = {}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("real-engine-dp")
    return root, write_real_model(root / "model")


@pytest.fixture(scope="module")
def servers(model: Any) -> Iterator[dict[str, RealEngineServer]]:
    """DP = 2 with vLLM's default API server count, one server per client."""
    root, model_dir = model
    with one_server_per_client(model_dir, root, _SHARED_PIDS, args=DP_ARGS, name="dp2-") as made:
        yield made


def _per_engine_successes(http: httpx.Client) -> dict[str, float]:
    done: dict[str, float] = {}
    for labels, value in metric_values(http.get("/metrics").text, "vllm:request_success_total"):
        engine = labels.get("engine", "?")
        done[engine] = done.get(engine, 0.0) + value
    return done


def _burst_spreads(
    server: RealEngineServer, watched: tuple[RealEngineServer, ...] = ()
) -> list[dict[str, int]]:
    """Requests per engine in each of :data:`BURSTS` bursts of :data:`BURST` at once, sent
    to ``server``; the engines counted from the ``/metrics`` of ``server`` and of every
    server in ``watched`` (each front-end reports the engines it drives)."""
    metrics_of = (server, *watched)

    def successes() -> dict[str, float]:
        done: dict[str, float] = {}
        for front_end in metrics_of:
            with httpx.Client(base_url=front_end.base_url, timeout=60.0) as http:
                for engine, count in _per_engine_successes(http).items():
                    done[engine] = done.get(engine, 0.0) + count
        return done

    async def burst(client: httpx.AsyncClient, round_: int) -> list[int]:
        async def one(i: int) -> int:
            body = {"model": MODEL, "prompt": f"story {round_} {i}", "max_tokens": 8}
            body |= {"ignore_eos": True, "temperature": 0.0}
            return (await client.post("/v1/completions", json=body)).status_code

        return await asyncio.gather(*(one(i) for i in range(BURST)))

    spreads = []
    for round_ in range(BURSTS):
        before = successes()

        async def run(round_: int = round_) -> list[int]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120.0) as c:
                return await burst(c, round_)

        codes = asyncio.run(run())
        assert codes == [200] * BURST, codes
        deadline = time.monotonic() + 30
        while True:  # the engines report their counts a step later
            after = successes()
            got = {e: int(after[e] - before.get(e, 0.0)) for e in after}
            if sum(got.values()) >= BURST or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        spreads.append({e: n for e, n in sorted(got.items()) if n})
    return spreads


def test_every_api_server_runs_corewires_client(servers: dict[str, RealEngineServer]) -> None:
    # One line per API server process (vLLM names them ApiServer_0, ApiServer_1).
    log = servers["corewire"].log()
    servers_with_it = set(re.findall(r"\((ApiServer_\d+) pid=\d+\).*" + PLUGIN_LOG_LINE, log))
    assert servers_with_it == {"ApiServer_0", "ApiServer_1"}, servers_with_it
    assert PLUGIN_LOG_LINE not in servers["vllm"].log()


def test_answers_equal_vllms_client_in_the_same_layout(
    servers: dict[str, RealEngineServer],
) -> None:
    for name, server in servers.items():
        with httpx.Client(base_url=server.base_url, timeout=120.0) as http:
            _ANSWERS[name] = output_workload(http)
    for i, (a, b) in enumerate(zip(_ANSWERS["corewire"], _ANSWERS["vllm"], strict=True)):
        assert a == b, f"answer {i}: {first_difference(a, b)}"


def test_bursts_reach_both_engines_as_under_vllms_client(
    servers: dict[str, RealEngineServer],
) -> None:
    spreads = {name: _burst_spreads(server) for name, server in servers.items()}
    report = {
        name: [f"{s.get('0', 0)}/{s.get('1', 0)}" for s in per_burst]
        for name, per_burst in spreads.items()
    }
    print(f"requests per engine (engine 0/engine 1), bursts of {BURST}: {report}")
    for per_burst in spreads["corewire"]:
        # Each API server alternates its own requests (its in-flight floor): a burst
        # that reaches both servers, or one, reaches both engines either way.
        assert set(per_burst) == {"0", "1"} and sum(per_burst.values()) == BURST, report


def _running(http: httpx.Client) -> dict[str, float]:
    return {
        labels.get("engine", "?"): value
        for labels, value in metric_values(http.get("/metrics").text, "vllm:num_requests_running")
    }


def test_hang_ups_are_aborted_on_the_engine_that_ran_them(
    servers: dict[str, RealEngineServer],
) -> None:
    server = servers["corewire"]
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=120.0) as http:
        for _ in range(4):  # spread over both engines by the routers
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                for i, _event in enumerate(sse_events(resp)):
                    if i == 2:
                        break
        deadline = time.monotonic() + 60
        while True:
            completion(http, prompt="hi", max_tokens=1)  # each engine steps and reports
            running = _running(http)
            if running and not any(running.values()):
                break
            assert time.monotonic() < deadline, running
            time.sleep(0.5)


def test_three_api_servers_answer_the_same(
    servers: dict[str, RealEngineServer], model: Any
) -> None:
    for server in servers.values():  # their engines' cores back for this layout
        server.stop()
    root, model_dir = model
    args = (*DP_ARGS, "--api-server-count", "3")
    three = RealEngineServer(model_dir, root / "dp2-api3.log", client="corewire", args=args)
    with started_together([three]):
        _SHARED_PIDS.update(three.pids())
        log = three.log()
        started = set(re.findall(r"\((ApiServer_\d+) pid=\d+\).*" + PLUGIN_LOG_LINE, log))
        assert started == {"ApiServer_0", "ApiServer_1", "ApiServer_2"}, started
        with httpx.Client(base_url=three.base_url, timeout=120.0) as http:
            answers = output_workload(http)
        for i, (a, b) in enumerate(zip(answers, _ANSWERS["vllm"], strict=True)):
            assert a == b, f"answer {i}: {first_difference(a, b)}"
        spreads = _burst_spreads(three)
        print(f"--api-server-count 3, requests per engine: {spreads}")
        assert all(set(s) == {"0", "1"} for s in spreads), spreads


#: Hybrid load balancing: four ranks on two "nodes" of two local engines each.
HYBRID_SIZE, HYBRID_LOCAL = 4, 2


def test_hybrid_balancing_one_front_end_per_node(
    servers: dict[str, RealEngineServer], model: Any
) -> None:
    """vLLM's ``--data-parallel-hybrid-lb``: each node's ``vllm serve`` starts its own
    ranks and routes only over them (with its default API server count, the node's local
    size), the head node also runs the DP coordinator. Both nodes run here, on loopback."""
    for server in servers.values():  # their engines' cores back for this layout
        server.stop()
    root, model_dir = model
    rpc_port = unused_tcp_port()
    group = (
        "--data-parallel-size", str(HYBRID_SIZE),
        "--data-parallel-size-local", str(HYBRID_LOCAL),
        "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", str(rpc_port),
        "--max-num-seqs", "16",
    )  # fmt: skip
    head = RealEngineServer(
        model_dir, root / "hybrid-node0.log", client="corewire",
        args=(*group, "--data-parallel-hybrid-lb"),
    )  # fmt: skip
    # A start rank without the hybrid flag: vLLM's CLI takes it for hybrid balancing, so
    # both of its spellings run.
    other = RealEngineServer(
        model_dir, root / "hybrid-node1.log", client="corewire",
        args=(*group, "--data-parallel-start-rank", str(HYBRID_LOCAL)),
    )  # fmt: skip
    nodes = {"0": head, "1": other}
    ranks = {"0": {"0", "1"}, "1": {"2", "3"}}
    with started_together([head, other]):
        for node in nodes.values():
            _SHARED_PIDS.update(node.pids())
            started = set(
                re.findall(r"\((ApiServer_\d+) pid=\d+\).*" + PLUGIN_LOG_LINE, node.log())
            )
            assert started == {"ApiServer_0", "ApiServer_1"}, started
        for name, node in nodes.items():
            with httpx.Client(base_url=node.base_url, timeout=120.0) as http:
                answers = output_workload(http)
            for i, (a, b) in enumerate(zip(answers, _ANSWERS["vllm"], strict=True)):
                assert a == b, f"node {name}, answer {i}: {first_difference(a, b)}"
        for name, node in nodes.items():
            # Counted on both nodes' /metrics: a burst to one node reaches its own ranks
            # only, every one of them, and that node's front-ends report their stats.
            others = tuple(n for n in nodes.values() if n is not node)
            spreads = _burst_spreads(node, watched=others)
            print(f"hybrid LB, node {name}'s burst, requests per engine: {spreads}")
            assert all(set(s) == ranks[name] for s in spreads), spreads
            assert all(sum(s.values()) == BURST for s in spreads), spreads
