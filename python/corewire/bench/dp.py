"""``corewire bench dp``: data-parallel routing, decision cost and load spread, corewire's
Router vs vLLM 0.25.1's rule and other alternatives.

Run: ``corewire bench dp`` (about 10 s; ``--quick`` for a short run). ``--backend ray``
adds part 3 (:mod:`corewire.bench.dp_backends`): the same DP group on local processes and
on Ray actors, start-up, a burst through the router and shutdown side by side.

1. Decision cost per request, measured from Python for N = 2, 16 and 64 engines, side by
   side in one process: ``corewire._native.Router.choose()`` (one native call), the same
   least-loaded rule written in Python (what a front-end without the native router pays),
   plain round-robin (``next(itertools.cycle)``, the floor of any decision) and, when
   vLLM is installed, vLLM 0.25.1's own decision (``DPLBAsyncMPClient``'s
   ``get_core_engine_for_request``, see :class:`VllmRule`); without vLLM the run says so. Each loop
   also reports a request finished now and then, as a serving front-end does. Goal: the
   native decision costs at most 0.3 us at N = 16.

2. Load spread for requests with skewed lengths (most short, a few very long) over
   simulated engines that run a batch of requests per 10 ms step, in two scenarios: a
   burst (2 s of arrivals at 3x what the group can serve) and a stream (90% of capacity,
   long run). The coordinator's counts reach the router every 100 ms (stale in between,
   as in real serving). Both policies see the identical arrival sequence. Reported per
   policy: requests per engine (max/min: round-robin evens out counts, not work),
   outstanding requests per engine averaged over time (max/min across engines, sampled
   every step while requests arrive), the worst instantaneous imbalance, the mean time a
   request waits for a batch slot, and the time until the last request finishes; then
   the round-robin / Router ratios (above 1: the Router spreads better).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from corewire._native import Router
from corewire._optional import import_optional
from corewire.bench import common

__all__ = ["add_arguments", "run"]

STEP_S = 0.010  # one simulated engine step
STATS_EVERY = 10  # steps between two coordinator updates (100 ms)
_SHORT = {"round-robin": "rr", "vLLM rule": "vLLM"}  # policy names in the ratio lines


class PyLeastLoaded:
    """The Router's rule in plain Python: the cost a pure-Python front-end would pay."""

    def __init__(self, n: int) -> None:
        self.reported = [0] * n
        self.waiting = [0] * n
        self.sent = [0] * n
        self.in_flight = [0] * n
        self.start = 0
        self.n = n

    def choose(self) -> int:
        n = self.n
        start = self.start
        self.start = start + 1 if start + 1 < n else 0
        best = start
        best_key = None
        reported, sent, in_flight, waiting = self.reported, self.sent, self.in_flight, self.waiting
        for i in itertools.chain(range(start, n), range(start)):
            load = reported[i] + sent[i]
            if in_flight[i] > load:
                load = in_flight[i]
            key = (load, waiting[i])
            if best_key is None or key < best_key:
                best, best_key = i, key
        sent[best] += 1
        in_flight[best] += 1
        return best

    def note_finished(self, engine: int, count: int = 1) -> None:
        self.in_flight[engine] = max(0, self.in_flight[engine] - count)


