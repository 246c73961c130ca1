"""DP engines as Ray actors (``data_parallel_backend="ray"``) on a real multi-node Ray
cluster on this machine (``ray.cluster_utils.Cluster``: a head without CPUs and two
worker nodes, each its own raylet), one cluster for the module.

Checked: engines land where the placement group put their bundles (read inside each
engine), requests spread over them, both clients work, a node that leaves the cluster
mid-stream is that engine's death at once (Ray's notice, long before the health check),
a failed start or an unplaceable group leaves nothing reserved, and after every test no
engine actor, placement group, key directory or thread is left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from client_support import request
from corewire import DPAsyncMPClient, DPLBAsyncMPClient, EngineDeadError
from corewire.protocol import FinishReason
from dp_support import SteadyStream, collect_finished, wait_until
from leak_support import wait_pid_gone

ray = pytest.importorskip("ray", reason="the Ray backend's tests need corewire[ray]")
from ray.cluster_utils import Cluster  # noqa: E402

from corewire.client.ray_engines import RayPlacement  # noqa: E402
from corewire.vllm.serve.model_dir import write_model_dir  # noqa: E402
from corewire.vllm.serve.stack import ServeStack  # noqa: E402

SYNTHETIC = "corewire.engine.synthetic:SyntheticEngine"
#: Bundles of one CPU: one engine per worker node (each has one).
ONE_CPU = {"CPU": 1.0}
#: A health check far slower than Ray's notice: a death seen sooner came from Ray.
SLOW_HEALTH = {"health_check_interval": 5.0, "health_check_timeout": 60.0}


#: The worker nodes: two of one CPU, and one with two GPUs as Ray counts them (Ray
#: assigns GPU ids from its own accounting, so GPU placement is checked without a GPU).
WORKER_NODES = ({"num_cpus": 1}, {"num_cpus": 1}, {"num_cpus": 1, "num_gpus": 2})


class RayCluster:
    """The module's cluster: a head node without CPUs (the front-end's; no engine fits
    there) and the :data:`WORKER_NODES`."""

    def __init__(self) -> None:
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        self.workers = [(self.cluster.add_node(**spec), spec) for spec in WORKER_NODES]
        ray.init(address=self.cluster.address, include_dashboard=False, log_to_driver=False)
        self.cluster.wait_for_nodes()

    def worker_ids(self) -> set[str]:
        return {node.node_id for node, _ in self.workers}

    def remove(self, node_id: str) -> None:
        """Take the worker node ``node_id`` out of the cluster, then add a fresh one like
        it (the next test has the same nodes again)."""
        entry = next(e for e in self.workers if e[0].node_id == node_id)
        self.cluster.remove_node(entry[0])
        self.workers.remove(entry)
        self.workers.append((self.cluster.add_node(**entry[1]), entry[1]))
        self.cluster.wait_for_nodes()

    def engine_actor_pids(self) -> list[int]:
        """Processes of the cluster that run a corewire engine actor now."""
        return [
            p.pid
            for p in psutil.Process().children(recursive=True)
            if _title(p).startswith("ray::EngineActor")
        ]

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


def _title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


_cluster: RayCluster | None = None


def LEAK_ALLOWED_PIDS() -> set[int]:
    """The cluster's own processes (GCS, raylets, idle workers) outlive each test; an
    engine actor's process does not."""
    if _cluster is None:
        return set()
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if not _title(p).startswith("ray::EngineActor")
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    global _cluster
    _cluster = RayCluster()
    try:
        yield _cluster
    finally:
        _cluster.shutdown()
        _cluster = None


def _placement_groups_alive() -> list[dict[str, Any]]:
    return [
        group for group in ray.util.placement_group_table().values() if group["state"] != "REMOVED"
    ]


def _engine_handles(client: Any) -> list[Any]:
    return [client.resources.processes.engines[i] for i in sorted(client.engine_indices)]


