"""DP clients against real engine processes and a real coordinator.

Every test starts its own engines (each imports torch), so they are kept few and small.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from client_support import request
from corewire import DPAsyncMPClient, DPLBAsyncMPClient, EngineDeadError, UtilityError
from corewire.client.dp import DPConsensusError
from corewire.protocol import FinishReason
from dp_support import LIGHT, EnginePeer, Sockets, SteadyStream, collect_finished, wait_until
from leak_support import pid_gone


async def engine_states(client: DPAsyncMPClient) -> list[dict]:
    """Each engine's ``dp_state()``, in engine order."""
    return await client._call_all_engines("dp_state")


async def wait_engine_states(
    client: DPAsyncMPClient, predicate: Callable[[list[dict]], bool], timeout: float = 10.0
) -> list[dict]:
    """Engine states once ``predicate`` holds for them (wave messages reach each engine
    on its own socket, so an engine may lag the coordinator's publication a little)."""
    deadline = time.monotonic() + timeout
    while True:
        states = await engine_states(client)
        if predicate(states):
            return states
        assert time.monotonic() < deadline, f"engine states never matched: {states}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("size", [2, 3, 4])
async def test_burst_splits_evenly_and_waves_pause(size: int) -> None:
    client = DPLBAsyncMPClient(data_parallel_size=size, engine_args=LIGHT)
    try:
        assert len(client.engine_pids) == size
        assert client.coordinator_pid not in client.engine_pids
        ids = [f"burst-{i}" for i in range(64)]
        for rid in ids:
            await client.add_request_async(request(rid, max_tokens=4))
        # Stamped on the way out.
        first = request("probe", max_tokens=1)
        await client.add_request_async(first)
        assert first.client_index == client.client_index
        assert first.current_wave == client.current_wave
        done = await collect_finished(client, [*ids, "probe"])
        per_engine = Counter(done[rid].engine_index for rid in ids)
        even = 64 / size
        assert set(per_engine) == set(range(size))
        assert all(abs(n - even) <= 4 for n in per_engine.values()), per_engine
        assert all(done[rid].num_tokens == 4 for rid in ids)
        assert all(f.finish_reason == FinishReason.LENGTH for f in done.values())
        # Bookkeeping is clean once everything finished.
        await wait_until(lambda: not client.reqs_in_flight, what="reqs_in_flight to empty")
        assert client.router.in_flight() == [0] * size
        # The group goes back to paused, one wave later, and every engine agrees.
        await wait_until(lambda: not client.engines_running and client.current_wave >= 1)
        assert len(client.lb_engines) == size
        states = await wait_engine_states(
            client, lambda st: all(not s["engines_running"] for s in st)
        )
        assert [s["engine_index"] for s in states] == list(range(size))
        assert all(s["num_requests"] == 0 for s in states)
        (wave,) = {s["current_wave"] for s in states}  # the engines agree
        # An engine whose requests raced the end of a wave asks for the next one, so the
        # group may be a wave further on than the publication the client last read: the
        # next publication (within the coordinator's period) brings it level.
        await wait_until(lambda: client.current_wave == wave, what=f"client at wave {wave}")
    finally:
        client.shutdown()


async def test_request_anywhere_wakes_the_paused_group() -> None:
    client = DPLBAsyncMPClient(data_parallel_size=2, engine_args={**LIGHT, "step_delay": 0.01})
    try:
        await client.add_request_async(request("warm", max_tokens=1))
        await collect_finished(client, ["warm"])
        # The wave "warm" started has ended (a stale publication may say "paused" early).
        await wait_until(
            lambda: client.current_wave >= 1 and not client.engines_running,
            what="the group to pause",
        )
        wave = client.current_wave
        await wait_engine_states(client, lambda st: not any(s["engines_running"] for s in st))
        # A long request on engine 1 only: engine 0 must wake too (START_DP_WAVE).
        await client.add_request_async(request("long", max_tokens=150, rank=1))

        async def both_running() -> bool:
            states = await engine_states(client)
            return all(s["engines_running"] for s in states)

        deadline = time.monotonic() + 10
        while not await both_running():
            assert time.monotonic() < deadline, "engine 0 did not wake"
            await asyncio.sleep(0.05)
        done = await collect_finished(client, ["long"])
        assert done["long"].engine_index == 1
        await wait_until(lambda: not client.engines_running and client.current_wave > wave)
        await wait_engine_states(client, lambda st: not any(s["engines_running"] for s in st))
    finally:
        client.shutdown()


