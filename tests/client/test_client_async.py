"""AsyncMPClient against real engine processes: requests, utility calls, hooks, loops."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import signal
import tempfile
import time
import weakref
from typing import Any

import numpy as np
import pytest
import torch
import uvloop

from client_support import REPLAY, SUPPORT, finished, request
from corewire import AsyncMPClient, EngineDeadError, UtilityError
from corewire.client.async_client import DRAIN_BUDGET
from corewire.engine.replay import run_replay_engine
from corewire.protocol import EngineCoreOutputs
from leak_support import no_leaks, pid_gone


async def collect(client: AsyncMPClient, n_requests: int) -> dict[str, list[int]]:
    """Tokens per request until ``n_requests`` requests finished."""
    tokens: dict[str, list[int]] = {}
    done = 0
    while done < n_requests:
        outputs = await client.get_output_async()
        for out in outputs.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        done += len(finished(outputs))
    return tokens


async def test_streaming_and_utility_round_trips() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            assert len(client.engine_pids) == 1
            for i in range(8):
                await client.add_request_async(request(f"r{i}", max_tokens=5))
            tokens = await collect(client, 8)
            assert tokens == {f"r{i}": [1, 2, 3, 4, 5] for i in range(8)}
            value = {"ids": [2**63 + 5, 2**64 - 1, -1], "text": "héllo", "nested": [[1.5]]}
            assert await client.call_utility_async("echo", value) == value
            await client.check_health_async(timeout=5)
            assert len(client.resources.registry) == 0
        finally:
            client.shutdown()


async def test_utility_failure_carries_the_engine_message() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            with pytest.raises(UtilityError, match="Call to no_such method failed") as info:
                await client.call_utility_async("no_such", 1)
            assert info.value.method == "no_such"
            assert await client.call_utility_async("echo", 3) == 3  # the engine lives on
        finally:
            client.shutdown()


async def test_concurrent_utility_calls_resolve_their_own_futures() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            results = await asyncio.gather(
                *(client.call_utility_async("echo", i) for i in range(2000))
            )
            assert results == list(range(2000))
            assert len(client.resources.registry) == 0
        finally:
            client.shutdown()


async def test_stray_replies_are_ignored() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=SUPPORT)
        try:
            pending = asyncio.ensure_future(client.call_utility_async("block", 0.3))
            await asyncio.sleep(0.05)
            # Replies for calls nobody made (one of them twice) while a real one waits.
            await client.call_utility_async("stray_replies", [12345, 12345, 0, 2**64 - 1])
            assert await pending == 0.3
            assert await client.call_utility_async("echo", "after") == "after"
            assert len(client.resources.registry) == 0
        finally:
            client.shutdown()


async def test_cancelled_call_leaves_no_entry_and_late_reply_is_harmless() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=SUPPORT)
        try:
            task = asyncio.ensure_future(client.call_utility_async("block", 0.3))
            await asyncio.sleep(0.05)
            assert len(client.resources.registry) == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(client.resources.registry) == 0  # removed at once
            # The engine still replies to the cancelled call; nothing breaks.
            assert await client.call_utility_async("echo", 1) == 1
            assert len(client.resources.registry) == 0
        finally:
            client.shutdown()


async def test_abort_finishes_the_request() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY, engine_args={"step_delay": 0.01})
        try:
            await client.add_request_async(request("long", max_tokens=10_000))
            await client.get_output_async()
            await client.abort_requests_async(["long", "unknown"])
            while True:
                outputs = await client.get_output_async()
                aborted = [o for o in outputs.outputs if o.finish_reason is not None]
                if aborted:
                    assert aborted[0].request_id == "long"
                    assert int(aborted[0].finish_reason) == 2  # abort
                    assert outputs.finished_requests == {"long"}
                    break
        finally:
            client.shutdown()


async def test_zero_copy_tensors_stay_alive_until_sent() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=SUPPORT)
        try:
            expected = []
            for i in range(20):
                embeds = torch.full((512, 256), float(i), dtype=torch.float32)  # 512 KiB
                expected.append(float(embeds.double().sum()))
                await client.add_request_async(request(f"e{i}", max_tokens=1, prompt_embeds=embeds))
                del embeds  # only the send tracker keeps the memory alive now
                gc.collect()
            assert await client.call_utility_async("embed_sums") == expected
            await collect(client, 20)
            # Every send reaps finished entries: the tensors do not wait for shutdown.
            # (pyzmq marks a send done from its own thread, a moment after the engine
            # has the bytes.)
            for _ in range(200):
                await client.call_utility_async("echo", None)
                if not len(client.resources.tracker):
                    break
                await asyncio.sleep(0.01)
            assert len(client.resources.tracker) == 0
        finally:
            client.shutdown()


async def test_send_tracker_holds_a_message_until_zeromq_sent_every_frame() -> None:
    # A large aux frame goes out zero-copy; a small last one is copied, so its own
    # tracker is done at once. The message must stay tracked while the engine (stopped)
    # cannot take the large frame.
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        (pid,) = client.engine_pids
        try:
            big = np.ones(8 << 20, dtype=np.uint8)
            small = np.ones(4096, dtype=np.uint8)
            os.kill(pid, signal.SIGSTOP)
            try:
                call = asyncio.ensure_future(client.call_utility_async("sizes", big, small))
                await asyncio.sleep(0.2)  # sent; ZeroMQ holds what the engine cannot take
                client.resources.tracker.reap()
                assert len(client.resources.tracker) == 1
            finally:
                os.kill(pid, signal.SIGCONT)
            with pytest.raises(UtilityError, match="no such method"):
                await asyncio.wait_for(call, 30)
            deadline = time.monotonic() + 30
            while len(client.resources.tracker) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                client.resources.tracker.reap()
            assert len(client.resources.tracker) == 0
        finally:
            client.shutdown()


class HookedClient(AsyncMPClient):
    """Records what the hooks see (an async ``process_engine_outputs``: the output task
    receives itself and awaits it)."""

    def __init__(self, **kwargs: Any) -> None:
        self.seen: list[EngineCoreOutputs] = []
        self.notes: list[Any] = []
        super().__init__(**kwargs)

    async def process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:  # type: ignore[override]
        self.seen.append(outputs)

    async def eep_process_engine_core_notification(self, data: Any) -> None:
        self.notes.append(data)


class SyncHookedClient(HookedClient):
    """The same with a plain ``process_engine_outputs`` (run in the reader callback)."""

    def process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:  # type: ignore[override]
        self.seen.append(outputs)


@pytest.mark.parametrize("cls", [HookedClient, SyncHookedClient])
async def test_hooks_see_every_message_and_only_outputs_or_stats_are_queued(
    cls: type[HookedClient],
) -> None:
    with no_leaks():
        client = cls(engine_main=SUPPORT)
        try:
            await client.call_utility_async("stats", 7)
            stats = await client.get_output_async()
            # The engine's one key, the rest of vLLM's SchedulerStats at its defaults.
            assert stats.scheduler_stats["num_waiting_reqs"] == 7
            assert stats.scheduler_stats["num_running_reqs"] == 0
            await client.add_request_async(request("h", max_tokens=1))
            outputs = await client.get_output_async()
            # The finished_requests-only message reached the hook but not the queue.
            assert [o.request_id for o in outputs.outputs] == ["h"]
            assert [m.finished_requests for m in client.seen[:2]] == [None, {"gone"}]
            assert len(client.seen) == 3
            await client.call_utility_async("notify", "RECONFIGURE", 3)
            deadline = time.monotonic() + 10  # generous: a loaded CI machine
            while not client.notes and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert client.notes == [["RECONFIGURE", 3]]
            assert await client.call_utility_async("echo", "after hooks") == "after hooks"
        finally:
            client.shutdown()


async def test_output_task_drains_without_starving_the_consumer() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            ticks = 0
            stop = False

            async def ticker() -> None:
                nonlocal ticks
                while not stop:
                    ticks += 1
                    await asyncio.sleep(0)

            tick_task = asyncio.ensure_future(ticker())
            count = 5000
            await client.call_utility_async("replay", 4, count)
            largest_backlog = 0
            for _ in range(count):
                largest_backlog = max(largest_backlog, client.outputs_queue.qsize())
                outputs = await client.get_output_async()
                assert len(outputs.outputs) == 4
            stop = True
            await tick_task
            # The task hands over after at most DRAIN_BUDGET messages, so neither the
            # consumer nor an unrelated task waits for the whole burst.
            assert largest_backlog <= DRAIN_BUDGET
            assert ticks >= count // DRAIN_BUDGET
        finally:
            client.shutdown()


def test_lazy_start_outside_a_loop_and_loop_binding() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            assert client.resources.output_task is None

            async def use() -> Any:
                return await client.call_utility_async("echo", "lazy")

            assert asyncio.run(use()) == "lazy"
            assert client.resources.output_task is not None
            with pytest.raises(RuntimeError, match="bound to the event loop"):
                asyncio.run(use())
            with pytest.raises(RuntimeError):
                client._ensure_output_queue_task()  # no running loop
        finally:
            client.shutdown()


def test_uvloop() -> None:
    async def main() -> None:
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
            await client.add_request_async(request("u", max_tokens=3))
            assert await collect(client, 1) == {"u": [1, 2, 3]}
            assert await client.call_utility_async("echo", 5) == 5
            await client.check_health_async(5)
        finally:
            client.shutdown()

    uvloop.run(asyncio.sleep(0))  # uvloop keeps a process-wide pipe from its first loop on
    with no_leaks():
        uvloop.run(main())


async def test_output_task_starts_at_construction_in_a_loop_once() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            task = client.resources.output_task
            assert task is not None and not task.done()
            assert client.resources.loop is asyncio.get_running_loop()
            client._ensure_output_queue_task()
            assert await client.call_utility_async("echo", 1) == 1
            await client.add_request_async(request("once", max_tokens=1))
            assert await collect(client, 1) == {"once": [1]}
            assert client.resources.output_task is task
            names = [t.get_name() for t in asyncio.all_tasks()]
            assert names.count("corewire-output-task") == 1
        finally:
            client.shutdown()


async def test_cancelled_output_task_puts_engine_dead_in_the_queue() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            waiting = asyncio.ensure_future(client.get_output_async())
            await asyncio.sleep(0.05)
            task = client.resources.output_task
            assert task is not None
            task.cancel()
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(waiting, 5)
            with pytest.raises(EngineDeadError):  # and every later caller
                await asyncio.wait_for(client.get_output_async(), 5)
        finally:
            client.shutdown()


class RaisingHookClient(AsyncMPClient):
    """``process_engine_outputs`` raises on the first outputs (an async variant below)."""

    def process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:  # type: ignore[override]
        raise RuntimeError("hook failed (on purpose)")


class AsyncRaisingHookClient(AsyncMPClient):
    async def process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:  # type: ignore[override]
        raise RuntimeError("hook failed (on purpose)")


@pytest.mark.parametrize("cls", [RaisingHookClient, AsyncRaisingHookClient])
async def test_exception_in_the_output_task_reaches_the_consumer_and_callers(
    cls: type[AsyncMPClient],
) -> None:
    with no_leaks():
        client = cls(engine_main=SUPPORT)
        try:
            await client.add_request_async(request("boom", max_tokens=1))
            with pytest.raises(EngineDeadError, match=r"output task failed.*hook failed"):
                await asyncio.wait_for(client.get_output_async(), 10)
            with pytest.raises(EngineDeadError):
                await client.call_utility_async("echo", 1)
        finally:
            client.shutdown()


def test_sigkill_on_uvloop_fails_every_waiter_within_2s() -> None:
    async def main() -> None:
        client = AsyncMPClient(engine_main=SUPPORT, engine_args={"step_delay": 0.001})
        try:
            (pid,) = client.engine_pids
            await client.add_request_async(request("k", max_tokens=10**6))
            await client.get_output_async()
            call = asyncio.ensure_future(client.call_utility_async("block", 30))
            consumer = asyncio.ensure_future(_next_error(client))
            await asyncio.sleep(0.2)
            os.kill(pid, signal.SIGKILL)
            _, pending = await asyncio.wait([call, consumer], timeout=2.0)
            assert not pending
            assert isinstance(call.exception(), EngineDeadError)
            assert isinstance(consumer.result(), EngineDeadError)
        finally:
            start = time.monotonic()
            client.shutdown()
            assert time.monotonic() - start < 5.0

    uvloop.run(asyncio.sleep(0))  # uvloop keeps a process-wide pipe from its first loop on
    with no_leaks():
        uvloop.run(main())


async def _next_error(client: AsyncMPClient) -> BaseException:
    while True:
        try:
            await client.get_output_async()
        except BaseException as exc:
            return exc


async def test_shutdown_is_idempotent_and_later_calls_raise() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        (pid,) = client.engine_pids
        client.shutdown()
        client.shutdown()
        assert client.engine_dead
        assert pid_gone(pid, reaped=True)  # shutdown also collected its exit status
        with pytest.raises(EngineDeadError):
            await client.call_utility_async("echo", 1)
        with pytest.raises(EngineDeadError):
            await client.add_request_async(request("x"))
        with pytest.raises(EngineDeadError):
            await client.get_output_async()
        with pytest.raises(EngineDeadError):
            await client.check_health_async()
        await client.abort_requests_async(["x"])  # no-op once dead, as in vLLM


async def test_no_reference_cycle_client_is_freed_by_refcount() -> None:
    with no_leaks():
        gc.disable()
        try:
            client = AsyncMPClient(engine_main=REPLAY)
            assert await client.call_utility_async("echo", 1) == 1
            task = client.resources.output_task
            ref = weakref.ref(client)
            del client
            assert ref() is None  # no cycle: freed without the collector
            await asyncio.sleep(0)
            assert task is not None and task.done()
        finally:
            gc.enable()


def test_external_engine_via_client_addresses() -> None:
    with no_leaks(), tempfile.TemporaryDirectory(prefix="corewire-test-") as tmp:
        addresses = {
            "input_address": f"ipc://{tmp}/in",
            "output_address": f"ipc://{tmp}/out",
        }
        ctx = multiprocessing.get_context("spawn")
        engine = ctx.Process(
            target=run_replay_engine,
            kwargs={"engine_index": 0, "parent_pid": os.getpid(), **addresses},
            name="external-engine",
        )
        engine.start()
        try:

            async def main() -> None:
                client = AsyncMPClient(client_addresses=addresses, ready_timeout=60)
                try:
                    assert client.engine_pids == []
                    assert await client.call_utility_async("echo", "ext") == "ext"
                    await client.add_request_async(request("x", max_tokens=2))
                    assert await collect(client, 1) == {"x": [1, 2]}
                finally:
                    client.shutdown()

            asyncio.run(main())
            assert engine.is_alive()  # not ours to stop
        finally:
            engine.terminate()
            engine.join(10)
            engine.close()


async def test_reference_engine_by_default() -> None:
    with no_leaks(grace=20), tempfile.TemporaryDirectory(prefix="corewire-test-") as tmp:
        # Traces go only into the engine's profile_dir (vLLM sends a file-name prefix).
        client = AsyncMPClient(engine_args={"profile_dir": tmp})
        try:
            (pid,) = client.engine_pids
            assert await client.call_utility_async("echo", [1, 2]) == [1, 2]
            assert "generate" in await client.get_supported_tasks_async()
            # The utility wrappers of vLLM's client API, against the real engine.
            assert await client.collective_rpc_async("pid") == [pid]
            assert await client.collective_rpc_async("echo", args=("x",)) == ["x"]
            assert await client.reset_prefix_cache_async() is True
            await client.sleep_async(1)
            assert await client.is_sleeping_async() is True
            await client.wake_up_async()
            assert await client.is_sleeping_async() is False
            await client.pause_scheduler_async()
            assert await client.is_scheduler_paused_async() is True
            await client.resume_scheduler_async()
            assert await client.is_scheduler_paused_async() is False
            await client.profile_async(True)
            await client.profile_async(False, "client-trace")
            (trace,) = os.listdir(tmp)
            assert trace.startswith("client-trace-") and trace.endswith(".json")
            assert os.path.getsize(os.path.join(tmp, trace)) > 0
            with pytest.raises(UtilityError, match="Call to add_lora method failed"):
                await client.add_lora_async(None)
            for i in range(3):
                await client.add_request_async(request(f"g{i}", max_tokens=6))
            tokens = await collect(client, 3)
            assert len({tuple(t) for t in tokens.values()}) == 1  # greedy: same prompt
            assert all(len(t) == 6 for t in tokens.values())
            await client.check_health_async(10)
        finally:
            client.shutdown()