async def _assert_nothing_left(
    pids: list[int], keys_dir: str | None, ipc_dir: str | None = None
) -> None:
    """After shutdown: no engine actor's process, placement group, key or ipc directory."""
    if ipc_dir is not None:
        assert not os.path.exists(ipc_dir)
    for pid in pids:
        assert wait_pid_gone(pid, 15.0), f"engine actor pid {pid} still runs"
    await wait_until(lambda: not _placement_groups_alive(), 15.0, "the placement group removed")
    if keys_dir is not None:
        assert not os.path.exists(keys_dir)


async def test_engines_land_where_the_placement_group_says(cluster: RayCluster) -> None:
    client = DPLBAsyncMPClient(
        data_parallel_size=2,
        data_parallel_backend="ray",
        ray_placement=RayPlacement(strategy="STRICT_SPREAD", bundle=ONE_CPU),
        engine=SYNTHETIC,
        ready_timeout=60,
    )
    backend = client.ray_backend
    assert backend is not None
    try:
        handles = _engine_handles(client)
        # Each engine said where it runs from inside its own process.
        nodes = [h.where["node_id"] for h in handles]
        assert len(set(nodes)) == 2 and set(nodes) <= cluster.worker_ids()
        (group,) = backend.engines.placement_groups
        table = ray.util.placement_group_table(group)
        assert table["strategy"] == "STRICT_SPREAD"
        assert [table["bundles_to_node_id"][b] for b in range(2)] == nodes
        assert client.engine_pids == [h.where["pid"] for h in handles]
        # What the leak check after each test looks for (LEAK_ALLOWED_PIDS) finds them.
        assert sorted(cluster.engine_actor_pids()) == sorted(client.engine_pids)
        assert [h.where["gpu_ids"] for h in handles] == [[], []]
        # This node's address is not loopback: the link is behind CURVE, with keys made
        # for this client in a private directory.
        assert backend.keys_dir is not None
        assert stat.S_IMODE(os.stat(backend.keys_dir).st_mode) == 0o700
        ids = [f"r{i}" for i in range(16)]
        for rid in ids:
            await client.add_request_async(request(rid, max_tokens=3))
        done = await collect_finished(client, ids)
        assert Counter(f.engine_index for f in done.values()) == {0: 8, 1: 8}
        assert all(f.num_tokens == 3 for f in done.values())
        # The DP group is whole: both engines report to the coordinator and pause.
        states = await client._call_all_engines("dp_state")
        assert [s["data_parallel_size"] for s in states] == [2, 2]
    finally:
        pids = client.engine_pids
        ipc_dir = client.resources.ipc_dir
        started = time.monotonic()
        client.shutdown()
        shutdown_s = time.monotonic() - started
    await _assert_nothing_left(pids, backend.keys_dir, ipc_dir)
    assert shutdown_s < 10.0  # a hang, not a speed goal: the engines stop on request


async def test_strict_pack_puts_every_engine_on_one_node(cluster: RayCluster) -> None:
    client = DPLBAsyncMPClient(
        data_parallel_size=2,
        data_parallel_backend="ray",
        ray_placement=RayPlacement(
            strategy="STRICT_PACK",
            bundle={"CPU": 0.5},
            runtime_env={"env_vars": {"COREWIRE_LOG_LEVEL": "WARNING"}},
        ),
        engine=SYNTHETIC,
        ready_timeout=60,
    )
    try:
        wheres = [h.where for h in _engine_handles(client)]
        nodes = {w["node_id"] for w in wheres}
        assert len(nodes) == 1 and nodes <= cluster.worker_ids()
        # The runtime environment reached each engine's process.
        assert [w["env_vars"] for w in wheres] == [{"COREWIRE_LOG_LEVEL": "WARNING"}] * 2
        ids = [f"p{i}" for i in range(4)]
        for rid in ids:
            await client.add_request_async(request(rid, max_tokens=2))
        await collect_finished(client, ids)
    finally:
        pids = client.engine_pids
        client.shutdown()
    await _assert_nothing_left(pids, None)


