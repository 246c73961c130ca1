"""Backpressure: a slow consumer bounds the memory of the client and of the engine.

A synthetic engine streams at full speed (hundreds of steps a second here) to a consumer
that sleeps 10 ms per batch. Without backpressure the client decodes and queues every
step the engine makes, and its memory grows with the flood; with it, the client stops
reading its output socket past its ``max_output_backlog``, ZeroMQ's high-water marks
fill, the engine's sends block and its loop pauses stepping. Nothing is lost: every
request's tokens arrive complete and in order once the consumer catches up, and the
health watchdog does not mistake a backpressured engine for a dead one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psutil
import pytest

from client_support import request
from corewire import AsyncMPClient, SyncMPClient
from corewire.protocol import EngineCoreOutputs, EngineCoreRequest, FinishReason
from leak_support import no_leaks

SYNTHETIC = "corewire.engine.synthetic:SyntheticEngine"
#: Requests streaming at once (async test; the sync one, slower per batch, runs twice
#: as many): each engine step is one batch of this many outputs.
REQUESTS = 512
#: The synthetic engine's token sequence (see corewire.engine.synthetic): a prompt-seeded
#: walk through the vocabulary above its special tokens.
VOCAB, FIRST_TOKEN, STRIDE = 4096, 4, 7919
#: Growth allowed over the RSS before the flood (decoded outputs queued on the client;
#: encoded ones queued in ZeroMQ and the engine).
#: With backpressure: about 20 MB and 3 MB here; without, the client passed 130 MB
#: within seconds of the async flood.
CLIENT_BOUND = 64 << 20
ENGINE_BOUND = 64 << 20


def _prompt(i: int) -> list[int]:
    return [5 + i % 97, 7 + i // 97, 11]


def _expected_tokens(prompt: list[int], count: int) -> list[int]:
    span = VOCAB - FIRST_TOKEN
    state = sum(prompt) % span
    tokens = []
    for _ in range(count):
        state = (state * STRIDE + 1) % span
        tokens.append(FIRST_TOKEN + state)
    return tokens


def _requests(max_tokens: int, count: int = REQUESTS) -> list[EngineCoreRequest]:
    return [request(f"flood-{i}", max_tokens, prompt=_prompt(i)) for i in range(count)]


class _PeakRss:
    """Samples the RSS of this process and of the engine every 50 ms, in a thread."""

    def __init__(self, engine_pid: int) -> None:
        self.procs = [psutil.Process(), psutil.Process(engine_pid)]
        self.base = [p.memory_info().rss for p in self.procs]
        self.peak = list(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for i, proc in enumerate(self.procs):
                try:
                    self.peak[i] = max(self.peak[i], proc.memory_info().rss)
                except psutil.NoSuchProcess:
                    return  # the engine is gone: the test is failing already

    def growth(self) -> tuple[int, int]:
        """Growth of the peak over the base of (client, engine), in bytes."""
        return self.peak[0] - self.base[0], self.peak[1] - self.base[1]

    def check(self) -> None:
        """Fail as soon as either side passed its bound (not at the end of the flood:
        an unbounded client slows down as its backlog grows)."""
        client, engine = self.growth()
        assert client < CLIENT_BOUND, f"client grew {client >> 20} MB"
        assert engine < ENGINE_BOUND, f"engine grew {engine >> 20} MB"

    def stop(self) -> tuple[int, int]:
        """Stop sampling; the growth of (client, engine), in bytes."""
        self._stop.set()
        self._thread.join()
        return self.growth()


class _Tally:
    """Checks every request's tokens against the engine's sequence, in order."""

    def __init__(self, max_tokens: int, count: int = REQUESTS) -> None:
        self.max_tokens = max_tokens
        self.count = count
        self.tokens: dict[str, list[int]] = {f"flood-{i}": [] for i in range(count)}
        self.finished: set[str] = set()

    def take(self, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            assert out.request_id not in self.finished, f"{out.request_id}: output after finish"
            self.tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                assert out.finish_reason == FinishReason.LENGTH, out
                self.finished.add(out.request_id)

    def done(self) -> bool:
        return len(self.finished) == self.count

    def check(self) -> None:
        assert self.done()
        for i in range(self.count):
            got = self.tokens[f"flood-{i}"]
            assert got == _expected_tokens(_prompt(i), self.max_tokens), f"flood-{i}"


def _report(label: str, growth: tuple[int, int], seconds: float) -> None:
    print(
        f"{label}: client +{growth[0] / 2**20:.0f} MB, engine +{growth[1] / 2**20:.0f} MB "
        f"in {seconds:.1f} s"
    )


def test_async_flood_with_a_slow_consumer_stays_bounded_and_loses_nothing() -> None:
    max_tokens = 1200  # steps of REQUESTS outputs; ~12 s of consumption at 10 ms a batch
    with no_leaks():
        client = AsyncMPClient(
            engine=SYNTHETIC,
            engine_args={"max_batch": REQUESTS},
            health_check_interval=0.5,
            health_check_timeout=1.0,
        )
        try:

            async def flood(peak: _PeakRss) -> tuple[tuple[int, int], float]:
                tally = _Tally(max_tokens)
                for req in _requests(max_tokens):
                    await client.add_request_async(req)
                tally.take(await client.get_output_async())
                await asyncio.sleep(1.0)  # let the engine run ahead: the backlog fills
                start = time.monotonic()
                # A utility call made while the backlog is full waits behind the outputs
                # before it, and completes.
                echo = asyncio.ensure_future(client.call_utility_async("is_sleeping"))
                while not tally.done():
                    tally.take(await client.get_output_async())
                    await asyncio.sleep(0.01)
                    peak.check()
                elapsed = time.monotonic() - start
                assert await asyncio.wait_for(echo, 5) is False
                tally.check()
                await client.check_health_async(5.0)
                # The engine paused stepping (it did not queue the flood on its side).
                counters = await client.call_utility_async("engine_core_counters")
                assert counters["output_pauses"] > 0, counters
                return peak.stop(), elapsed

            peak = _PeakRss(client.engine_pids[0])
            try:
                growth, elapsed = asyncio.run(flood(peak))
            finally:
                peak.stop()
            _report("async flood", growth, elapsed)
            # The watchdog's checks (every 0.5 s, 1 s timeout) waited behind the backlog
            # and never declared the engine dead.
            assert not client.engine_dead, client.resources.dead_reason
        finally:
            client.shutdown()


def test_sync_flood_with_a_slow_consumer_stays_bounded_and_loses_nothing() -> None:
    max_tokens, count = 700, 2 * REQUESTS
    with no_leaks():
        client: Any = SyncMPClient(engine=SYNTHETIC, engine_args={"max_batch": count})
        try:
            tally = _Tally(max_tokens, count)
            peak = _PeakRss(client.engine_pids[0])
            try:
                for req in _requests(max_tokens, count):
                    client.add_request(req)
                tally.take(client.get_output(timeout=30))
                time.sleep(1.0)
                start = time.monotonic()
                while not tally.done():
                    tally.take(client.get_output(timeout=30))
                    time.sleep(0.01)
                    peak.check()
                elapsed = time.monotonic() - start
            finally:
                peak.stop()
            tally.check()
            client.check_health(5.0)
            _report("sync flood", peak.growth(), elapsed)
        finally:
            client.shutdown()


def test_a_paused_engine_still_takes_aborts_and_utility_calls() -> None:
    """With the client not reading, the engine stops stepping but not listening: an abort
    sent then ends the flood; the utility call sent after it is answered behind the
    outputs already sent, and nothing follows it."""
    max_tokens, count = 2000, 64
    with no_leaks():
        client = AsyncMPClient(
            engine=SYNTHETIC, engine_args={"max_batch": count}, max_output_backlog=2048
        )
        try:

            async def run() -> None:
                tally = _Tally(max_tokens, count)
                for req in _requests(max_tokens, count):
                    await client.add_request_async(req)
                tally.take(await client.get_output_async())
                await asyncio.sleep(1.0)  # the backlog fills; the engine pauses
                assert client.outputs_queue.paused
                await client.abort_requests_async([f"flood-{i}" for i in range(count)])
                counters = asyncio.ensure_future(client.call_utility_async("engine_core_counters"))
                while not counters.done():
                    tally.take(await client.get_output_async())
                    await asyncio.sleep(0.001)
                assert counters.result()["output_pauses"] > 0
                while not client.outputs_queue.empty():  # read before the reply
                    tally.take(await client.get_output_async())
                # Every request stopped where the abort found it (no finish: an abort
                # has no output), each stream a prefix of the engine's sequence; far
                # from max_tokens (the engine ran ahead of the client by its queues
                # only), and nothing comes after the reply.
                for i in range(count):
                    got = tally.tokens[f"flood-{i}"]
                    assert 0 < len(got) < max_tokens // 2
                    assert got == _expected_tokens(_prompt(i), len(got)), f"flood-{i}"
                await asyncio.sleep(0.3)
                assert client.outputs_queue.empty()

            asyncio.run(run())
        finally:
            client.shutdown()


def test_max_output_backlog_is_checked() -> None:
    with pytest.raises(ValueError, match="max_output_backlog"):
        SyncMPClient(engine=SYNTHETIC, max_output_backlog=1)


class _AsyncHookClient(AsyncMPClient):
    """A client with an async ``process_engine_outputs`` hook (the output task then
    receives and awaits in a task instead of the reader callback)."""

    async def process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:  # type: ignore[override]
        await asyncio.sleep(0)


@pytest.mark.parametrize("client_class", [AsyncMPClient, _AsyncHookClient], ids=["plain", "hook"])
def test_the_backlog_stays_under_its_mark(client_class: type[AsyncMPClient]) -> None:
    """Past ``max_output_backlog`` the client reads nothing more: the queue never holds
    more than the mark plus one message, and every token still arrives in order."""
    max_tokens, count, mark = 300, 64, 1024
    with no_leaks():
        client = client_class(
            engine=SYNTHETIC, engine_args={"max_batch": count}, max_output_backlog=mark
        )
        try:

            async def run() -> int:
                tally = _Tally(max_tokens, count)
                for req in _requests(max_tokens, count):
                    await client.add_request_async(req)
                largest = 0
                while not tally.done():
                    largest = max(largest, client.outputs_queue.held)
                    tally.take(await client.get_output_async())
                    await asyncio.sleep(0.002)
                tally.check()
                return largest

            largest = asyncio.run(run())
            assert mark <= largest <= mark + count + 1
            assert client.outputs_queue.pauses > 0
        finally:
            client.shutdown()