def time_decisions(choose: Callable[[], int], finish: Callable[[int], None], n_calls: int) -> float:
    """Seconds per decision, best of three runs of ``n_calls``."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(n_calls):
            e = choose()
            if not i & 7:
                finish(e)
        best = min(best, (time.perf_counter() - t0) / n_calls)
    return best


def bench_decision_cost(n_calls: int, use_vllm: bool) -> list[dict[str, Any]]:
    """Times each policy's decision for 2, 16 and 64 engines; one row per engine count."""
    print(f"== routing decision cost per request ({n_calls:,} decisions, best of 3) ==")
    print(
        f"{'engines':>7} {'Router (native)':>16} {'Python rule':>12} {'round-robin':>12} "
        + (f"{'vLLM rule':>12} " if use_vllm else "")
        + f"{'python/native':>14} {'native-rr':>10}"
        + (f" {'vllm/native':>12}" if use_vllm else "")
    )
    rows: list[dict[str, Any]] = []
    for n in (2, 16, 64):
        router = Router(n)
        native = time_decisions(router.choose, router.note_finished, n_calls)
        py = PyLeastLoaded(n)
        python = time_decisions(py.choose, py.note_finished, max(n_calls // 8, 10_000))
        rr_iter = itertools.cycle(range(n))
        rr = time_decisions(rr_iter.__next__, lambda _e: None, n_calls)
        seconds = {"router": native, "python": python, "round_robin": rr}
        vllm_text = ratio_text = ""
        if use_vllm:
            rule = VllmRule(n)
            seconds["vllm"] = time_decisions(
                rule.choose, rule.note_finished, max(n_calls // 8, 10_000)
            )
            vllm_text = f"{seconds['vllm'] * 1e9:>9.1f} ns "
            ratio_text = f" {seconds['vllm'] / native:>11.1f}x"
        print(
            f"{n:>7} {native * 1e9:>13.1f} ns {python * 1e9:>9.1f} ns {rr * 1e9:>9.1f} ns "
            f"{vllm_text}{python / native:>13.1f}x {(native - rr) * 1e9:>7.1f} ns{ratio_text}"
        )
        rows.append(
            {
                "part": "decision",
                "engines": n,
                "ns_per_decision": {k: v * 1e9 for k, v in seconds.items()},
                "ratios": {k: v / native for k, v in seconds.items() if k != "router"},
            }
        )
    goal_ns = next(r for r in rows if r["engines"] == 16)["ns_per_decision"]["router"]
    verdict = "met" if goal_ns <= 300 else "MISSED"
    print(f"goal (native decision <= 300 ns at N=16): {goal_ns:.1f} ns -> {verdict}")
    print()
    return rows


class VllmRule:
    """vLLM 0.25.1's own choice of engine: ``DPLBAsyncMPClient.get_core_engine_for_request``
    (its least ``4 x waiting + running`` rule, counting its own choices as waiting between
    the coordinator's updates), called on a stand-in that holds the state it reads, so
    that no vLLM client or engine has to be started. Finished requests change nothing:
    vLLM learns of them only from the coordinator's counts."""

    def __init__(self, n: int) -> None:
        core_client = import_optional("vllm.v1.engine.core_client", "vLLM's DP routing rule")
        self._rule = core_client.DPLBAsyncMPClient.get_core_engine_for_request
        # The engines' identities are their indexes: the rule returns one of them.
        self._client = types.SimpleNamespace(
            lb_engines=[[0, 0] for _ in range(n)],
            eng_start_index=0,
            client_count=1,
            core_engines=list(range(n)),
            reqs_in_flight={},
        )
        self._request = types.SimpleNamespace(
            request_id="cmpl-0", data_parallel_rank=None, pooling_params=None
        )

    def choose(self) -> int:
        return self._rule(self._client, self._request)

    def note_finished(self, engine: int, count: int = 1) -> None:
        pass

    def update_counts(self, counts: list[tuple[int, int]]) -> None:
        # vLLM's client replaces its counts with the coordinator's (waiting, running).
        self._client.lb_engines = [[waiting, running] for waiting, running in counts]


class RoundRobin:
    """Plain round-robin: ignores load entirely."""

    def __init__(self, n: int) -> None:
        self._next = itertools.cycle(range(n)).__next__

    def choose(self) -> int:
        return self._next()

    def note_finished(self, engine: int, count: int = 1) -> None:
        pass

    def update_counts(self, counts: list[tuple[int, int]]) -> None:
        pass


def make_workload(n_requests: int, rate_per_step: float, seed: int) -> list[tuple[int, int]]:
    """(arrival_step, length_in_steps) pairs: 90% short (8-32 steps), 10% long (200-800)."""
    rng = random.Random(seed)
    out = []
    t = 0.0
    for _ in range(n_requests):
        t += rng.expovariate(rate_per_step)
        length = rng.randint(200, 800) if rng.random() < 0.10 else rng.randint(8, 32)
        out.append((int(t), length))
    return out


def simulate(policy, n: int, workload: list[tuple[int, int]], max_batch: int) -> dict[str, float]:
    """Steps simulated engines through ``workload`` routed by ``policy``."""
    waiting: list[list[int]] = [[] for _ in range(n)]  # remaining steps per queued request
    running: list[list[int]] = [[] for _ in range(n)]
    assigned = [0] * n
    spread_sum = 0.0
    worst = 0.0
    samples = 0
    i = 0
    step = 0
    total = len(workload)
    done = 0
    queued_steps = 0  # sum over steps of requests waiting: total queueing delay
    while done < total:
        while i < total and workload[i][0] <= step:
            e = policy.choose()
            assigned[e] += 1
            waiting[e].append(workload[i][1])
            i += 1
        for e in range(n):
            run, queue = running[e], waiting[e]
            while queue and len(run) < max_batch:
                run.append(queue.pop(0))
            queued_steps += len(queue)
            still = []
            finished = 0
            for remaining in run:
                if remaining > 1:
                    still.append(remaining - 1)
                else:
                    finished += 1
            running[e] = still
            if finished:
                done += finished
                policy.note_finished(e, finished)
        if step % STATS_EVERY == 0:
            policy.update_counts([(len(waiting[e]), len(running[e])) for e in range(n)])
        if i < total:  # only while requests still arrive: the tail is everyone draining
            loads = [len(waiting[e]) + len(running[e]) for e in range(n)]
            hi, lo = max(loads), min(loads)
            if hi:
                ratio = hi / max(lo, 1)
                spread_sum += ratio
                worst = max(worst, ratio)
                samples += 1
        step += 1
    return {
        "req_max_min": max(assigned) / max(min(assigned), 1),
        "load_spread": spread_sum / max(samples, 1),
        "worst": worst,
        "makespan_s": step * STEP_S,
        "mean_wait_ms": queued_steps * STEP_S * 1000 / total,
    }


def bench_spread(scale: float, use_vllm: bool) -> list[dict[str, Any]]:
    """Simulates both scenarios for 4 and 16 engines under each policy; one row per
    (scenario, engines, policy), then one of the ratios to the Router."""
    max_batch = 8
    mean_len = 0.9 * 20 + 0.1 * 500
    print(
        "== load spread, skewed request lengths (90% 8-32 steps, 10% 200-800 steps), "
        f"batch {max_batch}/engine, counts every {STATS_EVERY * STEP_S * 1000:.0f} ms =="
    )
    print(
        f"{'scenario':>8} {'engines':>7} {'policy':>12} {'req max/min':>12} "
        f"{'load max/min':>13} {'worst':>7} {'queue wait':>11} {'last done':>10}"
    )
    rows: list[dict[str, Any]] = []
    for scenario in ("burst", "stream"):
        for n in (4, 16):
            capacity = n * max_batch / mean_len  # requests per step the group can finish
            if scenario == "burst":
                # 3x what the group can serve, for 2 s: queues build while counts lag.
                rate, count = 3 * capacity, int(3 * capacity * 200 * scale)
            else:
                # 90% of capacity for a long time: the steady state.
                rate, count = 0.9 * capacity, int(500 * n * scale)
            workload = make_workload(count, rate, seed=1234 + n)
            results = {}
            policies: list[tuple[str, Any]] = [
                ("Router", Router(n)),
                ("round-robin", RoundRobin(n)),
            ]
            if use_vllm:
                policies.append(("vLLM rule", VllmRule(n)))
            for name, policy in policies:
                results[name] = r = simulate(policy, n, workload, max_batch)
                rows.append(
                    {"part": "spread", "scenario": scenario, "engines": n, "policy": name, **r}
                )
                print(
                    f"{scenario:>8} {n:>7} {name:>12} {r['req_max_min']:>12.2f} "
                    f"{r['load_spread']:>13.2f} {r['worst']:>7.1f} "
                    f"{r['mean_wait_ms']:>8.1f} ms {r['makespan_s']:>9.1f}s"
                )
            b = results["Router"]
            for name in results:
                if name == "Router":
                    continue
                a = results[name]
                print(
                    f"{scenario:>8} {n:>7} {_SHORT[name] + ' / Router':>12} "
                    f"{a['req_max_min'] / b['req_max_min']:>11.2f}x "
                    f"{a['load_spread'] / b['load_spread']:>12.2f}x "
                    f"{a['worst'] / b['worst']:>6.2f}x "
                    f"{a['mean_wait_ms'] / max(b['mean_wait_ms'], 1e-9):>10.2f}x "
                    f"{a['makespan_s'] / b['makespan_s']:>9.2f}x"
                )
    print()
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Decision cost against engine count, and each policy's queue wait and load spread
    per scenario (matplotlib)."""
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    decision = [r for r in rows if r["part"] == "decision"]
    labels = {
        "router": "corewire Router (native)",
        "python": "same rule in Python",
        "round_robin": "round-robin",
        "vllm": "vLLM 0.25.1 rule (DPLBAsyncMPClient)",
    }
    ax = axes[0]
    xs = [r["engines"] for r in decision]
    for name in decision[0]["ns_per_decision"]:
        ax.plot(xs, [r["ns_per_decision"][name] for r in decision], marker="o", label=labels[name])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("engines")
    ax.set_ylabel("ns per decision (lower is better)")
    ax.set_title("routing decision cost")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    spread = [r for r in rows if r["part"] == "spread"]
    groups = list(dict.fromkeys((r["scenario"], r["engines"]) for r in spread))
    policies = list(dict.fromkeys(r["policy"] for r in spread))
    width = 0.8 / len(policies)
    for ax, key, ylabel in (
        (axes[1], "mean_wait_ms", "mean queue wait, ms (lower is better)"),
        (axes[2], "load_spread", "outstanding max/min across engines (lower is better)"),
    ):
        for i, policy in enumerate(policies):
            values = {
                (r["scenario"], r["engines"]): r[key] for r in spread if r["policy"] == policy
            }
            ax.bar(
                [j + i * width for j in range(len(groups))],
                [values.get(g, 0.0) for g in groups],
                width,
                label=policy,
            )
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(groups))], [f"{s}, {n} eng." for s, n in groups]
        )
        ax.set_ylabel(ylabel)
        ax.set_title("load spread, skewed request lengths")
        ax.legend(fontsize=8)
    fig.suptitle("Data-parallel routing")
    common.save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``corewire bench dp``'s flags."""
    common.add_common_arguments(parser)
    parser.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="ray: also run a DP group on local processes and on Ray actors side by side "
        "(start-up, a burst through the router, shutdown; needs corewire[ray])",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="with --backend ray: the Ray cluster to join (default: RAY_ADDRESS, else a "
        "local one started for the run)",
    )
    parser.add_argument(
        "--engines", type=int, default=2, help="with --backend ray: engines in the group"
    )


def run(args: argparse.Namespace) -> int:
    """Runs both parts; exit status 0 (the goal is reported, not enforced)."""
    if not common.check_plot_possible("corewire bench dp", args):
        return 2
    vllm_version = common.vllm_version()
    if vllm_version is None:
        print(
            f"vLLM is not installed: no comparison with vLLM {common.VLLM_VERSION}'s DP "
            f"load-balancing rule; in-house baselines only (pip install "
            f"vllm=={common.VLLM_VERSION})"
        )
    else:
        print(f"baseline: vLLM {vllm_version}'s DPLBAsyncMPClient.get_core_engine_for_request")
    backends = None
    if args.backend == "ray":
        from corewire.client.ray_engines import import_ray

        try:
            import_ray()
        except ImportError as exc:
            print(f"corewire bench dp --backend ray: {exc}", file=sys.stderr)
            return 2
        if args.engines < 1:
            print("corewire bench dp: --engines must be >= 1", file=sys.stderr)
            return 2
    rows = bench_decision_cost(200_000 if args.quick else 2_000_000, vllm_version is not None)
    rows += bench_spread(0.2 if args.quick else 1.0, vllm_version is not None)
    if args.backend == "ray":
        from corewire.bench.dp_backends import bench_backends, print_backends

        backends = bench_backends(
            args.engines, 500 if args.quick else 5_000, 1 if args.quick else 3, args.ray_address
        )
        print_backends(backends)
    goal_ns = next(r for r in rows if r["engines"] == 16)["ns_per_decision"]["router"]
    found = [common.Goal("native decision at 16 engines, ns", goal_ns, 300.0, True)]
    if args.json:
        common.write_json(
            args.json,
            "dp",
            baseline="vllm" if vllm_version is not None else "python",
            options={"quick": args.quick, "backend": args.backend, "engines": args.engines},
            cases=rows,
            goals=found,
            units={
                "ns_per_decision": "ns per routing decision",
                "ratios": "policy time / Router time",
                "mean_wait_ms": "mean time a request waits for a batch slot",
                "load_spread": "outstanding requests, max/min across engines, time-averaged",
            },
            **({"backends": backends} if backends is not None else {}),
        )
        print(f"results written to {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    return 0