async def test_ray_assigns_each_engine_its_own_gpus(cluster: RayCluster) -> None:
    client = DPLBAsyncMPClient(
        data_parallel_size=2,
        data_parallel_backend="ray",
        ray_placement=RayPlacement(strategy="PACK", bundle={"CPU": 0.25, "GPU": 1}),
        engine=SYNTHETIC,
        ready_timeout=60,
    )
    try:
        wheres = [h.where for h in _engine_handles(client)]
        # Both on the node with GPUs, each seeing one GPU, not the same one.
        assert len({w["node_id"] for w in wheres}) == 1
        assert sorted(w["cuda_visible_devices"] for w in wheres) == ["0", "1"]
        assert [w["gpu_ids"] for w in wheres] == [[w["cuda_visible_devices"]] for w in wheres]
    finally:
        pids = client.engine_pids
        client.shutdown()
    await _assert_nothing_left(pids, None)


async def test_an_actor_killed_is_that_engines_death_at_once(cluster: RayCluster) -> None:
    client = DPLBAsyncMPClient(
        data_parallel_size=2,
        data_parallel_backend="ray",
        engine=SYNTHETIC,
        engine_args={"step_delay": 0.01},
        ready_timeout=60,
        engine_loss="fail",  # vLLM's behaviour: the whole group ends
        **SLOW_HEALTH,
    )
    pids = client.engine_pids
    try:
        await client.add_request_async(request("k", max_tokens=100_000))
        waiter = asyncio.ensure_future(_drain(client))
        killed_at = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        await wait_until(lambda: client.engine_dead, 30.0, "the client to see the death")
        assert time.monotonic() - killed_at < SLOW_HEALTH["health_check_timeout"] / 2
        assert "corewire-engine-0" in client.resources.dead_reason
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiter, 10.0)
    finally:
        client.shutdown()
    await _assert_nothing_left(pids, None)


async def test_external_lb_client_places_its_own_engine(
    cluster: RayCluster, caplog: pytest.LogCaptureFixture
) -> None:
    client = DPAsyncMPClient(
        data_parallel_size=2,
        data_parallel_rank=1,
        data_parallel_backend="ray",
        # Another cluster than the one this process joined: said, and not used.
        ray_placement=RayPlacement(address="10.9.9.9:6379"),
        engine=SYNTHETIC,
        ready_timeout=60,
    )
    try:
        assert "RayPlacement(address='10.9.9.9:6379') not used" in caplog.text
        (handle,) = _engine_handles(client)
        assert client.engine_indices == [1] and handle.where["node_id"] in cluster.worker_ids()
        await client.add_request_async(request("x", max_tokens=2))
        done = await collect_finished(client, ["x"])
        assert done["x"].engine_index == 1
    finally:
        pids = client.engine_pids
        client.shutdown()
    await _assert_nothing_left(pids, None)