async def test_aborts_reach_the_engine_holding_the_request() -> None:
    client = DPLBAsyncMPClient(data_parallel_size=2, engine_args={**LIGHT, "step_delay": 0.01})
    try:
        # A request that cannot be sent (here: unencodable) never counts as in flight.
        broken = request("broken")
        broken.prompt_token_ids = [object()]  # type: ignore[list-item]
        with pytest.raises(TypeError, match="cannot encode"):
            await client.add_request_async(broken)
        with pytest.raises(ValueError, match="out of range"):
            await client.add_request_async(request("bad-rank", rank=2))
        assert not client.reqs_in_flight and client.router.in_flight() == [0, 0]
        pinned = {f"on0-{i}": 0 for i in range(3)} | {f"on1-{i}": 1 for i in range(3)}
        for rid, rank in pinned.items():
            await client.add_request_async(request(rid, max_tokens=1000, rank=rank))
        routed = [f"routed-{i}" for i in range(4)]
        for rid in routed:
            await client.add_request_async(request(rid, max_tokens=1000))
        assert {client.reqs_in_flight[rid] for rid in pinned} == {0, 1}
        assert all(client.reqs_in_flight[rid] == rank for rid, rank in pinned.items())
        await wait_until(lambda: client.router.in_flight() == [5, 5], what="routing")
        states = await engine_states(client)
        assert [s["num_requests"] for s in states] == [5, 5]
        # Abort all but one request per engine: each abort must go to the right engine,
        # or the request would keep running there.
        keep = {"on0-0", "on1-0"}
        await client.abort_requests_async([rid for rid in [*pinned, *routed] if rid not in keep])
        await client.abort_requests_async(["never-sent"])  # unknown ids are skipped
        await wait_until(lambda: set(client.reqs_in_flight) == keep, what="aborts to clear")
        states = await engine_states(client)
        assert [s["num_requests"] for s in states] == [1, 1]
        assert client.router.in_flight() == [1, 1]
        await client.abort_requests_async(sorted(keep))
        await wait_until(lambda: not client.reqs_in_flight, what="the last aborts")
        assert [s["num_requests"] for s in await engine_states(client)] == [0, 0]
    finally:
        client.shutdown()


async def test_utility_calls_fan_out_to_every_engine() -> None:
    client = DPLBAsyncMPClient(data_parallel_size=3, engine_args=LIGHT)
    try:
        # The first engine's result comes back, but every engine ran the call.
        assert (await client.call_utility_async("dp_state"))["engine_index"] == 0
        await client.pause_scheduler_async()
        per_engine = await client._call_all_engines("is_scheduler_paused")
        assert per_engine == [True, True, True]
        await client.resume_scheduler_async()
        assert await client.call_utility_consensus_async("is_scheduler_paused") is False
        assert await client.call_utility_consensus_async("echo", [1, "x"]) == [1, "x"]
        with pytest.raises(DPConsensusError, match="dp_state") as info:
            await client.call_utility_consensus_async("dp_state")
        assert [r["engine_index"] for r in info.value.results] == [0, 1, 2]
        with pytest.raises(UtilityError, match="Call to no_such_method method failed"):
            await client.call_utility_async("no_such_method")
        # A cancelled fan-out leaves no registry entry behind.
        call = asyncio.ensure_future(client.call_utility_async("delayed_echo", 1, 30.0))
        await asyncio.sleep(0.1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert len(client.resources.registry) == 0
        await client.check_health_async(timeout=10)
    finally:
        client.shutdown()


async def test_engine_sigkill_under_load_fails_every_waiter() -> None:
    # vLLM's behaviour (tests/dp/test_engine_loss.py has the others).
    client = DPLBAsyncMPClient(
        data_parallel_size=2, engine_args={**LIGHT, "step_delay": 0.01}, engine_loss="fail"
    )
    victim_pid = client.engine_pids[1]
    coordinator_pid = client.coordinator_pid
    try:
        for i in range(16):
            await client.add_request_async(request(f"load-{i}", max_tokens=1000))
        outputs_seen = 0

        async def consume() -> None:
            nonlocal outputs_seen
            while True:
                await client.get_output_async()
                outputs_seen += 1

        consumers = [asyncio.ensure_future(consume()) for _ in range(3)]
        utilities = [
            asyncio.ensure_future(client.call_utility_async("delayed_echo", i, 60.0))
            for i in range(4)
        ]
        await wait_until(lambda: outputs_seen > 5, what="outputs under load")
        os.kill(victim_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*consumers, *utilities, return_exceptions=True), 10
        )
        elapsed = time.monotonic() - killed_at
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert elapsed < 2.0, f"waiters failed only after {elapsed:.2f} s"
        # Later calls fail at once.
        with pytest.raises(EngineDeadError):
            await client.add_request_async(request("late"))
        with pytest.raises(EngineDeadError):
            await client.call_utility_async("echo", 1)
        with pytest.raises(EngineDeadError):
            await client.get_output_async()
    finally:
        start = time.monotonic()
        client.shutdown()
        assert time.monotonic() - start < 5
    # The whole group is gone: the other engine and the coordinator too.
    assert pid_gone(coordinator_pid)


