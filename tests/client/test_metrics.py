"""Prometheus metrics of corewire's clients, read from prometheus_client's default registry
while real clients talk to real engine processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from client_support import REPLAY, SUPPORT
from corewire import AsyncMPClient, DPLBAsyncMPClient, ProtocolError, SyncMPClient
from corewire import metrics as corewire_metrics
from corewire.metrics import ENV_SWITCH, enabled
from leak_support import no_leaks

SYNTHETIC = "corewire.engine.synthetic:SyntheticEngine"

prometheus_client = pytest.importorskip("prometheus_client")
pytestmark = pytest.mark.skipif(
    os.environ.get(ENV_SWITCH, "").strip().lower() in {"0", "false", "no", "off"},
    reason=f"{ENV_SWITCH} turns metrics off in this environment",
)

REGISTRY = prometheus_client.REGISTRY
BATCH = 16
FRAMES = 50


def sample(name: str, **labels: str) -> float:
    """The current value of one sample (0 before it exists)."""
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def per_engine(client: AsyncMPClient | SyncMPClient) -> dict[str, str]:
    return {"client": str(client.client_index), "engine": "0"}


def counts(labels: dict[str, str]) -> tuple[float, float, float]:
    """Messages, outputs and decode observations of one client and engine."""
    return (
        sample("corewire_frames_received_total", **labels),
        sample("corewire_outputs_received_total", **labels),
        sample("corewire_decode_seconds_count", **labels),
    )


async def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_switch() -> None:
    """On by default with prometheus_client installed; a value that is neither on nor off
    is refused, not guessed."""
    assert enabled()
    os.environ[ENV_SWITCH] = "maybe"
    try:
        with pytest.raises(ValueError, match=ENV_SWITCH):
            enabled()
        # A client refuses it before any engine process starts.
        with no_leaks(), pytest.raises(ValueError, match=ENV_SWITCH):
            SyncMPClient(engine_main=REPLAY)
    finally:
        del os.environ[ENV_SWITCH]


async def test_async_client_counts_what_it_received() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            labels = per_engine(client)
            gauge = {"client": labels["client"]}
            frames0, outputs0, decoded0 = counts(labels)
            await client.call_utility_async("replay", BATCH, FRAMES)
            # Nothing taken yet: everything received waits in the backlog.
            held = FRAMES * (BATCH + 1)
            await wait_for(lambda: sample("corewire_output_backlog", **gauge) >= held)
            assert sample("corewire_output_backlog", **gauge) == held
            received = 0
            for _ in range(FRAMES):
                received += len((await client.get_output_async()).outputs)
            assert received == FRAMES * BATCH
            assert sample("corewire_output_backlog", **gauge) == 0
            frames, outputs, decoded = counts(labels)
            # The utility reply is a message too (without outputs).
            assert frames - frames0 == FRAMES + 1
            assert outputs - outputs0 == received
            assert decoded - decoded0 == FRAMES + 1
            assert sample("corewire_decode_seconds_sum", **labels) > 0
        finally:
            client.shutdown()
        # A closed client exports nothing more.
        assert sample("corewire_output_backlog", **gauge) == 0


async def test_pending_utility_calls_gauge() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=SUPPORT)
        try:
            gauge = {"client": str(client.client_index)}
            assert sample("corewire_pending_utility_calls", **gauge) == 0
            call = asyncio.ensure_future(client.call_utility_async("block", 0.5))
            await wait_for(lambda: sample("corewire_pending_utility_calls", **gauge) == 1)
            await call
            assert sample("corewire_pending_utility_calls", **gauge) == 0
        finally:
            client.shutdown()


async def test_receiving_makes_no_prometheus_call_until_a_collection() -> None:
    """The receive path counts in plain ints: the Prometheus series stay as they were until
    something collects the registry, which folds the counts in first."""
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            labels = per_engine(client)
            family = corewire_metrics._get_family()
            series = family.frames.labels(labels["client"], labels["engine"])
            frames0, outputs0, _ = counts(labels)  # a collection: folded so far
            before = series._value.get()
            await client.call_utility_async("replay", BATCH, FRAMES)
            for _ in range(FRAMES):
                await client.get_output_async()
            assert series._value.get() == before  # nothing reached the series yet
            frames, outputs, _ = counts(labels)  # this collection folds
            assert (frames - frames0, outputs - outputs0) == (FRAMES + 1, FRAMES * BATCH)
            assert series._value.get() == frames
        finally:
            client.shutdown()


def test_folded_tallies_read_as_observed_histograms() -> None:
    """A tally folded into fresh series exports exactly what a histogram observing each
    decode time and counters incremented per message export, bucket bounds included."""
    prom = prometheus_client
    elapsed_ns = [1, 9_999, 10_000, 10_001, 30_000, 2_999_999, 3_000_000, 99_999_999,
                  100_000_000, 100_000_001, 7_000_000_000]  # fmt: skip
    outputs_per_message = [0, 1, 256, 3, 0, 7, 1, 1, 64, 2, 5]

    def series(registry: object) -> tuple[object, object, object]:
        labels = ("0", "0")
        return (
            prom.Counter("f_total", "", ("client", "engine"), registry=registry).labels(*labels),
            prom.Counter("o_total", "", ("client", "engine"), registry=registry).labels(*labels),
            prom.Histogram(
                "d_seconds", "", ("client", "engine"), registry=registry,
                buckets=corewire_metrics._DECODE_BUCKETS,
            ).labels(*labels),
        )  # fmt: skip

    folded_registry, observed_registry = prom.CollectorRegistry(), prom.CollectorRegistry()
    folded = series(folded_registry)
    frames, outputs, decode = series(observed_registry)
    assert corewire_metrics._histogram_internals(folded[2])
    tally = corewire_metrics._Tally(*folded)
    for i, (ns, n) in enumerate(zip(elapsed_ns, outputs_per_message, strict=True)):
        tally.count(n, ns)
        frames.inc()
        outputs.inc(n)
        decode.observe(ns * 1e-9)
        if i % 4 == 0:
            tally.fold()  # folds in between count only what came since
    tally.fold()

    def exported(registry: object) -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels.get("le", "")): s.value
            for m in registry.collect()  # type: ignore[attr-defined]
            for s in m.samples
            if not s.name.endswith("_created")
        }

    got, expected = exported(folded_registry), exported(observed_registry)
    # two counters; nine bounds and +Inf, count and sum of the histogram
    assert got.keys() == expected.keys() and len(got) == 2 + 10 + 2
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key


def test_a_histogram_without_the_internals_is_counted_message_by_message() -> None:
    """Where a histogram series lacks the internals a fold adds to (another
    prometheus_client), the check says so, and the exact tally counts each message at once."""
    prom = prometheus_client
    registry = prom.CollectorRegistry()
    summary = prom.Summary("s_seconds", "", registry=registry)
    assert not corewire_metrics._histogram_internals(summary)
    frames = prom.Counter("f_total", "", registry=registry)
    outputs = prom.Counter("o_total", "", registry=registry)
    decode = prom.Histogram(
        "d_seconds", "", registry=registry, buckets=corewire_metrics._DECODE_BUCKETS
    )
    tally = corewire_metrics._Exact(frames, outputs, decode)
    tally.count(0, 20_000)
    tally.count(7, 2_000_000)
    value = registry.get_sample_value
    assert (value("f_total"), value("o_total"), value("d_seconds_count")) == (2, 7, 2)
    assert value("d_seconds_bucket", {"le": "3e-05"}) == 1
    assert value("d_seconds_sum") == pytest.approx(0.00202)


def test_sync_client_counts_what_it_received() -> None:
    with no_leaks():
        client = SyncMPClient(engine_main=REPLAY)
        try:
            labels = per_engine(client)
            frames0, outputs0, _ = counts(labels)
            client.call_utility("replay", BATCH, FRAMES)
            received = sum(len(client.get_output(timeout=10).outputs) for _ in range(FRAMES))
            frames, outputs, _ = counts(labels)
            assert frames - frames0 == FRAMES + 1
            assert outputs - outputs0 == received == FRAMES * BATCH
        finally:
            client.shutdown()


async def test_bad_frame_counts_a_protocol_error() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=SUPPORT)
        try:
            labels = {"client": str(client.client_index)}
            before = sample("corewire_protocol_errors_total", **labels)
            assert await client.call_utility_async("garbage", "aux_out_of_range", "sent") == "sent"
            with pytest.raises(ProtocolError):  # it names a request: the consumer hears
                await asyncio.wait_for(client.get_output_async(), 10)
            assert sample("corewire_protocol_errors_total", **labels) == before + 1
            # A frame that names no one is dropped, and counted all the same.
            assert await client.call_utility_async("garbage", "not_msgpack", "sent") == "sent"
            await wait_for(lambda: sample("corewire_protocol_errors_total", **labels) == before + 2)
            assert client.protocol_errors == 2 and client.outputs_queue.empty()
        finally:
            client.shutdown()


async def test_engine_sigkill_counts_a_death() -> None:
    with no_leaks():
        client = AsyncMPClient(engine_main=REPLAY)
        try:
            labels = {"client": str(client.client_index)}
            before = sample("corewire_engine_deaths_total", **labels)
            os.kill(client.engine_pids[0], signal.SIGKILL)
            await wait_for(lambda: client.engine_dead)
            assert sample("corewire_engine_deaths_total", **labels) == before + 1
        finally:
            client.shutdown()
        # Shutting a client down is no death.
        assert sample("corewire_engine_deaths_total", **labels) == before + 1


async def test_a_dp_group_losing_one_engine_counts_it_and_the_engines_serving() -> None:
    with no_leaks():
        client = DPLBAsyncMPClient(data_parallel_size=3, engine=SYNTHETIC, engine_loss="isolate")
        try:
            labels = {"client": str(client.client_index)}
            before = sample("corewire_engine_losses_total", **labels)
            deaths = sample("corewire_engine_deaths_total", **labels)
            os.kill(client.engine_pids[2], signal.SIGKILL)
            await wait_for(lambda: client.lost_engines == [2])
            assert sample("corewire_engine_losses_total", **labels) == before + 1
            assert sample("corewire_engines_serving", **labels) == 2
            # The client lives on: no death of the client is counted.
            assert sample("corewire_engine_deaths_total", **labels) == deaths
        finally:
            client.shutdown()


_OFF_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    if sys.argv[1] == "absent":
        sys.modules["prometheus_client"] = None  # an import of it now fails
    from corewire import AsyncMPClient

    async def main():
        client = AsyncMPClient(engine_main="corewire.engine.replay:run_replay_engine")
        try:
            await client.call_utility_async("replay", 4, 3)
            received = [len((await client.get_output_async()).outputs) for _ in range(3)]
        finally:
            client.shutdown()
        names = []
        if sys.argv[1] == "env":
            from prometheus_client import REGISTRY
            names = [m.name for m in REGISTRY.collect() if m.name.startswith("corewire")]
        print(json.dumps({"received": received, "names": names,
                          "metrics": client.resources.metrics is not None}))

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("off", ["env", "absent"])
def test_switched_off_registers_nothing(off: str) -> None:
    """COREWIRE_METRICS=0, or prometheus_client not installed: a client that works
    registers no metric and binds no hook."""
    env = {**os.environ}
    env.pop(ENV_SWITCH, None)
    if off == "env":
        env[ENV_SWITCH] = "0"
    done = subprocess.run(
        [sys.executable, "-c", _OFF_SCRIPT, off],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"received": [4, 4, 4], "names": [], "metrics": False}


_MULTIPROCESS_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, time
    from prometheus_client import CollectorRegistry, multiprocess
    from corewire import AsyncMPClient

    def samples():
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        found = {}
        for metric in registry.collect():
            for s in metric.samples:
                if s.name.startswith("corewire_") and not s.name.endswith("_bucket"):
                    found[s.name] = found.get(s.name, 0) + s.value
        return found

    async def main():
        client = AsyncMPClient(engine_main="corewire.engine.replay:run_replay_engine")
        try:
            await client.call_utility_async("replay", 4, 3)
            while client.outputs_queue.held < 15:
                await asyncio.sleep(0.01)
            time.sleep(1.5)  # the gauges reach the files once a second
            held = samples()
            for _ in range(3):
                await client.get_output_async()
        finally:
            client.shutdown()
        print(json.dumps(held))

    asyncio.run(main())
    """
)