async def test_elastic_scaling_adds_and_removes_actors_while_serving(
    cluster: RayCluster,
) -> None:
    """2 -> 3 -> 1 engines under a steady stream: the new engine gets its own placement
    group and serves; the removed engines' requests end as ABORT, none is lost, and the
    group that no longer holds an engine is released at once."""
    client = DPLBAsyncMPClient(
        data_parallel_size=2,
        data_parallel_backend="ray",
        ray_placement=RayPlacement(strategy="PACK", bundle={"CPU": 0.5}),
        engine=SYNTHETIC,
        engine_args={"step_delay": 0.005},
        ready_timeout=60,
    )
    backend = client.ray_backend
    assert backend is not None
    all_pids: set[int] = set(client.engine_pids)
    try:
        async with SteadyStream(client, "e", max_tokens=20) as stream:
            done = stream.done
            await wait_until(lambda: len(done) >= 10, 30.0, "first completions")
            await client.scale_elastic_ep(3)
            all_pids.update(client.engine_pids)
            assert len(client.engine_pids) == 3 and len(backend.engines.placement_groups) == 2
            new_engine = _engine_handles(client)[2]
            assert new_engine.where["node_id"] in cluster.worker_ids()
            states = await client._call_all_engines("dp_state")
            assert [s["data_parallel_size"] for s in states] == [3, 3, 3]
            await wait_until(
                lambda: any(engine == 2 for _, engine in done.values()),
                30.0,
                "the new engine serving",
            )
            doomed = [f"doomed-{i}" for i in range(4)]
            for i, rid in enumerate(doomed):
                await client.add_request_async(request(rid, max_tokens=100_000, rank=1 + i % 2))
            stream.sent += doomed
            await client.scale_elastic_ep(1)
            assert len(client.engine_pids) == 1
            # Engine 2's group held nothing else: gone; engine 0 keeps the first one.
            assert len(backend.engines.placement_groups) == 1
            assert len(_placement_groups_alive()) == 1
            await stream.stop_sending()
            await wait_until(lambda: set(stream.sent) <= done.keys(), 60.0, "every request")
            reasons = Counter(reason for reason, _ in done.values())
            assert set(reasons) <= {FinishReason.LENGTH, FinishReason.ABORT}
            assert all(done[rid][0] == FinishReason.ABORT for rid in doomed)
            assert not client.reqs_in_flight
            for pid in all_pids - set(client.engine_pids):
                assert wait_pid_gone(pid, 15.0), f"removed engine actor {pid} still runs"
    finally:
        client.shutdown()
    await _assert_nothing_left(sorted(all_pids), None)


async def test_a_scale_up_given_up_while_ray_places_it_leaves_nothing(
    cluster: RayCluster,
) -> None:
    """A scale-up waiting for resources the cluster does not have, cancelled by its
    caller: the group stays as it was and serves, and the pending placement is gone."""
    client = DPLBAsyncMPClient(
        data_parallel_size=2,
        data_parallel_backend="ray",
        ray_placement=RayPlacement(strategy="SPREAD", bundle=ONE_CPU, placement_timeout=60),
        engine=SYNTHETIC,
        ready_timeout=60,
    )
    pids = client.engine_pids
    try:
        # Two more engines of one CPU each: the cluster has one CPU left.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.scale_elastic_ep(4), 2.0)
        await wait_until(
            lambda: len(_placement_groups_alive()) == 1, 10.0, "the pending group gone"
        )
        assert client.data_parallel_size == 2 and client.engine_pids == pids
        await client.add_request_async(request("after", max_tokens=2))
        assert (await collect_finished(client, ["after"]))["after"].num_tokens == 2
    finally:
        client.shutdown()
    await _assert_nothing_left(pids, None)


def _spread_group(**kwargs: Any) -> DPLBAsyncMPClient:
    """Two synthetic engines as Ray actors, one per worker node, the health check slower
    than Ray's notice of a death."""
    return DPLBAsyncMPClient(
        data_parallel_size=2,
        data_parallel_backend="ray",
        ray_placement=RayPlacement(strategy="STRICT_SPREAD", bundle=ONE_CPU),
        engine=SYNTHETIC,
        engine_args={"step_delay": 0.01},
        ready_timeout=60,
        **SLOW_HEALTH,
        **kwargs,
    )


async def test_a_node_leaving_mid_stream_is_that_engines_death_at_once(
    cluster: RayCluster,
) -> None:
    client = _spread_group(engine_loss="fail")  # vLLM's behaviour: the whole group ends
    backend = client.ray_backend
    assert backend is not None
    pids = client.engine_pids
    try:
        ids = [f"s{i}" for i in range(8)]
        for rid in ids:
            await client.add_request_async(request(rid, max_tokens=100_000))
        # Both engines stream.
        seen: set[int] = set()
        while seen != {0, 1}:
            seen.add((await client.get_output_async()).engine_index)
        lost = _engine_handles(client)[1]
        waiter = asyncio.ensure_future(_drain(client))
        removed_at = time.monotonic()
        cluster.remove(lost.node_id)
        await wait_until(lambda: client.engine_dead, 30.0, "the client to see the engine's death")
        seen_after = time.monotonic() - removed_at
        # Ray's notice, not the 60 s health check, and it names what happened.
        assert seen_after < SLOW_HEALTH["health_check_timeout"] / 2, seen_after
        reason = client.resources.dead_reason
        print(f"engine death seen {seen_after:.3f} s after the node left: {reason}")
        assert "corewire-engine-1" in reason and lost.exitcode == -9, reason
        assert lost.death_detail and lost.death_detail in reason
        # Every waiter fails at once; nothing hangs.
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiter, 10.0)
        with pytest.raises(EngineDeadError):
            await client.add_request_async(request("late"))
    finally:
        client.shutdown()
    await _assert_nothing_left(pids, backend.keys_dir)


