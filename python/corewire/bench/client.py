"""``corewire bench client``: corewire's AsyncMPClient vs the installed vLLM's AsyncMPClient.

Run: ``corewire bench client`` (a few minutes; ``--quick`` for a short run).

The wire is the installed vLLM's: 0.25.1 or 0.33.0 (``corewire.releases``), 0.25.1
without vLLM; another vLLM release stops the run (exit status 2, naming the supported
ones) rather than measuring a wire corewire would decode wrongly.

Every variant talks to its own fake engine process (the same code for all, defined
here on ``corewire.engine.replay``): a real child process speaking that version's wire,
with that version's full ready response (vLLM's client decodes it strictly;
``corewire.engine.ready_layouts``), that on the utility call ``replay_case(case, batch, count)``
pushes ``count`` copies of one ``EngineCoreOutputs`` frame of ``batch`` outputs, encoded
once in that version's layout (``Encoder(release=...)``), as fast as ZeroMQ takes them.
Frames of case ``top-5`` carry per output a ``LogprobsLists`` of three tiny inline arrays,
as vLLM's scheduler sends them. What is timed is the receiving side, in this process:

- ``vllm``: the installed vLLM's ``AsyncMPClient`` (built with ``client_addresses``, as
  vLLM's API server builds it for engines it does not launch), ``get_output_async()``; the
  baseline the goals are read against (when vLLM is installed; without it the run says so
  and the goals are read against ``baseline``).
- ``corewire``: corewire's ``AsyncMPClient(release=...)`` with its output task and
  ``get_output_async()``.
- ``baseline``: the in-house reference, written here: an asyncio task doing
  ``await recv_multipart(copy=False)``, the ENGINE_CORE_DEAD check, ``MsgspecDecoder``,
  a dict of utility futures keyed by ``uuid1().int >> 64``, ``asyncio.Queue``.
- ``raw``: ``await recv_multipart(copy=False)`` on a pyzmq asyncio socket and nothing
  else: no decoding, no queue. The ceiling of a plain asyncio receive.
- ``d+t`` (for reference): corewire's decoder decoding the same frame and the consumer
  touching it, in a tight loop without any I/O: what every frame costs at least.

1. Stream throughput, plain at batch 1, 32, 256 and 1024 and top-5 logprobs at batch
   256 (``--cases``): µs per frame (best of the trials) with the consumer touching every
   output (``request_id``, ``new_token_ids``, ``finish_reason`` and the logprobs arrays),
   under the default garbage collector and after ``gc.freeze()``. The checksums of what
   the consumers read are compared: equal, or the run fails (exit status 1).
2. Utility round trips per second (``echo``), sequential and 64 concurrent; sequential
   also as a raw blocking pyzmq ping-pong with the same engine, in the same run, and
   (``asyncio``, a reference) as the least an asyncio client does over that engine: the
   same send, then ``add_reader`` on the socket's descriptor and one future per call,
   without decoding. Short trials, every variant once per trial in turn, many trials;
   the goals are read on the medians (the bests are printed too).

Goals at batch 256 against vLLM's client: plain >= 2x with frozen GC and >= 5x with
default GC; top-5 logprobs >= 10x frozen and >= 20x default GC; >= 50% of the raw
ceiling; sequential utility round trips within 10% of the raw ping-pong; 64 concurrent
>= 1.5x vLLM. ``--plot FILE.png`` draws µs per frame and frames/s against batch and the
utility rates; ``--json FILE`` writes the results.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from corewire import releases
from corewire.bench import common
from corewire.bench.vllm_client import VllmClient, private_dir
from corewire.client import AsyncMPClient
from corewire.codec import Encoder, MsgspecDecoder
from corewire.engine.interface import EngineInfo
from corewire.engine.ready_layouts import ready_response_for
from corewire.engine.replay import EngineLink, ReplayEngine, encode_plain_outputs
from corewire.protocol import (
    ENGINE_CORE_DEAD,
    REQUEST_UTILITY,
    FinishReason,
    LogprobsLists,
    UtilityCall,
    UtilityOutput,
    UtilityResult,
    engine_identity,
)
from corewire.wire import layouts

__all__ = ["add_arguments", "run"]

#: Stream cases: (case, batch), in the order they run.
CASES = (("plain", 1), ("plain", 32), ("plain", 256), ("plain", 1024), ("top-5", 256))
GC_MODES = ("default", "frozen")
#: Frames per trial: about the same amount of work in every case.
FRAMES = {1: 20_000, 32: 5_000, 256: 1_200, 1024: 320}
TOP_K = 5


def touch(outputs: Any) -> int:
    """What a front-end reads of every output, logprobs arrays included; a checksum."""
    total = 0
    for out in outputs.outputs:
        total += len(out.request_id) + len(out.new_token_ids)
        if out.finish_reason is not None:
            total += 1
        lp = out.new_logprobs
        if lp is not None:
            total += len(lp.logprob_token_ids) + len(lp.logprobs) + len(lp.sampled_token_ranks)
    return total


# -- the fake engine ---------------------------------------------------------------------


def outputs_message(release: str, engine_index: int, **fields: Any) -> Any:
    """An ``EngineCoreOutputs`` of ``release``'s layout, stamped now; under 0.33.0 steps
    (messages with ``outputs``) carry ``weight_version="default"`` as its engine stamps
    them, utility replies nil."""
    if releases.get(release).weight_versions and "outputs" in fields:
        fields.setdefault("weight_version", "default")
    outputs_type = layouts.types_for(release)["EngineCoreOutputs"]
    return outputs_type(engine_index=engine_index, timestamp=time.monotonic(), **fields)


def case_frame(case: str, batch: int, release: str = releases.DEFAULT) -> bytes:
    """One ``EngineCoreOutputs`` of ``batch`` outputs of one new token each (every eighth
    request finishing), encoded in ``release``'s layout; with ``top-5``, a
    ``LogprobsLists`` per output: ``1 x 6`` int32 ids and float32 logprobs and the int64
    rank, inline as vLLM sends them."""
    output_type = layouts.types_for(release)["EngineCoreOutput"]
    rng = np.random.default_rng(batch)
    outputs = []
    for i in range(batch):
        token = 1000 + i
        lp = None
        if case == "top-5":
            ids = np.array([[token, *rng.integers(0, 150_000, TOP_K)]], np.int32)
            values = -np.sort(rng.random((1, TOP_K + 1)).astype(np.float32) * 10)
            lp = LogprobsLists(ids, values, np.array([rng.integers(1, 20)], np.int64))
        outputs.append(
            output_type(
                request_id=f"cmpl-{i:08x}-0",
                new_token_ids=[token],
                new_logprobs=lp,
                finish_reason=FinishReason.LENGTH if i % 8 == 7 else None,
            )
        )
    message = outputs_message(release, 0, outputs=outputs)
    frames = Encoder(release=release).encode(message)
    assert len(frames) == 1, "the bench frames have no aux frames"
    return bytes(frames[0])


class BenchLink(EngineLink):
    """The replay engine's link speaking ``release``: that version's ready response and
    utility replies in its layout (a 0.33.0 front-end refuses 0.25.1's ready map)."""

    def __init__(self, *args: Any, release: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release = releases.get(release)

    def send_ready(self) -> None:
        """The ready response of :attr:`release` (its required keys all present)."""
        ready = ready_response_for(self.release, EngineInfo(), engine_index=self.engine_index)
        self.requests.send(msgspec.msgpack.encode(ready))

    def reply(self, call_id: int, result: Any = None, failure: str | None = None) -> None:
        """Answer utility call ``call_id`` in :attr:`release`'s layout."""
        utility = UtilityOutput(
            call_id=call_id,
            failure_message=failure,
            result=None if failure is not None else UtilityResult(result),
        )
        outputs = outputs_message(self.release, self.engine_index, utility_output=utility)
        payload = encode_plain_outputs(outputs)
        if payload is None:  # the bench's results are plain: this is a bug, not a case
            raise TypeError(f"utility result of call {call_id} is not plain msgpack")
        self.outputs.send(payload)


class BenchEngine(ReplayEngine):
    """The replay engine with a full ready response and ``replay_case``."""

    def utility_replay_case(self, case: str, batch: int, count: int) -> int:
        """After the reply, push ``count`` frames of ``case`` at ``batch``; returns the
        frame's size in bytes."""
        release = getattr(self.link, "release", releases.DEFAULT)
        return self.push_after_reply(case_frame(case, batch, release), count)


def run_bench_engine(
    *,
    engine_index: int,
    input_address: str,
    output_address: str,
    parent_pid: int | None = None,
    wire: str = releases.DEFAULT,
    **_options: Any,
) -> None:
    """Process target (``engine_main``) running a :class:`BenchEngine` that speaks
    protocol ``wire`` (not ``release``, which corewire's client keeps for itself)."""
    link = BenchLink(engine_index, input_address, output_address, parent_pid, release=wire)
    try:
        BenchEngine(link).serve()
    finally:
        link.close()


def _start_engine(input_address: str, output_address: str, release: str) -> Any:
    proc = multiprocessing.get_context("spawn").Process(
        target=run_bench_engine,
        kwargs={
            "engine_index": 0,
            "input_address": input_address,
            "output_address": output_address,
            "parent_pid": os.getpid(),
            "wire": release,
        },
        name="bench-engine",
        daemon=True,
    )
    proc.start()
    return proc


# -- engines started by the benchmark itself (baseline and raw) --------------------------


class _Engine:
    """A replay engine process on a private pair of ipc endpoints, plus bound sockets."""

    def __init__(self, release: str) -> None:
        self.tmp = private_dir()
        self.input_address = f"ipc://{self.tmp.name}/in"
        self.output_address = f"ipc://{self.tmp.name}/out"
        self.ctx = zmq.asyncio.Context()
        self.input = self.ctx.socket(zmq.ROUTER)
        self.output = self.ctx.socket(zmq.PULL)
        for sock in (self.input, self.output):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self.input.bind(self.input_address)
        self.output.bind(self.output_address)
        self.proc = _start_engine(self.input_address, self.output_address, release)
        self.identity = engine_identity(0)
        ready: zmq.Socket[bytes] = zmq.Socket.shadow(self.input.underlying)
        if not ready.poll(120_000):
            raise TimeoutError("replay engine did not start")
        ready.recv_multipart()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.join(10)
        self.proc.close()
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        self.tmp.cleanup()


class BaselineClient:
    """The seed's client code path, with the reference decoder (``release``'s structs)."""

    def __init__(self, release: str) -> None:
        self.engine = _Engine(release)
        self.encoder = Encoder()
        self.decoder = MsgspecDecoder(layouts.types_for(release)["EngineCoreOutputs"])
        self.utility_results: dict[int, asyncio.Future[Any]] = {}
        self.outputs_queue: asyncio.Queue[Any] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def _ensure_output_queue_task(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._process_outputs_socket())

    async def _process_outputs_socket(self) -> None:
        socket, decoder = self.engine.output, self.decoder
        utility_results, queue = self.utility_results, self.outputs_queue
        try:
            while True:
                frames = await socket.recv_multipart(copy=False)
                if len(frames) == 1 and frames[0].buffer == ENGINE_CORE_DEAD:
                    raise RuntimeError("engine dead")
                outputs = decoder.decode(frames)
                if outputs.utility_output:
                    output = outputs.utility_output
                    future = utility_results.pop(output.call_id)
                    if output.failure_message is not None:
                        future.set_exception(Exception(output.failure_message))
                    else:
                        future.set_result(output.result.result)
                    continue
                if outputs.outputs or outputs.scheduler_stats:
                    queue.put_nowait(outputs)
        except Exception as exc:
            queue.put_nowait(exc)

    async def get_output_async(self) -> Any:
        self._ensure_output_queue_task()
        outputs = await self.outputs_queue.get()
        if isinstance(outputs, Exception):
            raise outputs
        return outputs

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        call_id = uuid.uuid1().int >> 64
        future = asyncio.get_running_loop().create_future()
        self.utility_results[call_id] = future
        message = (REQUEST_UTILITY, *self.encoder.encode(UtilityCall(0, call_id, method, args)))
        await self.engine.input.send_multipart((self.engine.identity, *message), copy=False)
        self._ensure_output_queue_task()
        return await future

    def shutdown(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.engine.close()


class RawReceiver:
    """Plain pyzmq asyncio receive: the ceiling of any asyncio client."""

    def __init__(self, release: str) -> None:
        self.engine = _Engine(release)
        self.encoder = Encoder()

    async def replay(self, case: str, batch: int, count: int) -> None:
        call = UtilityCall(0, 1, "replay_case", (case, batch, count))
        message = (REQUEST_UTILITY, *self.encoder.encode(call))
        await self.engine.input.send_multipart((self.engine.identity, *message), copy=False)
        await self.engine.output.recv_multipart(copy=False)  # the reply

    @property
    def _input(self) -> zmq.Socket:
        return zmq.Socket.shadow(self.engine.input.underlying)

    @property
    def _output(self) -> zmq.Socket:
        return zmq.Socket.shadow(self.engine.output.underlying)

    def shutdown(self) -> None:
        self.engine.close()


# -- measurements ----------------------------------------------------------------------


async def stream_trial(variant: Any, case: str, batch: int, count: int) -> tuple[float, int]:
    """Seconds to receive and touch ``count`` frames of ``case`` at ``batch``; checksum.

    The clock starts before the request for frames: a client's output task may receive
    and decode frames ahead of the consumer, and that work must be inside the timing.
    """
    start = time.perf_counter()
    if isinstance(variant, RawReceiver):
        await variant.replay(case, batch, count)
        recv = variant.engine.output.recv_multipart
        for _ in range(count):
            await recv(copy=False)
        return time.perf_counter() - start, 0
    await variant.call_utility_async("replay_case", case, batch, count)
    get = variant.get_output_async
    checksum = 0
    for _ in range(count):
        checksum += touch(await get())
    return time.perf_counter() - start, checksum


def decode_touch_us(
    decoder: Any, case: str, batch: int, count: int, trials: int, release: str
) -> float:
    """µs per frame to decode one bench frame and touch its outputs, without I/O."""
    frames = [zmq.Frame(case_frame(case, batch, release))]
    decode = decoder.decode
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(count):
            touch(decode(frames))
        best = min(best, time.perf_counter() - start)
    return best / count * 1e6


async def asyncio_floor_rate(raw: RawReceiver, calls: int) -> float:
    """Sequential round trips per second of the least any asyncio client does, over the
    raw ping-pong's engine and sockets: the same send and receive calls, but the wait is
    on the output socket's descriptor in the event loop (``add_reader``; ZeroMQ's
    descriptor is edge-triggered: each readiness receives what ``EVENTS`` shows) and one
    future per call completed by the reader. No decoding, no registry: a reference, not a goal (what
    asyncio's wake-up costs over a blocking receive)."""
    loop = asyncio.get_running_loop()
    sock_in, sock_out = raw._input, raw._output
    encode, identity = raw.encoder.encode, raw.engine.identity
    recv, events = sock_out.recv_multipart, sock_out.get
    # (plain ints: zmq's flag enums make every `&` a Python-level enum operation)
    events_opt, pollin = int(zmq.EVENTS), int(zmq.POLLIN)
    fd = sock_out.getsockopt(zmq.FD)
    waiting: list[asyncio.Future[None]] = []

    def drain() -> None:
        # Reading EVENTS re-arms the edge-triggered descriptor; receive what it shows.
        while events(events_opt) & pollin:
            recv(copy=False)
            if waiting:
                waiting.pop().set_result(None)

    loop.add_reader(fd, drain)
    drain()  # arms the descriptor (the reader's last EVENTS read re-arms it after that)
    try:
        start = time.perf_counter()
        for i in range(calls):
            future = loop.create_future()
            waiting.append(future)
            sock_in.send_multipart(
                (identity, REQUEST_UTILITY, *encode(UtilityCall(0, i, "echo", (i,))))
            )
            await future
        return calls / (time.perf_counter() - start)
    finally:
        loop.remove_reader(fd)


async def utility_rate(variant: Any, calls: int, concurrency: int) -> float:
    """Utility round trips per second."""
    start = time.perf_counter()
    if isinstance(variant, RawReceiver):
        # Blocking pyzmq ping-pong with the same engine: no asyncio, no decoding.
        sock_in, sock_out = variant._input, variant._output
        encode, identity = variant.encoder.encode, variant.engine.identity
        for i in range(calls):
            sock_in.send_multipart(
                (identity, REQUEST_UTILITY, *encode(UtilityCall(0, i, "echo", (i,))))
            )
            sock_out.recv_multipart(copy=False)
        return calls / (time.perf_counter() - start)
    call = variant.call_utility_async
    if concurrency == 1:
        for i in range(calls):
            await call("echo", i)
    else:
        for i in range(0, calls, concurrency):
            await asyncio.gather(*(call("echo", j) for j in range(i, i + concurrency)))
    return calls / (time.perf_counter() - start)


def set_gc(mode: str) -> None:
    """Default collector, or everything alive now frozen (``gc.freeze()``)."""
    gc.unfreeze()
    gc.enable()
    gc.collect()
    if mode == "frozen":
        gc.freeze()


def _ratio(us: dict[str, float], name: str) -> str:
    return f"{us[name] / us['corewire']:>9.2f}x" if name in us else f"{'-':>10}"


async def measure(
    *,
    quick: bool,
    trials: int,
    cases: tuple[tuple[str, int], ...],
    gc_modes: tuple[str, ...],
    calls: int | None,
    use_vllm: bool,
    release: str = releases.DEFAULT,
) -> dict[str, Any]:
    """Runs both parts over engines speaking ``release``, printing as it goes; returns
    what was measured."""
    scale = 5 if quick else 1
    variants: dict[str, Any] = {"raw": RawReceiver(release)}
    if use_vllm:
        try:
            variants["vllm"] = VllmClient(release, start_engine=_start_engine)
        except ImportError as exc:  # pragma: no cover - depends on the environment
            print(f"vLLM's client is not available ({exc}): no vllm column")
    variants["baseline"] = BaselineClient(release)
    variants["corewire"] = AsyncMPClient(
        engine_main=run_bench_engine, release=release, wire=release
    )
    base = "vllm" if "vllm" in variants else "baseline"
    failures = 0
    stream: list[dict[str, Any]] = []
    utility: list[dict[str, Any]] = []
    try:
        # Warm up every path once (first-use costs: interning, allocator, code paths).
        for variant in variants.values():
            await stream_trial(variant, "plain", 32, 200)
            await stream_trial(variant, "top-5", 32, 100)
        print(
            f"corewire client benchmark  ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs,"
            f" python {platform.python_version()}, {trials} trials, best; baseline {base};"
            f" release {release!r})"
        )
        print()
        print("1. stream: µs per frame received + every output touched (lower is better)")
        names: list[str] = [n for n in ("raw", "vllm", "baseline", "corewire") if n in variants]
        header = (
            f"{'gc':<8}{'case':>6}{'batch':>6}"
            + "".join(f"{n:>10}" for n in names)
            + f"{'d+t':>9}{'Mout/s cw':>10}{'vs vllm':>10}{'vs basel.':>10}{'of raw':>8}"
        )
        print(header)
        print("-" * len(header))
        for mode in gc_modes:
            set_gc(mode)
            for case, batch in cases:
                count = max(20, FRAMES[batch] // scale)
                best = dict.fromkeys(names, float("inf"))
                sums: dict[str, set[int]] = {name: set() for name in names}
                for _ in range(trials):
                    for name in names:  # interleaved: same conditions
                        seconds, checksum = await stream_trial(variants[name], case, batch, count)
                        best[name] = min(best[name], seconds)
                        sums[name].add(checksum)
                decoded = [sums[n] for n in names if n != "raw"]
                equal = all(x == decoded[0] for x in decoded) and len(decoded[0]) == 1
                if not equal:
                    print(f"!! checksums differ at {case} batch {batch}: {sums}")
                    failures += 1
                us = {name: best[name] / count * 1e6 for name in names}
                us["d+t"] = decode_touch_us(
                    variants["corewire"].decoder, case, batch, count, trials, release
                )
                stream.append(
                    {
                        "gc": mode,
                        "case": case,
                        "batch": batch,
                        "frames": count,
                        "us_per_frame": us,
                        "frames_per_s": {n: 1e6 / v for n, v in us.items()},
                        "corewire_outputs_per_s": batch / us["corewire"] * 1e6,
                        "ratios": {
                            n: us[n] / us["corewire"] for n in ("vllm", "baseline") if n in us
                        },
                        "of_raw": us["raw"] / us["corewire"],
                        "equal": equal,
                    }
                )
                print(
                    f"{mode:<8}{case:>6}{batch:>6}"
                    + "".join(f"{us[n]:>10.2f}" for n in names)
                    + f"{us['d+t']:>9.2f}{batch / us['corewire']:>10.2f}"
                    f"{_ratio(us, 'vllm')}{_ratio(us, 'baseline')}"
                    f"{us['raw'] / us['corewire'] * 100:>7.0f}%"
                )
        set_gc("default")
        print()
        print("2. utility round trips per second (echo; higher is better)")
        print(
            "   raw: blocking pyzmq ping-pong with the same engine (sequential only); asyncio:"
            " the least an asyncio client does over that engine (add_reader + a future per"
            " call; reference)"
        )
        print(f"   {trials * 2} interleaved trials of each; medians (the goals) and bests")
        calls_names = [n for n in names if n != "raw"]
        header = (
            f"{'calls':<16}{'raw':>10}{'asyncio':>10}"
            + "".join(f"{n:>10}" for n in calls_names)
            + f"{'vs ' + base:>13}{'of raw':>9}"
        )
        print(header)
        print("-" * len(header))
        calls = calls or 2_000 // scale
        for concurrency in (1, 64):
            run_names = (
                ["raw", "asyncio", *calls_names]
                if concurrency == 1 and "raw" in names
                else calls_names
            )
            rates: dict[str, list[float]] = {name: [] for name in run_names}
            # Short trials, interleaved (each trial runs every variant once, in turn), many
            # of them: the machine is noisy. The goal is read on the medians: one lucky
            # trial of either side moves a median far less than a best.
            for _ in range(trials * 2):
                for name in run_names:
                    if name == "asyncio":
                        rate = await asyncio_floor_rate(variants["raw"], calls)
                    else:
                        rate = await utility_rate(variants[name], calls, concurrency)
                    rates[name].append(rate)
            median = {name: statistics.median(r) for name, r in rates.items()}
            best = {name: max(r) for name, r in rates.items()}
            utility.append(
                {
                    "concurrency": concurrency,
                    "calls": calls,
                    "trials": trials * 2,
                    "calls_per_s": median,
                    "calls_per_s_best": best,
                    "calls_per_s_trials": rates,
                    "ratios": {
                        n: median["corewire"] / median[n] for n in calls_names if n != "corewire"
                    },
                    "of_raw": median["corewire"] / median["raw"] if "raw" in median else None,
                    "of_raw_best": best["corewire"] / best["raw"] if "raw" in best else None,
                    "asyncio_of_raw": (
                        median["asyncio"] / median["raw"] if "asyncio" in median else None
                    ),
                }
            )
            label = "sequential" if concurrency == 1 else f"{concurrency} concurrent"
            for kind, row in (("median", median), ("best", best)):
                cells = "".join(
                    f"{row[n]:>10,.0f}" if n in row else f"{'-':>10}"
                    for n in ("raw", "asyncio", *calls_names)
                )
                of_raw = f"{row['corewire'] / row['raw'] * 100:>8.0f}%" if "raw" in row else ""
                print(
                    f"{label + ' ' + kind:<16}{cells}{row['corewire'] / row[base]:>12.2f}x{of_raw}"
                )
        print()
    finally:
        for variant in variants.values():
            variant.shutdown()
    return {
        "base": base,
        "release": release,
        "names": names,
        "stream": stream,
        "utility": utility,
        "failures": failures,
    }


def goals(measured: dict[str, Any]) -> list[common.Goal]:
    """The goals, for the cases that ran (the stream goals are read at batch 256)."""
    base = measured["base"]
    us = {(r["gc"], r["case"], r["batch"]): r["us_per_frame"] for r in measured["stream"]}
    rates = {r["concurrency"]: r["calls_per_s"] for r in measured["utility"]}
    found = []
    for gc_mode, case, target in (
        ("frozen", "plain", 2.0),
        ("default", "plain", 5.0),
        ("frozen", "top-5", 10.0),
        ("default", "top-5", 20.0),
    ):
        row = us.get((gc_mode, case, 256))
        if row is not None:
            name = f"{case} 256, {gc_mode} GC: >= {target:g}x {base}"
            found.append(common.Goal(name, row[base] / row["corewire"], target))
    for gc_mode in ("default", "frozen"):
        row = us.get((gc_mode, "plain", 256))
        if row is not None:
            name = f"plain 256, {gc_mode} GC: >= 50% of raw"
            found.append(common.Goal(name, row["raw"] / row["corewire"], 0.5))
    if 1 in rates:
        found.append(
            common.Goal(
                "utility sequential: >= 90% of raw ping-pong (medians)",
                rates[1]["corewire"] / rates[1]["raw"],
                0.9,
            )
        )
    if 64 in rates:
        found.append(
            common.Goal(
                f"utility 64 concurrent: >= 1.5x {base}",
                rates[64]["corewire"] / rates[64][base],
                1.5,
            )
        )
    return found


def plot(measured: dict[str, Any], path: str) -> None:
    """Per case, µs per frame (top) and frames/s (bottom) against batch, one colour per
    client, solid for the default GC and dashed after ``gc.freeze()``; then the utility
    rates (matplotlib)."""
    plt = common.pyplot()
    labels = {
        "raw": "raw pyzmq receive (ceiling)",
        "vllm": f"vLLM {measured.get('release', releases.DEFAULT)} AsyncMPClient",
        "baseline": "in-house reference client",
        "corewire": "corewire AsyncMPClient",
        "d+t": "corewire decode+touch, no I/O",
    }
    colours = {"raw": "grey", "vllm": "C0", "baseline": "C1", "corewire": "C2", "d+t": "C4"}
    markers = {"raw": ".", "vllm": "o", "baseline": "^", "corewire": "s", "d+t": "x"}
    lines = {"default": "-", "frozen": "--"}
    cases = list(dict.fromkeys(r["case"] for r in measured["stream"]))
    fig, axes = plt.subplots(2, len(cases) + 1, figsize=(5.5 * (len(cases) + 1), 8.5))
    for col, case in enumerate(cases):
        for gc_mode in GC_MODES:
            rows = [r for r in measured["stream"] if r["gc"] == gc_mode and r["case"] == case]
            if not rows:
                continue
            xs = [r["batch"] for r in rows]
            for name in rows[0]["us_per_frame"]:
                for row_index, key in ((0, "us_per_frame"), (1, "frames_per_s")):
                    axes[row_index][col].plot(
                        xs,
                        [r[key][name] for r in rows],
                        lines[gc_mode],
                        color=colours[name],
                        marker=markers[name],
                        # One legend entry per client; the line style says the GC mode.
                        label=labels[name] if gc_mode == GC_MODES[0] else None,
                    )
            for r in rows:
                ratio = r["ratios"].get(measured["base"])
                if ratio is not None:
                    axes[0][col].annotate(
                        f"{ratio:.1f}x",
                        (r["batch"], r["us_per_frame"]["corewire"]),
                        textcoords="offset points",
                        xytext=(0, -13 if gc_mode == "default" else 6),
                        ha="center",
                        fontsize=8,
                    )
        for gc_mode in GC_MODES:
            axes[0][col].plot([], [], lines[gc_mode], color="black", label=f"{gc_mode} GC")
        title = "no logprobs" if case == "plain" else "top-5 logprobs (inline arrays)"
        for row_index, ylabel in (
            (0, "µs per frame, every output touched (lower is better)"),
            (1, "frames/s (higher is better)"),
        ):
            ax = axes[row_index][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("outputs per frame (batch)")
            ax.set_ylabel(ylabel)
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][col].legend(fontsize=7)
    ax = axes[0][-1]
    names = [n for n in measured["names"] if n != "raw"]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        rates = [r["calls_per_s"].get(name, 0.0) for r in measured["utility"]]
        positions = [j + i * width for j in range(len(rates))]
        ax.bar(positions, rates, width, color=colours[name], label=labels[name])
    raw = [r["calls_per_s"].get("raw") for r in measured["utility"]]
    if raw and raw[0]:
        ax.axhline(raw[0], color="grey", linestyle=":", label="raw ping-pong (sequential)")
    floor = measured["utility"][0]["calls_per_s"].get("asyncio") if measured["utility"] else None
    if floor:
        ax.axhline(floor, color="grey", linestyle="--", label="bare asyncio (sequential)")
    ax.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(measured["utility"]))],
        [
            "sequential" if r["concurrency"] == 1 else f"{r['concurrency']} concurrent"
            for r in measured["utility"]
        ],
    )
    ax.set_ylabel("utility calls/s (higher is better)")
    ax.set_title("utility round trips (echo)")
    ax.legend(fontsize=7)
    axes[1][-1].axis("off")
    fig.suptitle(
        f"Engine-core client streams, corewire's ratio to {labels[measured['base']]} annotated"
    )
    common.save_figure(fig, path)


def _cases(text: str) -> tuple[tuple[str, int], ...]:
    """``--cases``: ``case:batch`` pairs."""
    found = []
    for item in text.split(","):
        case, _, batch = item.partition(":")
        if case not in ("plain", "top-5") or not batch.isdigit() or int(batch) not in FRAMES:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected CASE:BATCH with CASE plain or top-5 and BATCH one of "
                f"{', '.join(map(str, FRAMES))}"
            )
        found.append((case, int(batch)))
    return tuple(found)


