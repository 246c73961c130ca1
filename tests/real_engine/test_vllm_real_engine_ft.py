"""vLLM's fault tolerance on its real engines, under vLLM's client and under corewire's.

``--enable-fault-tolerance`` (vLLM 0.27.0 on) runs with external load balancing: a
``vllm serve`` per DP rank, each with its own engine core, here two ranks of a tiny MoE
model (vLLM refuses external-LB DP for dense models) on vLLM's CPU build. There the first
step itself fails (the CPU build's ``all_gatherv`` raises ``NotImplementedError`` in the
MoE all-to-all), which puts both ranks into fault handling: each engine reports itself
``unhealthy`` and waits for an orchestrator's instruction, for vLLM's recovery window
(20 s here), answering nothing but that instruction.

Both clients side by side, corewire's with an aggressive health watchdog (a check every
second, 2 s to answer): the same answers throughout (the failed request, the pushed
status, the ``retry`` instruction accepted and answered, on this build with the worker's
failure), the engines alive and ``/health`` 200 through the window (corewire's
watchdog sends no check to an engine that is not healthy, and never declares it dead), and
at the window's end the same exit: the engine gives up and the API server stops.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from real_engine_support import require_cpu_build

require_cpu_build()

import httpx  # noqa: E402
import psutil  # noqa: E402

from port_support import unused_tcp_port  # noqa: E402
from real_engine_support import (  # noqa: E402
    CLIENTS,
    RealEngineServer,
    started_together,
    write_real_moe_model,
)
from serve_support import MODEL, SharedPids, first_difference  # noqa: E402

_SHARED_PIDS = SharedPids()
LEAK_ALLOWED_PIDS = _SHARED_PIDS.tree
#: vLLM's recovery window: how long an engine in fault handling waits for an instruction.
WINDOW_S = 20
#: corewire's watchdog, as aggressive as it goes: a check each second, 2 s to answer.
WATCHDOG = {"COREWIRE_HEALTH_CHECK_INTERVAL_S": "1", "COREWIRE_HEALTH_CHECK_TIMEOUT_S": "2"}

pytestmark = pytest.mark.timeout(600)


def _rank_args(rank: int, rpc_port: int) -> tuple[str, ...]:
    """``vllm serve``'s flags for one rank of the two."""
    return (
        "--data-parallel-size", "2", "--data-parallel-rank", str(rank),
        "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
        "--enable-fault-tolerance",
        # Fault tolerance refuses other all-to-all backends; the CPU build falls back
        # from this one to its own.
        "--all2all-backend", "deepep_low_latency",
        "--fault-tolerance-config", json.dumps({"engine_recovery_timeout_sec": WINDOW_S}),
    )  # fmt: skip


class Deployments(dict[str, list[RealEngineServer]]):
    """Per client, its two ranks (started); :meth:`restart` replaces a client's pair."""

    def __init__(self, root: Path, model_dir: Path) -> None:
        super().__init__()
        self.root, self.model_dir = root, model_dir
        self.starts = 0  # numbers each pair's logs, so that a restart keeps the first ones

    def made(self, client: str) -> list[RealEngineServer]:
        """A new pair of ranks for ``client`` (not started), its own DP RPC port."""
        rpc_port, self.starts = unused_tcp_port(), self.starts + 1
        return [
            RealEngineServer(
                self.model_dir,
                self.root / f"{client}-rank{r}-{self.starts}.log",
                client=client,
                args=_rank_args(r, rpc_port),
                env=WATCHDOG if client == "corewire" else None,
            )
            for r in (0, 1)
        ]

    def restart(self, client: str) -> list[RealEngineServer]:
        """Stop ``client``'s pair and start a fresh one in its place."""
        for server in self[client]:
            server.stop()
        self[client] = self.made(client)
        for server in self[client]:
            server.spawn()
        for server in self[client]:
            server.wait_healthy()
        _SHARED_PIDS.clear()
        for server in self.every():
            _SHARED_PIDS.update(server.pids())
        return self[client]

    def every(self) -> list[RealEngineServer]:
        """Every rank of every client."""
        return [server for ranks in self.values() for server in ranks]


@pytest.fixture(scope="module")
def deployments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployments]:
    """Per client, two ranks of external-LB DP with fault tolerance on, all four started
    side by side."""
    root = tmp_path_factory.mktemp("real-engine-ft")
    made = Deployments(root, write_real_moe_model(root / "moe"))
    for client in CLIENTS:
        made[client] = made.made(client)
    try:
        with started_together(made.every()):
            for server in made.every():
                _SHARED_PIDS.update(server.pids())
            yield made
    finally:
        for server in made.every():  # a restarted pair is not started_together's
            server.stop()
        _SHARED_PIDS.clear()


class ReferenceEngineDied(AssertionError):
    """The first request failed with vLLM's engine-dead answer before any fault was
    handled: what vLLM's own client did once in CI (2026-12-07), not reproduced since."""


def _status(server: RealEngineServer) -> dict[str, Any]:
    """The rank's own engine, as ``/fault_tolerance/status`` reports it."""
    resp = httpx.get(f"{server.base_url}/fault_tolerance/status", timeout=10.0)
    assert resp.status_code == 200, resp.text
    (engine,) = resp.json()["engines"]
    return engine