async def test_a_node_leaving_is_one_engine_lost_and_replaced(cluster: RayCluster) -> None:
    """engine_loss="replace" (the default) on Ray: a node removed mid-stream ends only
    its engine's requests; the other streams on, and a new actor for the rank is placed
    on the node that took its place, and serves."""
    client = _spread_group()
    backend = client.ray_backend
    assert backend is not None and client.engine_loss == "replace"
    try:
        ids = [f"n{i}" for i in range(8)]
        for rid in ids:
            await client.add_request_async(request(rid, max_tokens=300))
        placed = dict(client.reqs_in_flight)
        lost = _engine_handles(client)[1]
        cluster.remove(lost.node_id)
        theirs = [rid for rid, at in placed.items() if at == 1]
        ours = [rid for rid, at in placed.items() if at == 0]
        done = await collect_finished(client, [*theirs, *ours], timeout=60)
        assert {done[rid].finish_reason for rid in theirs} == {FinishReason.ERROR}
        assert {done[rid].finish_reason for rid in ours} == {FinishReason.LENGTH}
        assert not client.engine_dead
        await wait_until(lambda: client.engines_replaced == 1, 60.0, "the rank replaced")
        new = _engine_handles(client)[1]
        assert new is not lost and new.node_id in cluster.worker_ids()
        burst = [f"after{i}" for i in range(6)]
        for rid in burst:
            await client.add_request_async(request(rid, max_tokens=2))
        served = await collect_finished(client, burst, timeout=30)
        assert {f.engine_index for f in served.values()} == {0, 1}
    finally:
        pids = client.engine_pids
        client.shutdown()
    await _assert_nothing_left(pids, backend.keys_dir)


async def _drain(client: Any) -> None:
    while True:
        await client.get_output_async()


async def test_an_engine_that_fails_to_build_fails_the_start_with_its_error(
    cluster: RayCluster,
) -> None:
    # Arguments the engine's signature takes (the front-end checks that much) but its
    # constructor refuses, in the actor.
    with pytest.raises(RuntimeError, match=r"before it was ready: .*max_batch >= 1"):
        DPLBAsyncMPClient(
            data_parallel_size=2,
            data_parallel_backend="ray",
            engine=SYNTHETIC,
            engine_args={"max_batch": 0},
            ready_timeout=60,
        )
    await wait_until(lambda: not cluster.engine_actor_pids(), 15.0, "the actors gone")
    await wait_until(lambda: not _placement_groups_alive(), 15.0, "the placement group removed")


async def test_a_group_the_cluster_cannot_place_times_out_naming_it(
    cluster: RayCluster,
) -> None:
    with pytest.raises(
        TimeoutError,
        match=r"2 engine bundle\(s\) \{'CPU': 1.0\} with strategy "
        r"STRICT_PACK",
    ):
        DPLBAsyncMPClient(
            data_parallel_size=2,
            data_parallel_backend="ray",
            ray_placement=RayPlacement(strategy="STRICT_PACK", placement_timeout=2.0),
            engine=SYNTHETIC,
        )
    assert not _placement_groups_alive()
    assert not [d for d in os.listdir(_tmp()) if d.startswith(f"corewire-keys-{os.getpid()}-")]


def _tmp() -> str:
    import tempfile

    return tempfile.gettempdir()


