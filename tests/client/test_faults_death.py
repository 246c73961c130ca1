"""Engine death and hangs, injected with real signals on real engine processes.

Checks ``docs/protocol.md`` §7 (ENGINE_CORE_DEAD and stopping) and §7.1 (health checks,
bursts) from the client's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from typing import Any

import pytest

from client_support import REPLAY, SUPPORT, request
from corewire import AsyncMPClient, EngineDeadError, SyncMPClient
from corewire.client import MPClient
from leak_support import no_leaks, wait_pid_gone


async def _consume_until_error(client: AsyncMPClient) -> BaseException:
    while True:
        try:
            await client.get_output_async()
        except BaseException as exc:
            return exc


async def test_sigkill_of_a_busy_engine_fails_every_waiter_within_2s() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=SUPPORT, engine_args={"step_delay": 0.001})
        try:
            (pid,) = client.engine_pids
            for i in range(16):
                await client.add_request_async(request(f"k{i}", max_tokens=10**6))
            await client.get_output_async()  # it is streaming
            # One call holds the engine loop; the others queue up behind it.
            calls = [asyncio.ensure_future(client.call_utility_async("block", 30))]
            calls += [
                asyncio.ensure_future(client.call_utility_async("echo", i)) for i in range(50)
            ]
            consumers = [asyncio.ensure_future(_consume_until_error(client)) for _ in range(3)]
            await asyncio.sleep(0.2)
            assert len(client.resources.registry) == 51

            os.kill(pid, signal.SIGKILL)
            _, pending = await asyncio.wait(calls + consumers, timeout=2.0)
            assert not pending, f"{len(pending)} waiters still pending 2 s after SIGKILL"
            for call in calls:
                assert isinstance(call.exception(), EngineDeadError)
            for consumer in consumers:
                assert isinstance(consumer.result(), EngineDeadError)
            assert "died unexpectedly" in str(calls[0].exception())
            assert len(client.resources.registry) == 0

            # Later calls raise at once, without waiting for anything.
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(client.call_utility_async("echo", 1), 0.5)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(client.get_output_async(), 0.5)
            with pytest.raises(EngineDeadError):
                await client.add_request_async(request("late"))
        finally:
            start = time.monotonic()
            client.shutdown()
            assert time.monotonic() - start < 5.0


def test_death_before_the_first_request_is_not_lost() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)  # no loop: no output task yet
        try:
            (pid,) = client.engine_pids
            os.kill(pid, signal.SIGKILL)
            assert wait_pid_gone(pid, 5)
            deadline = time.monotonic() + 5
            while not client.engine_dead and time.monotonic() < deadline:
                time.sleep(0.01)
            assert client.engine_dead  # the monitor saw it, before any loop ran

            async def first_use() -> None:
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(client.get_output_async(), 2.0)
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(client.call_utility_async("echo", 1), 2.0)

            asyncio.run(first_use())
        finally:
            client.shutdown()


async def test_death_while_a_consumer_waits_before_any_request() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            consumer = asyncio.ensure_future(client.get_output_async())
            await asyncio.sleep(0.05)
            os.kill(client.engine_pids[0], signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(consumer, 2.0)
        finally:
            client.shutdown()


async def test_sigstop_is_reported_by_the_health_check_within_its_timeout() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        (pid,) = client.engine_pids
        try:
            await client.check_health_async(timeout=5)
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(EngineDeadError, match="did not answer a health check"):
                    # The outer bound only catches a check that overruns its own timeout.
                    await asyncio.wait_for(client.check_health_async(timeout=0.5), 1.5)
                assert not client.engine_dead  # a check reports; it does not kill
                assert len(client.resources.registry) == 0
            finally:
                os.kill(pid, signal.SIGCONT)
            await client.check_health_async(timeout=5)  # answers again once continued
            assert await client.call_utility_async("echo", "back") == "back"
        finally:
            client.shutdown()


async def test_watchdog_declares_a_stopped_engine_dead() -> None:
    with no_leaks():
        client = AsyncMPClient(
            engine_main=REPLAY, health_check_interval=0.2, health_check_timeout=0.5
        )
        (pid,) = client.engine_pids
        try:
            assert await client.call_utility_async("echo", 1) == 1
            os.kill(pid, signal.SIGSTOP)
            call = asyncio.ensure_future(client.call_utility_async("echo", 2))
            with pytest.raises(EngineDeadError, match="health check"):
                await asyncio.wait_for(call, 3.0)
            with pytest.raises(EngineDeadError):
                await client.get_output_async()
            assert wait_pid_gone(pid, 5)  # the watchdog killed the hung engine
        finally:
            client.shutdown()


async def test_engine_raising_in_step_sends_engine_core_dead() -> None:
    with no_leaks(grace=15):
        client = AsyncMPClient(engine="client_support:FailingEngine", engine_args={"fail_after": 3})
        try:
            assert await client.call_utility_async("echo", "up") == "up"
            await client.add_request_async(request("f", max_tokens=100))
            tokens = []
            with pytest.raises(EngineDeadError):
                while True:
                    outputs = await asyncio.wait_for(client.get_output_async(), 10)
                    tokens += [t for o in outputs.outputs for t in o.new_token_ids]
            assert tokens == [1, 2, 3]  # every output before the failure arrived
            with pytest.raises(EngineDeadError):
                await client.call_utility_async("echo", 1)
        finally:
            start = time.monotonic()
            client.shutdown()
            assert time.monotonic() - start < 5.0


async def test_engine_core_dead_frame_fails_pending_calls() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=SUPPORT)
        try:
            waiting = asyncio.ensure_future(client.get_output_async())
            await client.call_utility_async("die")
            with pytest.raises(EngineDeadError, match="ENGINE_CORE_DEAD"):
                await asyncio.wait_for(waiting, 2.0)
        finally:
            client.shutdown()


def _dies_during_construction(base: type[MPClient]) -> type[MPClient]:
    """A client class whose engine is SIGKILLed once ready, and whose monitor has marked
    it dead before the subclass's own ``__init__`` wires up the output queue."""

    class DiesDuringConstruction(base):  # type: ignore[misc, valid-type]
        def _wait_for_ready(self, identities: Any, timeout: float) -> Any:
            info = super()._wait_for_ready(identities, timeout)
            (pid,) = self.engine_pids
            os.kill(pid, signal.SIGKILL)
            assert wait_pid_gone(pid, 10)
            resources = self.resources
            start_monitor = resources.start_monitor

            def start_and_wait_for_the_death() -> None:
                start_monitor()
                deadline = time.monotonic() + 10
                while not resources.engine_dead and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert resources.engine_dead

            resources.start_monitor = start_and_wait_for_the_death  # type: ignore[method-assign]
            return info

    return DiesDuringConstruction


