"""Client benchmark: corewire's AsyncMPClient vs a seed-style baseline vs raw pyzmq.

Run: ``python benches/client.py`` (about a minute; ``--quick`` for a short run).

Every variant talks to its own replay engine process (``corewire.engine.replay``, the
same code for all): a real child process speaking the wire protocol that, on the utility
call ``replay(batch, count)``, pushes ``count`` copies of one pre-encoded
``EngineCoreOutputs`` frame of ``batch`` outputs as fast as ZeroMQ takes them. What is
timed is the receiving side, in this process:

- ``corewire``: ``AsyncMPClient`` with its output task and ``get_output_async()``.
- ``baseline``: the seed's code path, written here: an asyncio task doing
  ``await recv_multipart(copy=False)``, the ENGINE_CORE_DEAD check, ``MsgspecDecoder``,
  a dict of utility futures keyed by ``uuid1().int >> 64``, ``asyncio.Queue``.
- ``raw``: ``await recv_multipart(copy=False)`` on a pyzmq asyncio socket and nothing
  else: no decoding, no queue. The ceiling of a plain asyncio receive.
- ``d+t`` (for reference): the client's decoder decoding the same frame and the consumer
  touching it, in a tight loop without any I/O: what every frame costs at least, so
  ``corewire - d+t`` is what the client's receive, dispatch and queue add.

1. Stream throughput at batch 1, 32, 256 and 1024: µs per frame (best of the trials)
   with the consumer touching every output (``request_id``, ``new_token_ids``,
   ``finish_reason``), under the default garbage collector and after ``gc.freeze()``.
   The checksums of what the consumers read are compared: equal, or the run fails.
2. Utility round trips per second (``echo``), sequential and 64 concurrent.

Goals at batch 256: corewire >= 2x the baseline with frozen GC, >= 5x with default GC,
>= 50% of the raw ceiling; utility calls >= 1.5x the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from corewire.client import AsyncMPClient
from corewire.codec import Encoder, MsgspecDecoder
from corewire.engine.replay import replay_frame, run_replay_engine
from corewire.protocol import ENGINE_CORE_DEAD, EngineCoreOutputs, EngineCoreRequestType

REPLAY = "corewire.engine.replay:run_replay_engine"
BATCHES = (1, 32, 256, 1024)
#: Frames per trial: about the same amount of work at every batch size.
FRAMES = {1: 20_000, 32: 5_000, 256: 1_200, 1024: 320}
_UTILITY = EngineCoreRequestType.UTILITY.value


def touch(outputs: Any) -> int:
    """What a front-end reads of every output; returns a checksum."""
    total = 0
    for out in outputs.outputs:
        total += len(out.request_id) + len(out.new_token_ids)
        if out.finish_reason is not None:
            total += 1
    return total


# -- engines started by the benchmark itself (baseline and raw) --------------------------


class _Engine:
    """A replay engine process on a private pair of ipc endpoints, plus bound sockets."""

    def __init__(self) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="corewire-bench-")
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
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_replay_engine,
            kwargs={
                "engine_index": 0,
                "input_address": self.input_address,
                "output_address": self.output_address,
                "parent_pid": os.getpid(),
            },
            name="bench-replay-engine",
            daemon=True,
        )
        self.proc.start()
        self.identity = (0).to_bytes(2, "little")
        ready = zmq.Socket.shadow(self.input.underlying)
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
    """The seed's client code path, with the reference decoder."""

    def __init__(self) -> None:
        self.engine = _Engine()
        self.encoder = Encoder()
        self.decoder = MsgspecDecoder(EngineCoreOutputs)
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
        message = (_UTILITY, *self.encoder.encode((0, call_id, method, args)))
        await self.engine.input.send_multipart((self.engine.identity, *message), copy=False)
        self._ensure_output_queue_task()
        return await future

    def shutdown(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.engine.close()


class RawReceiver:
    """Plain pyzmq asyncio receive: the ceiling of any asyncio client."""

    def __init__(self) -> None:
        self.engine = _Engine()
        self.encoder = Encoder()

    async def replay(self, batch: int, count: int) -> None:
        message = (_UTILITY, *self.encoder.encode((0, 1, "replay", (batch, count))))
        await self.engine.input.send_multipart((self.engine.identity, *message), copy=False)
        await self.engine.output.recv_multipart(copy=False)  # the reply

    def call_utility_blocking(self, call_id: int, *args: Any) -> None:
        """One ``echo`` round trip with blocking pyzmq calls: no asyncio, no decoding."""
        message = self.encoder.encode((0, call_id, "echo", args))
        self._input.send_multipart((self.engine.identity, _UTILITY, *message), copy=False)
        self._output.recv_multipart(copy=False)

    @property
    def _input(self) -> zmq.Socket:
        return zmq.Socket.shadow(self.engine.input.underlying)

    @property
    def _output(self) -> zmq.Socket:
        return zmq.Socket.shadow(self.engine.output.underlying)

    def shutdown(self) -> None:
        self.engine.close()


# -- measurements ----------------------------------------------------------------------


async def stream_trial(variant: Any, batch: int, count: int) -> tuple[float, int]:
    """Seconds to receive and touch ``count`` frames of ``batch`` outputs; checksum.

    The clock starts before the request for frames: a client's output task may receive
    and decode frames ahead of the consumer, and that work must be inside the timing.
    """
    start = time.perf_counter()
    if isinstance(variant, RawReceiver):
        await variant.replay(batch, count)
        recv = variant.engine.output.recv_multipart
        for _ in range(count):
            await recv(copy=False)
        return time.perf_counter() - start, 0
    await variant.call_utility_async("replay", batch, count)
    get = variant.get_output_async
    checksum = 0
    for _ in range(count):
        checksum += touch(await get())
    return time.perf_counter() - start, checksum


def decode_touch_us(decoder: Any, batch: int, count: int, trials: int) -> float:
    """µs per frame to decode one replay frame and touch its outputs, without I/O."""
    frames = [zmq.Frame(replay_frame(batch))]
    decode = decoder.decode
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(count):
            touch(decode(frames))
        best = min(best, time.perf_counter() - start)
    return best / count * 1e6


async def utility_rate(variant: Any, calls: int, concurrency: int) -> float:
    """Utility round trips per second."""
    start = time.perf_counter()
    if isinstance(variant, RawReceiver):
        sock_in, sock_out = variant._input, variant._output
        encode, identity = variant.encoder.encode, variant.engine.identity
        for i in range(calls):
            sock_in.send_multipart((identity, _UTILITY, *encode((0, i, "echo", (i,)))))
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
    gc.unfreeze()
    gc.enable()
    gc.collect()
    if mode == "frozen":
        gc.freeze()


async def run(quick: bool, trials: int) -> int:
    scale = 5 if quick else 1
    variants: dict[str, Any] = {
        "raw": RawReceiver(),
        "baseline": BaselineClient(),
        "corewire": AsyncMPClient(engine_main=REPLAY),
    }
    failures = 0
    try:
        # Warm up every path once (first-use costs: interning, allocator, code paths).
        for variant in variants.values():
            await stream_trial(variant, 32, 200)
        print(
            f"corewire client benchmark  (python {platform.python_version()}, "
            f"decoder {type(variants['corewire'].decoder).__name__}, {trials} trials, best)"
        )
        print()
        print("1. stream: µs per frame received + every output touched (lower is better)")
        header = (
            f"{'gc':<8}{'batch':>6}{'raw':>10}{'baseline':>11}{'corewire':>11}{'d+t':>9}"
            f"{'Mout/s cw':>11}{'vs baseline':>13}{'of raw':>9}"
        )
        print(header)
        print("-" * len(header))
        results: dict[tuple[str, int], dict[str, float]] = {}
        for mode in ("default", "frozen"):
            set_gc(mode)
            for batch in BATCHES:
                count = max(20, FRAMES[batch] // scale)
                best = {name: float("inf") for name in variants}
                sums: dict[str, set[int]] = {name: set() for name in variants}
                for _ in range(trials):
                    for name, variant in variants.items():  # interleaved: same conditions
                        seconds, checksum = await stream_trial(variant, batch, count)
                        best[name] = min(best[name], seconds)
                        sums[name].add(checksum)
                if sums["baseline"] != sums["corewire"] or len(sums["corewire"]) != 1:
                    print(f"!! checksums differ at batch {batch}: {sums}")
                    failures += 1
                us = {name: best[name] / count * 1e6 for name in variants}
                us["d+t"] = decode_touch_us(variants["corewire"].decoder, batch, count, trials)
                results[(mode, batch)] = us
                print(
                    f"{mode:<8}{batch:>6}{us['raw']:>10.2f}{us['baseline']:>11.2f}"
                    f"{us['corewire']:>11.2f}{us['d+t']:>9.2f}{batch / us['corewire']:>11.2f}"
                    f"{us['baseline'] / us['corewire']:>12.2f}x"
                    f"{us['raw'] / us['corewire'] * 100:>8.0f}%"
                )
        set_gc("default")
        print()
        print("2. utility round trips per second (echo; higher is better)")
        print("   raw: blocking pyzmq send + receive, no asyncio, no decoding (sequential only)")
        header = (
            f"{'calls':<16}{'raw':>10}{'baseline':>11}{'corewire':>11}"
            f"{'vs baseline':>13}{'of raw':>9}"
        )
        print(header)
        print("-" * len(header))
        calls = 2_000 // scale
        rates: dict[int, dict[str, float]] = {}
        for concurrency in (1, 64):
            names = (
                ("raw", "baseline", "corewire") if concurrency == 1 else ("baseline", "corewire")
            )
            best = dict.fromkeys(names, 0.0)
            for _ in range(trials * 2):  # short trials, best of many: the machine is noisy
                for name in names:
                    rate = await utility_rate(variants[name], calls, concurrency)
                    best[name] = max(best[name], rate)
            rates[concurrency] = best
            label = "sequential" if concurrency == 1 else f"{concurrency} concurrent"
            raw = f"{best['raw']:>10,.0f}" if "raw" in best else f"{'-':>10}"
            of_raw = f"{best['corewire'] / best['raw'] * 100:>8.0f}%" if "raw" in best else ""
            print(
                f"{label:<16}{raw}{best['baseline']:>11,.0f}{best['corewire']:>11,.0f}"
                f"{best['corewire'] / best['baseline']:>12.2f}x{of_raw}"
            )
        print()
        r256d, r256f = results[("default", 256)], results[("frozen", 256)]
        goals = [
            ("batch 256, frozen GC: >= 2x baseline", r256f["baseline"] / r256f["corewire"], 2.0),
            ("batch 256, default GC: >= 5x baseline", r256d["baseline"] / r256d["corewire"], 5.0),
            ("batch 256, default GC: >= 50% of raw", r256d["raw"] / r256d["corewire"], 0.5),
            ("batch 256, frozen GC: >= 50% of raw", r256f["raw"] / r256f["corewire"], 0.5),
            ("utility sequential: >= 1.5x", rates[1]["corewire"] / rates[1]["baseline"], 1.5),
            ("utility 64 concurrent: >= 1.5x", rates[64]["corewire"] / rates[64]["baseline"], 1.5),
        ]
        print("goals")
        for text, value, goal in goals:
            print(f"  {'met ' if value >= goal else 'MISS'}  {text:<42} {value:6.2f}")
    finally:
        for variant in variants.values():
            variant.shutdown()
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer frames and trials")
    parser.add_argument("--trials", type=int, default=None, help="trials per cell (5; quick 2)")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = parser.parse_args(argv)
    trials = args.trials or (2 if args.quick else 5)
    coro: Callable[[], Awaitable[int]] = lambda: run(args.quick, trials)  # noqa: E731
    if args.uvloop:
        import uvloop

        return uvloop.run(coro())
    return asyncio.run(coro())


if __name__ == "__main__":
    sys.exit(main())