async def test_coordinator_death_kills_the_client() -> None:
    client = DPAsyncMPClient(data_parallel_size=1, engine_args=LIGHT)
    try:
        assert await client.call_utility_async("echo", 7) == 7
        pending = asyncio.ensure_future(client.call_utility_async("delayed_echo", 1, 60.0))
        assert client.coordinator_pid is not None
        # A frozen coordinator never publishes the new size a scaling step waits for:
        # its death must end that wait too, not the step's 30 s timeout.
        os.kill(client.coordinator_pid, signal.SIGSTOP)
        resize = asyncio.ensure_future(client._tell_coordinator_size(2))
        await asyncio.sleep(0.2)
        assert not resize.done()
        os.kill(client.coordinator_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError, match="coordinator"):
            await asyncio.wait_for(pending, 5)
        with pytest.raises(EngineDeadError, match="coordinator"):
            await asyncio.wait_for(resize, 5)
        assert time.monotonic() - killed_at < 2.0
    finally:
        client.shutdown()


class _CountsProbe(DPAsyncMPClient):
    """Records every publication the stats task applies (the whole group's counts)."""

    seen: list[list[list[int]]]

    def _apply_stats(self, counts: list[list[int]], wave: int, running: bool) -> None:
        super()._apply_stats(counts, wave, running)
        self.seen.append(counts)


async def test_stats_task_survives_a_notice_sent_while_a_publication_waits() -> None:
    # ZeroMQ's descriptor is edge-triggered: a send on the stats socket that bypasses
    # pyzmq's asyncio layer can swallow the wake-up of a publication already queued, and
    # the stats task then never wakes again (stale counts, waves, and scaling stuck).
    client = _CountsProbe(data_parallel_size=2, data_parallel_rank=0, engine_args=LIGHT)
    client.seen = []
    sockets = Sockets()
    try:
        client._ensure_stats_update_task()
        await wait_until(lambda: client.seen, what="the first publication")
        assert not client.engines_running
        peer = EnginePeer(sockets, client.coordinator_addresses, 1)  # engine 1 is ours
        peer.report(waiting=5, running=0)
        time.sleep(0.5)  # blocks the loop: the publication arrives meanwhile
        # The group is paused: this sends the first-request notice on the same socket.
        await client.add_request_async(request("r", max_tokens=2))
        await wait_until(lambda: client.seen[-1][1] == [5, 0], timeout=5, what="[5, 0]")
        peer.report(waiting=2, running=0)
        await wait_until(lambda: client.seen[-1][1] == [2, 0], timeout=5, what="[2, 0]")
        await collect_finished(client, ["r"])
    finally:
        sockets.close()
        client.shutdown()


async def test_scale_2_to_3_to_1_under_load_loses_no_request() -> None:
    client = DPLBAsyncMPClient(data_parallel_size=2, engine_args={**LIGHT, "step_delay": 0.005})
    try:
        async with SteadyStream(client, "s", max_tokens=30) as stream:
            done = stream.done
            await wait_until(lambda: len(done) >= 10, timeout=30, what="first completions")
            await client.scale_elastic_ep(3)
            assert len(client.core_engines) == 3 and len(client.engine_pids) == 3
            assert len(client.lb_engines) == 3
            assert [s["data_parallel_size"] for s in await engine_states(client)] == [3, 3, 3]
            await wait_until(
                lambda: any(engine == 2 for _, engine in done.values()),
                timeout=30,
                what="a request served by the new engine",
            )
            # Long requests held by the engines about to go: they must end as ABORT.
            doomed = [f"doomed-{i}" for i in range(4)]
            for i, rid in enumerate(doomed):
                await client.add_request_async(request(rid, max_tokens=100_000, rank=1 + i % 2))
            stream.sent += doomed
            await client.scale_elastic_ep(1)
            assert len(client.core_engines) == 1 and len(client.engine_pids) == 1
            assert len(client.lb_engines) == 1 and client.router.num_engines == 1
            assert [s["data_parallel_size"] for s in await engine_states(client)] == [1]
            await stream.stop_sending()
            await wait_until(
                lambda: set(stream.sent) <= done.keys(), timeout=60, what="every request"
            )
            reasons = Counter(reason for reason, _ in done.values())
            assert set(reasons) <= {FinishReason.LENGTH, FinishReason.ABORT}
            assert reasons[FinishReason.LENGTH] > 0
            assert all(done[rid][0] == FinishReason.ABORT for rid in doomed)
            assert not client.reqs_in_flight
    finally:
        client.shutdown()