def test_multiprocess_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Under PROMETHEUS_MULTIPROC_DIR (vLLM with several API servers), the multiprocess
    collector finds every metric, the gauges included, in the files."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    env.pop(ENV_SWITCH, None)
    done = subprocess.run(
        [sys.executable, "-c", _MULTIPROCESS_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["corewire_frames_received_total"] == 4
    assert found["corewire_outputs_received_total"] == 12
    assert found["corewire_decode_seconds_count"] == 4
    assert found["corewire_output_backlog"] == 15
    assert found["corewire_pending_utility_calls"] == 0
    assert found["corewire_engine_deaths_total"] == 0


async def test_vllm_adapter_counts_the_requests_a_bad_frame_ended(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Under vLLM, a bad frame counts once as a protocol error, and the requests it named
    (finished with an error instead of failing the server) count too."""
    pytest.importorskip("vllm")
    import threading

    from corewire.protocol import FinishReason
    from corewire.vllm.adapters.classes import client_classes
    from corewire.vllm.adapters.client import INSTALLED_RELEASE
    from vllm_support import (
        HandEngine,
        hand_output,
        require_vllm_0_25_1,
        vllm_config,
        write_model_dir,
    )

    require_vllm_0_25_1()  # the frames below are in its layout

    config = vllm_config(write_model_dir(tmp_path / "model"))
    addresses = {
        "input_address": f"ipc://{tmp_path}/in",
        "output_address": f"ipc://{tmp_path}/out",
    }
    engine: list[HandEngine] = []
    joiner = threading.Timer(0.3, lambda: engine.append(HandEngine(*addresses.values())))
    joiner.start()
    client = client_classes(INSTALLED_RELEASE)["plain"](
        config, None, False, client_addresses=addresses
    )
    joiner.join()
    hand = engine[0]
    try:
        labels = {"client": str(client.client_index)}
        errors = sample("corewire_protocol_errors_total", **labels)
        ended = sample("corewire_protocol_error_requests_total", **labels)
        hand.push([0, [hand_output("bad", ["x"]), hand_output("also-bad", [1])], None, 1.0])
        hand.push(b"\xc1 not msgpack at all")
        hand.push([0, [hand_output("good", [7], FinishReason.LENGTH)], None, 2.0])
        await asyncio.wait_for(client.get_output_async(), 10)
        await asyncio.wait_for(client.get_output_async(), 10)
        assert sample("corewire_protocol_errors_total", **labels) == errors + 2
        assert sample("corewire_protocol_error_requests_total", **labels) == ended + 2
    finally:
        client.shutdown()
        hand.close()