def _poll(server: RealEngineServer, until: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        engine = _status(server)
        if until(engine):
            return engine
        assert time.monotonic() < deadline, f"{what}: {engine}"
        time.sleep(0.2)


def _log_without_worker_traces(server: RealEngineServer, lines: int = 40) -> str:
    """The end of a rank's log less the worker's traceback of the expected failure (each
    of its lines names the executor's logging line), so that what else went wrong shows."""
    kept = [line for line in server.log().splitlines() if "multiproc_executor.py:1063]" not in line]
    return "\n".join(kept[-lines:])


def _fault_and_retry(ranks: list[RealEngineServer]) -> dict[str, Any]:
    """The first request (its step fails in every rank), each rank's status once it is in
    fault handling, and the ``retry`` instruction sent to both: what a caller sees."""
    seen: dict[str, Any] = {}
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 5, "temperature": 0.0}
    first = httpx.post(f"{ranks[0].base_url}/v1/completions", json=body, timeout=120.0)
    logs = tuple(map(_log_without_worker_traces, ranks))
    if first.status_code == 500 and "EngineCore encountered an issue" in first.text:
        raise ReferenceEngineDied(first.text, *logs)
    assert first.status_code == 200, (first.text, *logs)
    seen["first request"] = first.json()["choices"][0]["finish_reason"]
    for rank, server in enumerate(ranks):
        engine = _poll(server, lambda e: e["status"] != "healthy", f"rank {rank}'s fault")
        seen[f"rank {rank} status"] = engine
    # To every rank before waiting on any: retry rebuilds the DP group, collectively.
    request_ids = []
    for rank, server in enumerate(ranks):
        resp = httpx.post(
            f"{server.base_url}/fault_tolerance/apply", json={"instruction": "retry"}, timeout=30.0
        )
        answer = resp.json()
        assert resp.status_code == 202 and "request_id" in answer, answer
        request_ids.append(answer.pop("request_id"))
        seen[f"rank {rank} retry"] = (resp.status_code, answer)
    for rank, (server, request_id) in enumerate(zip(ranks, request_ids, strict=True)):

        def answered(engine: dict[str, Any], request_id: Any = request_id) -> bool:
            return engine.get("last_ft_request_id") == request_id

        engine = _poll(server, answered, f"rank {rank}'s answer to retry")
        engine.pop("last_ft_request_id")
        seen[f"rank {rank} after retry"] = engine
    return seen


def test_fault_tolerance_runs_as_under_vllms_client(deployments: Deployments) -> None:
    seen, window_ends = {}, {}
    for client in CLIENTS:
        faulted_at = time.monotonic()  # just before this deployment's first request
        try:
            seen[client] = _fault_and_retry(deployments[client])
        except ReferenceEngineDied as died:
            # Only the reference gets a second pair, once: corewire's client answering so
            # fails the test, and so does vLLM's doing it twice. Its logs stay in the warning.
            if client != "vllm":
                raise
            with warnings.catch_warnings():  # shown in the summary, not raised by the suite
                warnings.simplefilter("always")
                warnings.warn(f"vLLM's client: engine dead at first: {died}", stacklevel=1)
            ranks = deployments.restart(client)
            faulted_at = time.monotonic()
            seen[client] = _fault_and_retry(ranks)
        window_ends[client] = faulted_at + WINDOW_S
    assert seen["corewire"] == seen["vllm"], first_difference(seen["corewire"], seen["vllm"])
    # Not vacuous: the ranks were in fault handling, and the instruction reached the
    # engine (on this build the worker's own retry fails: NotImplementedError).
    assert seen["vllm"]["rank 0 status"]["status"] == "unhealthy", seen
    assert "ft_error" in seen["vllm"]["rank 0 after retry"], seen

    engines = {
        (client, rank): server.engine_processes()
        for client, ranks in deployments.items()
        for rank, server in enumerate(ranks)
    }
    assert all(len(procs) == 1 for procs in engines.values()), engines
    # Through each deployment's window, less a margin for the rank that faulted last:
    # every engine alive, every server healthy, checked each second.
    checks = dict.fromkeys(deployments, 0)
    while True:
        now = time.monotonic()
        watched = [c for c in deployments if now < window_ends[c] - 3]
        if not watched:
            break
        for client in watched:
            for rank, server in enumerate(deployments[client]):
                alive = [p.is_running() for p in engines[client, rank]]
                assert alive == [True], f"{client} rank {rank}: the engine died in the window"
                assert server.health() == 200, server.log_tail()
            checks[client] += 1
        time.sleep(1.0)
    # Not vacuous: each deployment was watched, second by second, well into its window
    # (the other deployment's fault and retry take a few seconds of vLLM's).
    assert all(n >= WINDOW_S // 4 for n in checks.values()), checks
    # Then vLLM's own end: each engine gives up, its API server stops.
    for (client, rank), procs in engines.items():
        server = deployments[client][rank]
        assert server.process is not None
        server.process.wait(timeout=90)
        _, still_running = psutil.wait_procs(procs, timeout=30)
        assert not still_running, f"{client} rank {rank}: {still_running}"
        log = server.log()
        assert f"No recovery within {WINDOW_S}s timeout" in log, server.log_tail()
        assert "health check failed" not in log