def test_death_during_construction_reaches_the_sync_output_queue() -> None:
    with no_leaks():
        client = _dies_during_construction(SyncMPClient)(engine_main=REPLAY)
        try:
            assert isinstance(client, SyncMPClient)
            with pytest.raises(EngineDeadError, match="died unexpectedly"):
                client.get_output(timeout=5)
        finally:
            client.shutdown()


def test_death_during_construction_reaches_the_async_output_queue() -> None:
    with no_leaks():
        client = _dies_during_construction(AsyncMPClient)(engine_main=REPLAY)
        try:
            assert isinstance(client, AsyncMPClient)

            async def first_use() -> None:
                with pytest.raises(EngineDeadError, match="died unexpectedly"):
                    await asyncio.wait_for(client.get_output_async(), 5)

            asyncio.run(first_use())
        finally:
            client.shutdown()


# ---------------------------------------------------------------------- bursts

SYNTHETIC = "corewire.engine.synthetic:SyntheticEngine"
# A burst whose last input the engine reads seconds after it was sent (here: 2-3 s of
# reading on a 2-core machine), against a health timeout well under that (yet long
# enough that a loaded machine's scheduling gaps are no silence).
BURST = 150_000
TIMEOUT = 1.0
HEALTH = {"health_check_interval": 0.2, "health_check_timeout": TIMEOUT}