def _gc_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m for m in text.split(",") if m)
    if not modes or any(m not in GC_MODES for m in modes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a subset of {','.join(GC_MODES)}")
    return modes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``corewire bench client``'s flags."""
    common.add_common_arguments(parser)
    parser.add_argument("--trials", type=int, default=None, help="trials per cell (5; quick 2)")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    parser.add_argument(
        "--cases",
        type=_cases,
        default=CASES,
        help="stream cases as CASE:BATCH pairs (plain:1,plain:32,plain:256,plain:1024,top-5:256)",
    )
    parser.add_argument(
        "--gc", type=_gc_modes, default=GC_MODES, help="GC modes: default,frozen (both)"
    )
    parser.add_argument(
        "--calls", type=int, default=None, help="utility calls per trial (2000; quick 400)"
    )
    parser.add_argument(
        "--flood",
        type=float,
        default=None,
        metavar="SECONDS",
        help="run only the request flood (input backpressure) for SECONDS per client "
        "(corewire.bench.flood)",
    )


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark; exit status 1 if the consumers' checksums differ."""
    if not common.check_plot_possible("corewire bench client", args):
        return 2
    if (args.trials is not None and args.trials < 1) or (
        args.calls is not None and args.calls < 64
    ):
        print("corewire bench client: --trials must be >= 1 and --calls >= 64", file=sys.stderr)
        return 2
    trials = args.trials or (2 if args.quick else 5)
    vllm_version = common.vllm_version()
    if args.flood is not None:
        from corewire.bench.flood import flood_both

        flood_both(args.flood, use_vllm=vllm_version is not None)
        return 0
    try:
        release = common.baseline_release(vllm_version)
    except releases.UnsupportedProtocolError as e:
        print(
            f"corewire bench client: {e}; the baseline must be one of those releases"
            " (its AsyncMPClient is measured on the wire corewire speaks for it)",
            file=sys.stderr,
        )
        return 2
    if vllm_version is None:
        print(
            f"vLLM is not installed: no comparison with vLLM {common.VLLM_VERSION}'s client; "
            f"goals are read against the in-house baseline (pip install "
            f"vllm=={common.VLLM_VERSION})"
        )
    options = {
        "quick": args.quick,
        "trials": trials,
        "cases": [list(c) for c in args.cases],
        "gc": list(args.gc),
        "uvloop": args.uvloop,
    }

    def coro() -> Coroutine[Any, Any, dict[str, Any]]:
        return measure(
            quick=args.quick,
            trials=trials,
            cases=args.cases,
            gc_modes=args.gc,
            calls=args.calls,
            use_vllm=vllm_version is not None,
            release=release,
        )

    if args.uvloop:
        import uvloop

        measured: dict[str, Any] = uvloop.run(coro())
    else:
        measured = asyncio.run(coro())
    found = goals(measured)
    print("goals")
    for goal in found:
        print(f"  {'met ' if goal.met else 'MISS'}  {goal.name:<46} {goal.value:6.2f}")
    if args.json:
        common.write_json(
            args.json,
            "client",
            baseline=measured["base"],
            release=release,
            options=options,
            cases=measured["stream"],
            goals=found,
            utility=measured["utility"],
            units={
                "us_per_frame": "µs per frame received and touched",
                "frames_per_s": "frames per second",
                "calls_per_s": "utility round trips per second, median of the trials",
                "calls_per_s_best": "utility round trips per second, best trial",
                "ratios": "x corewire (above 1: corewire faster)",
                "of_raw": "raw receive time / corewire time",
            },
            equal=not measured["failures"],
        )
        print(f"results written to {args.json}")
    if args.plot:
        plot(measured, args.plot)
        print(f"plot written to {args.plot}")
    return 1 if measured["failures"] else 0
