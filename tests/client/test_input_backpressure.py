"""Input-side backpressure: the bytes queued toward an engine stay under
``max_input_backlog``; callers wait for room instead, and nothing is dropped.

Real engine processes (the synthetic engine) and real faults: a SIGSTOPped engine reads
nothing, so what the client sends piles up in its ZeroMQ queue until the bound; SIGCONT
drains it, SIGKILL must reach every caller waiting for room at once.
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

from client_support import request
from corewire import (
    AsyncMPClient,
    DPLBAsyncMPClient,
    EngineDeadError,
    InputBacklogTimeout,
    SyncMPClient,
    metrics,
)
from corewire.client.input_backlog import (
    DEFAULT_MAX_INPUT_BACKLOG,
    ENV,
    FROM_ENVIRONMENT,
    resolve_max_input_backlog,
)
from corewire.protocol import EngineCoreOutputs
from dp_support import wait_until
from leak_support import no_leaks

SYNTHETIC = "corewire.engine.synthetic:SyntheticEngine"
#: A small bound, so that a stopped engine fills it with a few hundred requests.
BOUND = 256 << 10
#: Prompt tokens per request: a few KB each on the wire.
PROMPT = [5 + i % 4000 for i in range(1500)]
#: Requests the async flood sends (about 10x the bound).
TOTAL = 1000
#: Seconds to wait for a condition that needs no more than a moment.
SOON = 10.0


def _request(i: int, tag: str = "r", rank: int | None = None) -> Any:
    """Request ``tag-i``: one token after a 1,500-token prompt."""
    return request(f"{tag}-{i}", 1, rank, prompt=PROMPT)


def _stop(client: Any) -> int:
    pid = client.engine_pids[0]
    os.kill(pid, signal.SIGSTOP)
    return pid


def _collect(outputs: EngineCoreOutputs, answered: dict[str, int]) -> None:
    for out in outputs.outputs:
        if out.finish_reason is not None:
            answered[out.request_id] = answered.get(out.request_id, 0) + 1


async def _fill(
    client: AsyncMPClient, count: int = 100_000
) -> tuple[asyncio.Task[None], list[str]]:
    """Send ``count`` requests from a task, and return once it waits for room (the
    engine is stopped): the task, and the ids it sent or is waiting to send (the last)."""
    ids: list[str] = []
    backlog = client._input_backlog(client.core_engine)
    tag = "r"

    async def produce() -> None:
        for i in range(count):
            ids.append(f"{tag}-{i}")
            await client.add_request_async(_request(i, tag))

    task = asyncio.get_running_loop().create_task(produce())
    deadline = time.monotonic() + SOON
    while not backlog.waiters:
        assert not task.done(), task
        assert time.monotonic() < deadline, "the producer never waited for room"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # ZeroMQ's I/O thread fills the socket buffer meanwhile
    return task, ids


def test_async_client_waits_at_the_bound_and_resumes_as_the_engine_drains() -> None:
    with no_leaks():
        client = AsyncMPClient(engine=SYNTHETIC, max_input_backlog=BOUND)
        pid = client.engine_pids[0]
        try:

            async def run() -> None:
                backlog = client._input_backlog(client.core_engine)
                _stop(client)
                try:
                    task, ids = await _fill(client, TOTAL)
                    before = len(ids)
                    await asyncio.sleep(0.5)
                    # It stays waiting (a marker completing late under load may let one
                    # more message out, no more): the bound holds.
                    assert not task.done() and len(ids) - before < 10 and len(ids) < TOTAL
                    # At the bound, not past it by more than one message and the count's
                    # slack (a marker may complete late under load: then a little below).
                    assert BOUND // 2 < backlog.held < BOUND + BOUND // 16 + 8192, backlog.held
                    if metrics.enabled():  # the gauge reads it too, from another thread
                        from prometheus_client import REGISTRY

                        gauge = await asyncio.to_thread(
                            REGISTRY.get_sample_value,
                            "corewire_input_backlog_bytes",
                            {"client": "0"},
                        )
                        assert BOUND // 2 < gauge < BOUND + BOUND // 16 + 8192, gauge
                finally:
                    os.kill(pid, signal.SIGCONT)
                # The engine drains: the producer sends the rest (~10x the bound), and
                # every request is answered, once.
                answered: dict[str, int] = {}
                while len(answered) < TOTAL:
                    _collect(await asyncio.wait_for(client.get_output_async(), SOON), answered)
                await asyncio.wait_for(task, SOON)
                assert len(ids) == TOTAL and set(answered) == set(ids)
                assert all(n == 1 for n in answered.values())
                assert backlog.pauses > 0 and not backlog.waiters

            asyncio.run(run())
        finally:
            client.shutdown()


def test_sync_client_times_out_with_a_typed_error_and_sends_nothing_of_it() -> None:
    with no_leaks():
        client: Any = SyncMPClient(
            engine=SYNTHETIC, max_input_backlog=BOUND, add_request_timeout=0.5
        )
        pid = client.engine_pids[0]
        try:
            _stop(client)
            try:
                sent = []
                for i in range(5000):
                    try:
                        client.add_request(_request(i))
                    except InputBacklogTimeout as exc:
                        failed, error = f"r-{i}", exc
                        break
                    sent.append(f"r-{i}")
                else:
                    pytest.fail("add_request never blocked on a stopped engine")
                assert isinstance(error, TimeoutError) and error.engine_index == 0
                assert "max_input_backlog" in str(error)
                # A per-call timeout overrides the client's.
                start = time.monotonic()
                with pytest.raises(InputBacklogTimeout):
                    client.add_request(_request(0, "again"), timeout=0.2)
                assert time.monotonic() - start >= 0.2
            finally:
                os.kill(pid, signal.SIGCONT)
            # The refused request went nowhere: the engine answers exactly what was sent,
            # and the stream is intact (a retry of the refused one is answered once).
            client.add_request(_request(int(failed.split("-")[1])), timeout=SOON)
            answered: dict[str, int] = {}
            while len(answered) < len(sent) + 1:
                _collect(client.get_output(timeout=SOON), answered)
            assert set(answered) == {*sent, failed}
            assert all(n == 1 for n in answered.values())
            assert "again-0" not in answered
        finally:
            client.shutdown()


@pytest.mark.parametrize("ending", ["kill", "shutdown"])
def test_engine_killed_or_client_shut_down_while_callers_wait_fails_them_all(ending: str) -> None:
    with no_leaks():
        client = AsyncMPClient(engine=SYNTHETIC, max_input_backlog=BOUND)
        try:

            async def run() -> tuple[int, float]:
                pid = _stop(client)
                producer, _ = await _fill(client)
                waiters = [
                    asyncio.ensure_future(client.add_request_async(_request(i, "w")))
                    for i in range(50)
                ]
                await asyncio.sleep(0.2)
                backlog = client._input_backlog(client.core_engine)
                waiting = [t for t in (producer, *waiters) if not t.done()]
                assert len(waiting) >= 40 and len(backlog.waiters) == len(waiting)
                start = time.monotonic()
                if ending == "kill":
                    os.kill(pid, signal.SIGKILL)
                else:
                    client.shutdown(timeout=0.5)  # from the loop's own thread
                done, pending = await asyncio.wait(waiting, timeout=SOON)
                elapsed = time.monotonic() - start
                assert not pending, f"{len(pending)} callers still wait after {ending}"
                # Each caller failed with EngineDeadError, or (a few, under load: ZeroMQ
                # may still have written into the socket buffer) sent before the end.
                outcomes = [task.exception() for task in done]
                failed = [exc for exc in outcomes if exc is not None]
                assert all(isinstance(exc, EngineDeadError) for exc in failed), failed
                assert len(failed) >= 40, outcomes
                # Later callers fail at once too.
                with pytest.raises(EngineDeadError):
                    await client.add_request_async(_request(0, "late"))
                return len(waiting), elapsed

            count, elapsed = asyncio.run(run())
            print(f"{count} waiting callers failed {elapsed * 1000:.0f} ms after {ending}")
        finally:
            client.shutdown()


def test_a_blocked_sync_caller_gets_engine_dead_on_kill_and_on_shutdown() -> None:
    for ending in ("kill", "shutdown"):
        with no_leaks():
            client: Any = SyncMPClient(
                engine=SYNTHETIC, max_input_backlog=BOUND, add_request_timeout=None
            )
            try:
                pid = _stop(client)
                outcome: list[BaseException] = []

                def flood(client: Any = client, outcome: list[BaseException] = outcome) -> None:
                    try:
                        for i in range(100_000):
                            client.add_request(_request(i))
                    except BaseException as exc:
                        outcome.append(exc)

                thread = threading.Thread(target=flood, daemon=True)
                thread.start()
                backlog = client._input_backlog(client.core_engine)
                deadline = time.monotonic() + SOON
                while not backlog.pauses:
                    assert time.monotonic() < deadline and thread.is_alive()
                    time.sleep(0.01)
                time.sleep(0.2)
                assert thread.is_alive()  # blocked, no timeout
                if ending == "kill":
                    os.kill(pid, signal.SIGKILL)
                else:
                    client.shutdown(timeout=0.5)  # the engine is still stopped
                thread.join(SOON)
                assert not thread.is_alive(), f"{ending}: the blocked caller still waits"
                assert len(outcome) == 1 and isinstance(outcome[0], EngineDeadError), outcome
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                client.shutdown()


def test_a_cancelled_waiter_sends_nothing_and_leaves_nothing_behind() -> None:
    with no_leaks():
        client = AsyncMPClient(engine=SYNTHETIC, max_input_backlog=BOUND)
        pid = client.engine_pids[0]
        try:

            async def run() -> None:
                backlog = client._input_backlog(client.core_engine)
                _stop(client)
                try:
                    producer, ids = await _fill(client)
                    producer.cancel()  # a waiter cancelled at the front of the line
                    with contextlib.suppress(asyncio.CancelledError):
                        await producer
                    waiters = [
                        asyncio.ensure_future(client.add_request_async(_request(i, "w")))
                        for i in range(20)
                    ]
                    await asyncio.sleep(0.1)
                    # Most wait (a few may find room the engine's socket buffer made
                    # after the producer stopped: ZeroMQ still wrote into it).
                    waiting = [i for i, task in enumerate(waiters) if not task.done()]
                    assert len(waiting) >= 10 and len(backlog.waiters) == len(waiting)
                    cancelled = waiting[::2]
                    for i in cancelled:
                        waiters[i].cancel()
                    await asyncio.sleep(0)
                    assert len(backlog.waiters) == len(waiting) - len(cancelled)
                finally:
                    os.kill(pid, signal.SIGCONT)
                kept = [i for i in range(20) if i not in cancelled]
                await asyncio.wait_for(asyncio.gather(*(waiters[i] for i in kept)), SOON)
                for i in cancelled:
                    assert waiters[i].cancelled()
                assert not backlog.waiters
                expected = {*ids[:-1], *(f"w-{i}" for i in kept)}
                answered: dict[str, int] = {}
                while len(answered) < len(expected):
                    _collect(await asyncio.wait_for(client.get_output_async(), SOON), answered)
                await asyncio.sleep(0.3)  # anything else the engine got would show now
                while not client.outputs_queue.empty():
                    _collect(await client.get_output_async(), answered)
                assert set(answered) == expected
                # The line moves on: a new caller is not stuck behind a cancelled one.
                await asyncio.wait_for(client.add_request_async(_request(0, "next")), SOON)

            asyncio.run(run())
        finally:
            client.shutdown()


def test_the_bound_is_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert resolve_max_input_backlog(FROM_ENVIRONMENT) == DEFAULT_MAX_INPUT_BACKLOG
    monkeypatch.setenv(ENV, str(1 << 20))
    assert resolve_max_input_backlog(FROM_ENVIRONMENT) == 1 << 20
    monkeypatch.setenv(ENV, "none")
    assert resolve_max_input_backlog(FROM_ENVIRONMENT) is None
    # An explicit argument wins over the environment.
    assert resolve_max_input_backlog(8192) == 8192
    for bad in ("lots", "-1", "100"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            resolve_max_input_backlog(FROM_ENVIRONMENT)
    monkeypatch.delenv(ENV)
    # A bad argument fails before any engine starts.
    for bad in (0, 100, 1.5, True):
        with pytest.raises(ValueError, match="max_input_backlog"):
            AsyncMPClient(engine=SYNTHETIC, max_input_backlog=bad)
    # The environment reaches a client built without the argument; None is unbounded.
    monkeypatch.setenv(ENV, str(BOUND))
    client = SyncMPClient(engine=SYNTHETIC)
    try:
        assert client.max_input_backlog == BOUND
    finally:
        client.shutdown()
    client = SyncMPClient(engine=SYNTHETIC, max_input_backlog=None)
    try:
        assert client.max_input_backlog is None
        pid = _stop(client)
        try:
            for i in range(1000):  # ~4 MB into a stopped engine: never waits
                client.add_request(_request(i), timeout=0.01)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert client._input_backlog(client.core_engine).pauses == 0
    finally:
        client.shutdown()


def test_dp_bound_is_per_engine_and_a_cancelled_waiter_is_unrouted() -> None:
    client = DPLBAsyncMPClient(data_parallel_size=2, engine=SYNTHETIC, max_input_backlog=BOUND)
    pid = client.engine_pids[0]
    try:

        async def run() -> None:
            stuck = client._input_backlog(client.core_engines[0])
            os.kill(pid, signal.SIGSTOP)
            try:
                ids: list[str] = []

                async def produce() -> None:
                    for i in range(100_000):
                        ids.append(f"on0-{i}")
                        await client.add_request_async(request(ids[-1], 1, 0, prompt=PROMPT))

                producer = asyncio.get_running_loop().create_task(produce())
                deadline = time.monotonic() + SOON
                while not stuck.waiters:
                    assert time.monotonic() < deadline and not producer.done()
                    await asyncio.sleep(0.01)
                # Engine 1 is not held back by engine 0's full backlog: pinned and routed
                # requests go at once (the router sends the unpinned one to engine 1).
                await asyncio.wait_for(client.add_request_async(_request(0, "on1", 1)), 2)
                await asyncio.wait_for(client.add_request_async(request("any", 1)), 2)
                answered: dict[str, int] = {}
                while len(answered) < 2:  # engine 0 is stopped: engine 1 answers both
                    _collect(await asyncio.wait_for(client.get_output_async(), SOON), answered)
                assert set(answered) == {"on1-0", "any"}
                # The waiting caller gives up: its request is not in flight anywhere.
                producer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await producer
                assert ids[-1] not in client.reqs_in_flight and not stuck.waiters
                assert client.router.in_flight()[0] == len(ids) - 1
            finally:
                os.kill(pid, signal.SIGCONT)
            expected = {*ids[:-1], "on1-0", "any"}
            while len(answered) < len(expected):
                _collect(await asyncio.wait_for(client.get_output_async(), SOON), answered)
            assert set(answered) == expected
            await wait_until(lambda: not client.reqs_in_flight, what="in-flight to clear")
            assert client.router.in_flight() == [0, 0]

        asyncio.run(run())
    finally:
        client.shutdown()


def test_the_engine_decodes_at_most_a_bounded_queue_ahead_of_its_loop() -> None:
    """Engine side: while the busy loop sleeps in a step, its input thread stops at
    INPUT_QUEUE_HIGH decoded requests (the rest waits in ZeroMQ, where the client's
    backlog counts it) instead of queueing the whole burst; every request is answered."""
    from corewire.engine.core_input import INPUT_QUEUE_HIGH

    burst = 3 * INPUT_QUEUE_HIGH
    with no_leaks():
        client = SyncMPClient(
            engine=SYNTHETIC, engine_args={"max_batch": 2 * burst, "step_delay": 0.5}
        )
        try:
            client.add_request(_request(0, "first"))
            client.get_output(timeout=30)  # the loop steps: each step now sleeps 0.5 s
            for i in range(burst):
                client.add_request(_request(i, "burst"))
            answered: dict[str, int] = {}
            while sum(key.startswith("burst-") for key in answered) < burst:
                _collect(client.get_output(timeout=30), answered)
            counters = client.call_utility("engine_core_counters")
            assert counters["input_pauses"] > 0, counters
        finally:
            client.shutdown()