async def _finish_all(client: AsyncMPClient, count: int) -> int:
    finished = 0
    while finished < count:
        outputs = await client.get_output_async()
        finished += sum(1 for o in outputs.outputs if o.finish_reason is not None)
    return finished


async def test_a_burst_of_requests_is_no_false_kill() -> None:
    """150k requests at once: the health check's reply waits behind all of them, much
    longer than the 1 s timeout, yet the engine keeps sending while it works through
    them, so neither a direct check nor the watchdog declares it dead, and every request
    is answered (docs/protocol.md §7.1)."""
    with no_leaks(grace=15):
        client = AsyncMPClient(engine=SYNTHETIC, **HEALTH)
        try:
            for i in range(BURST):
                await client.add_request_async(request(f"b{i}", max_tokens=2))
            consumer = asyncio.ensure_future(_finish_all(client, BURST))
            await client.check_health_async(TIMEOUT)
            assert await asyncio.wait_for(consumer, 120) == BURST
            assert not client.engine_dead
            await client.check_health_async(TIMEOUT)
        finally:
            client.shutdown()


async def test_an_engine_stopped_in_a_burst_is_still_found_dead() -> None:
    """SIGSTOP while the engine works through a burst: it goes silent, and the watchdog
    declares it dead, kills it and fails the consumer, about a health timeout after its
    last message (bound generous for a loaded machine)."""
    with no_leaks(grace=15):
        client = AsyncMPClient(engine=SYNTHETIC, **HEALTH)
        (pid,) = client.engine_pids
        try:
            for i in range(BURST):
                await client.add_request_async(request(f"s{i}", max_tokens=10**6))
            await client.get_output_async()  # at work
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            error = await asyncio.wait_for(_consume_until_error(client), 30)
            took = time.monotonic() - stopped
            assert isinstance(error, EngineDeadError)
            assert "health check" in str(error)
            assert took < 5.0, f"{took:.1f} s"
            assert wait_pid_gone(pid, 5)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            client.shutdown()


async def test_a_loop_stuck_while_streaming_is_found_dead() -> None:
    """The engine's loop stops returning (a utility that blocks it, as a step that never
    returns would) while requests stream: their outputs stop, and the watchdog declares
    it dead within the timeout of the last one."""
    with no_leaks(grace=15):
        client = AsyncMPClient(engine_main=SUPPORT, engine_args={"step_delay": 0.001}, **HEALTH)
        (pid,) = client.engine_pids
        try:
            for i in range(8):
                await client.add_request_async(request(f"h{i}", max_tokens=10**6))
            await client.get_output_async()
            stuck = asyncio.ensure_future(client.call_utility_async("block", 60))
            error = await asyncio.wait_for(_consume_until_error(client), 30)
            assert isinstance(error, EngineDeadError) and "health check" in str(error)
            with pytest.raises(EngineDeadError):
                await stuck
            assert wait_pid_gone(pid, 5)
        finally:
            client.shutdown()


def test_a_burst_is_no_false_kill_for_the_sync_client_either() -> None:
    """The sync client's check follows the same rule: behind 150k requests, with a
    consumer thread reading, a 1 s check passes; once the engine is SIGSTOPped, one
    fails within about its timeout."""
    with no_leaks(grace=15):
        client = SyncMPClient(engine=SYNTHETIC)
        (pid,) = client.engine_pids
        finished = []

        def consume() -> None:
            while len(finished) < BURST:
                outputs = client.get_output(timeout=60)
                finished.extend(o for o in outputs.outputs if o.finish_reason is not None)

        reader = threading.Thread(target=consume, name="burst-consumer")
        try:
            for i in range(BURST):
                client.add_request(request(f"y{i}", max_tokens=2))
            reader.start()
            client.check_health(TIMEOUT)
            reader.join(120)
            assert len(finished) == BURST
            os.kill(pid, signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(EngineDeadError, match="did not answer a health check"):
                client.check_health(TIMEOUT)
            assert time.monotonic() - started < 4.0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            client.shutdown()
            if reader.is_alive():
                reader.join(10)