async def test_external_lb_front_ends_share_one_coordinator() -> None:
    head = DPAsyncMPClient(data_parallel_size=2, data_parallel_rank=0, engine_args=LIGHT)
    other = None
    try:
        other = DPAsyncMPClient(
            data_parallel_size=2,
            data_parallel_rank=1,
            coordinator_addresses=head.coordinator_addresses,
            engine_args=LIGHT,
        )
        assert other.coordinator_pid is None and len(other.engine_pids) == 1
        # The stats task starts with the first request, not before.
        assert head._stats_task is None
        await head.add_request_async(request("a", max_tokens=3))
        assert head._stats_task is not None
        assert head._stats_task.get_name() == "corewire-dp-stats-task"
        await other.add_request_async(request("b", max_tokens=3))
        assert (await collect_finished(head, ["a"]))["a"].engine_index == 0
        assert (await collect_finished(other, ["b"]))["b"].engine_index == 1
        with pytest.raises(ValueError, match="not an engine of this front-end"):
            await head.add_request_async(request("c", rank=1))
        # Both front-ends follow the same coordinator.
        await wait_until(lambda: head.current_wave >= 1 and other.current_wave >= 1)
        await wait_until(
            lambda: (
                not head.engines_running
                and not other.engines_running
                and head.current_wave == other.current_wave
            ),
            what="both front-ends to see the same paused wave",
        )
    finally:
        if other is not None:
            other.shutdown()
        head.shutdown()


def test_dp_client_on_uvloop() -> None:
    import uvloop

    async def main() -> None:
        client = DPLBAsyncMPClient(data_parallel_size=2, engine_args=LIGHT)
        try:
            assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
            ids = [f"u{i}" for i in range(8)]
            for rid in ids:
                await client.add_request_async(request(rid, max_tokens=2))
            done = await collect_finished(client, ids)
            assert Counter(f.engine_index for f in done.values()) == {0: 4, 1: 4}
            await wait_until(lambda: client.current_wave >= 1 and not client.engines_running)
            assert await client.call_utility_consensus_async("echo", 5) == 5
        finally:
            client.shutdown()

    uvloop.run(asyncio.sleep(0))  # uvloop keeps a process-wide pipe from its first loop on
    uvloop.run(main())


async def test_collected_client_stops_its_engines_and_coordinator() -> None:
    import gc
    import weakref

    client = DPLBAsyncMPClient(data_parallel_size=2, engine_args=LIGHT)
    pids = [*client.engine_pids, client.coordinator_pid]
    await client.add_request_async(request("gc", max_tokens=2))
    await collect_finished(client, ["gc"])  # output and stats tasks are both running
    ref = weakref.ref(client)
    del client
    gc.collect()
    assert ref() is None, "a task or the coordinator kept the client alive"
    await wait_until(
        lambda: all(pid_gone(pid) for pid in pids),
        timeout=15,
        what="engines and coordinator to exit",
    )


async def test_a_failed_scale_up_fails_alone(tmp_path: Path) -> None:
    """A new engine that cannot start fails the scale-up with its start-up error; the
    client keeps serving on the engines it had, and the failed process is gone."""
    flag = tmp_path / "fail"
    client = DPLBAsyncMPClient(
        data_parallel_size=1,
        engine="hook_engine:HookEngine",
        engine_args={**LIGHT, "fail_start_if_exists": str(flag)},
    )
    try:
        flag.touch()
        with pytest.raises(Exception, match="refusing to start"):
            await client.scale_elastic_ep(2)
        assert not client.resources.engine_dead
        assert client.data_parallel_size == 1 and not client.resources.processes.joining
        await asyncio.sleep(0.5)  # a death report would have come by now
        assert not client.resources.engine_dead
        await client.add_request_async(request("after", max_tokens=3))
        done = await collect_finished(client, {"after"})
        assert done["after"] is not None
    finally:
        client.shutdown()