def test_options_that_do_not_fit_the_ray_backend_are_refused() -> None:
    with pytest.raises(ValueError, match="placement strategy must be one of"):
        RayPlacement(strategy="spread")
    with pytest.raises(ValueError, match="bundle must map"):
        RayPlacement(bundle={"CPU": -1})
    with pytest.raises(ValueError, match="data_parallel_backend must be"):
        DPLBAsyncMPClient(data_parallel_size=2, data_parallel_backend="slurm")
    with pytest.raises(ValueError, match="ray_placement needs"):
        DPLBAsyncMPClient(data_parallel_size=2, ray_placement=RayPlacement())
    with pytest.raises(ValueError, match="leave data_parallel_size_local unset"):
        DPLBAsyncMPClient(
            data_parallel_size=2, data_parallel_size_local=1, data_parallel_backend="ray"
        )
    with pytest.raises(ValueError, match="leave coordinator_addresses unset"):
        DPAsyncMPClient(
            data_parallel_size=2,
            data_parallel_rank=1,
            data_parallel_backend="ray",
            coordinator_addresses=object(),  # type: ignore[arg-type]
        )
    with pytest.raises(ValueError, match="leave curve_keys unset"):
        DPLBAsyncMPClient(data_parallel_size=2, data_parallel_backend="ray", curve_keys="k")


def test_without_ray_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'corewire\[ray\]'"):
        DPLBAsyncMPClient(data_parallel_size=2, data_parallel_backend="ray")


def test_vllm_serve_over_engines_placed_by_ray(cluster: RayCluster, tmp_path: Path) -> None:
    """``scripts/serve --engines 2 --ray``'s stack: vLLM's API server (its own DP = 2
    front-end, corewire's client inside it) over two reference engines that Ray placed
    on two nodes and that joined through vLLM's handshake; both serve, and stopping the
    stack leaves no actor and no placement group."""
    httpx = pytest.importorskip("httpx", reason="the serve test needs corewire[interop]")
    from serve_support import (
        HTTP_TIMEOUT,
        MAX_MODEL_LEN,
        MODEL,
        engine_args,
        metric_values,
        missing_prerequisite,
        plugin_missing,
    )

    missing = missing_prerequisite() or plugin_missing()
    if missing:
        pytest.skip(missing)
    model_dir = write_model_dir(tmp_path / "model", max_model_len=MAX_MODEL_LEN)
    stack = ServeStack(
        model_dir,
        port=0,
        engines=2,
        client="corewire",
        served_model_name=MODEL,
        max_model_len=MAX_MODEL_LEN,
        engine_args=engine_args(),
        log_dir=tmp_path / "logs",
        ray_placement=RayPlacement(strategy="STRICT_SPREAD", bundle=ONE_CPU),
    )
    stack.start(timeout=120)
    try:
        nodes = [h.node_id for h in stack.ray_engines]
        assert len(set(nodes)) == 2 and set(nodes) <= cluster.worker_ids()
        assert not stack.engines  # no local engine process
        pids = [h.pid for h in stack.ray_engines]
        with httpx.Client(base_url=stack.base_url, timeout=HTTP_TIMEOUT) as http:
            body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 8}
            body |= {"temperature": 0.0, "ignore_eos": True}
            texts = {http.post("/v1/completions", json=body).json()["choices"][0]["text"]}
            for _ in range(5):
                texts.add(http.post("/v1/completions", json=body).json()["choices"][0]["text"])
            assert len(texts) == 1  # greedy: the same answer from either engine
            per_engine: Counter[str] = Counter()
            samples = metric_values(http.get("/metrics").text, "vllm:request_success_total")
            for labels, value in samples:
                per_engine[labels["engine"]] += int(value)
            assert per_engine["0"] > 0 and per_engine["1"] > 0, per_engine
    finally:
        stack.stop()
    for pid in pids:
        assert wait_pid_gone(pid, 15.0), f"engine actor {pid} still runs"
    assert not _placement_groups_alive()
