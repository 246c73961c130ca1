"""Helpers for the data-parallel tests: raw peers of the coordinator, waits, free ports."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import msgspec
import zmq

from corewire.coordinator import CoordinatorAddresses
from corewire.dp_messages import XPUB_SUBSCRIBE
from corewire.keygen import CurveClientKeys, apply_client
from corewire.protocol import FinishReason

T = TypeVar("T")


def coordinator_addresses(ipc_dir: Path, tag: str = "coord") -> CoordinatorAddresses:
    """Fresh ipc:// addresses for a coordinator inside the test's private directory."""
    return CoordinatorAddresses(
        front_publish=f"ipc://{ipc_dir}/{tag}-front",
        engine_stats=f"ipc://{ipc_dir}/{tag}-stats",
        engine_publish=f"ipc://{ipc_dir}/{tag}-wave",
    )


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition") -> T:
    """Polls ``predicate`` until it returns something truthy; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class Sockets:
    """A zmq context whose sockets are all closed by :meth:`close` (no unclosed warnings)."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self._sockets: list[zmq.Socket[Any]] = []

    def socket(self, kind: int) -> zmq.Socket[Any]:
        """A new socket with linger 0, closed with the others."""
        sock = self.ctx.socket(kind)
        sock.linger = 0
        self._sockets.append(sock)
        return sock

    def close(self) -> None:
        """Closes every socket and terminates the context."""
        for sock in self._sockets:
            sock.close(linger=0)
        self.ctx.term()


class FrontEndPeer:
    """A raw front-end side of the coordinator: XSUB, subscribed, decodes each publication."""

    def __init__(self, sockets: Sockets, addresses: CoordinatorAddresses) -> None:
        self.sock = sockets.socket(zmq.XSUB)
        self.sock.connect(addresses.front_publish)
        self.sock.send(XPUB_SUBSCRIBE)

    def recv(self, timeout: float = 5.0) -> list[Any]:
        """The next ``[counts, current_wave, engines_running]``."""
        if not self.sock.poll(timeout * 1000):
            raise AssertionError(f"no coordinator publication within {timeout} s")
        return msgspec.msgpack.decode(self.sock.recv())

    def recv_until(self, predicate: Callable[[list[Any]], bool], timeout: float = 5.0) -> list[Any]:
        """Publications until one satisfies ``predicate``."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.01, deadline - time.monotonic()))
            if predicate(msg):
                return msg

    def notice(self, engine_index: int, wave: int) -> None:
        """The first-request notice: a request went to ``engine_index`` while paused."""
        self.sock.send(msgspec.msgpack.encode([engine_index, wave]))

    def send_raw(self, payload: bytes) -> None:
        """Anything, to test that bad messages are ignored."""
        self.sock.send(payload)


class EnginePeer:
    """A raw engine side of the coordinator: PUSH for stats, SUB for wave messages."""

    def __init__(
        self,
        sockets: Sockets,
        addresses: CoordinatorAddresses,
        index: int,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self.index = index
        self.push = sockets.socket(zmq.PUSH)
        self.sub = sockets.socket(zmq.SUB)
        if curve is not None:
            apply_client(self.push, curve)
            apply_client(self.sub, curve)
        self.push.connect(addresses.engine_stats)
        self.sub.subscribe(b"")
        self.sub.connect(addresses.engine_publish)

    def report(
        self,
        waiting: int = 0,
        running: int = 0,
        wave: int = 0,
        *,
        start_wave: int | None = None,
        wave_complete: int | None = None,
        stats: bool = True,
    ) -> None:
        """Sends EngineCoreOutputs (full positional layout) with stats and wave fields."""
        sched = (
            {"num_waiting_reqs": waiting, "num_running_reqs": running, "current_wave": wave}
            if stats
            else None
        )
        outputs = [self.index, [], sched, time.monotonic(), None, None, wave_complete, start_wave]
        self.push.send(msgspec.msgpack.encode(outputs))

    def recv(self, timeout: float = 5.0) -> tuple[bytes, list[int]]:
        """The next wave message as ``(type_byte, payload)``."""
        if not self.sub.poll(timeout * 1000):
            raise AssertionError(f"engine {self.index}: no wave message within {timeout} s")
        type_byte, payload = self.sub.recv_multipart()
        return type_byte, msgspec.msgpack.decode(payload)

    def recv_until(self, expected: tuple[bytes, list[int]], timeout: float = 5.0) -> None:
        """Wave messages until ``expected`` arrives (late-subscriber state may come first)."""
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            try:
                msg = self.recv(max(0.01, deadline - time.monotonic()))
            except AssertionError:
                break
            if msg == expected:
                return
            seen.append(msg)
        raise AssertionError(f"engine {self.index}: expected {expected}, got {seen}")

    def drain(self, quiet: float = 0.2) -> list[tuple[bytes, list[int]]]:
        """Every wave message until none arrives for ``quiet`` seconds."""
        out = []
        while self.sub.poll(quiet * 1000):
            type_byte, payload = self.sub.recv_multipart()
            out.append((type_byte, msgspec.msgpack.decode(payload)))
        return out


#: Engine args that keep each reference engine light on a shared 2-core machine.
LIGHT: dict[str, Any] = {"num_threads": 1, "device": "cpu"}


class Finished(NamedTuple):
    """How one request ended, as the client saw it."""

    finish_reason: FinishReason
    engine_index: int
    num_tokens: int


async def collect_finished(
    client: Any, request_ids: Collection[str], timeout: float = 60.0
) -> dict[str, Finished]:
    """Reads outputs until every id in ``request_ids`` finished; returns how each did."""
    wanted = set(request_ids)
    tokens: dict[str, int] = {}
    done: dict[str, Finished] = {}

    async def run() -> None:
        while not wanted <= done.keys():
            outputs = await client.get_output_async()
            for out in outputs.outputs:
                tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
                if out.finish_reason is not None:
                    done[out.request_id] = Finished(
                        out.finish_reason, outputs.engine_index, tokens[out.request_id]
                    )

    await asyncio.wait_for(run(), timeout)
    return done


class SteadyStream:
    """Requests sent through a DP client at a steady pace while a test reshapes the
    group (``async with``): one every 10 ms of ``max_tokens`` tokens, ids
    ``PREFIX-N``; :attr:`done` maps each finished id to ``(finish_reason,
    engine_index)`` (a second finish of one id fails the consumer)."""

    def __init__(self, client: Any, prefix: str, max_tokens: int) -> None:
        self.client = client
        self.prefix = prefix
        self.max_tokens = max_tokens
        #: Ids sent so far (a test adds the ones it sends itself).
        self.sent: list[str] = []
        #: Id -> (finish reason, engine index), as the client saw them end.
        self.done: dict[str, tuple[FinishReason, int]] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Future[None]] = []

    async def __aenter__(self) -> SteadyStream:
        self._producer = asyncio.ensure_future(self._produce())
        self._tasks = [self._producer, asyncio.ensure_future(self._consume())]
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop_sending(self) -> None:
        """No more requests from here on (the consumer keeps reading)."""
        self._stop.set()
        await self._producer

    async def _produce(self) -> None:
        from client_support import request

        i = 0
        while not self._stop.is_set():
            rid = f"{self.prefix}-{i}"
            i += 1
            await self.client.add_request_async(request(rid, max_tokens=self.max_tokens))
            self.sent.append(rid)
            await asyncio.sleep(0.01)

    async def _consume(self) -> None:
        while True:
            outputs = await self.client.get_output_async()
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    assert out.request_id not in self.done, "finished twice"
                    self.done[out.request_id] = (out.finish_reason, outputs.engine_index)


async def wait_until(
    predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition"
) -> None:
    """Async polling wait; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def run_keygen(directory: Path, clients: int) -> int:
    """``corewire keygen DIRECTORY --clients N``, in this process."""
    import argparse

    from corewire import keygen

    parser = argparse.ArgumentParser()
    keygen.add_arguments(parser)
    return keygen.run(parser.parse_args([str(directory), "--clients", str(clients)]))


def netns_front_end() -> int:
    """Program run inside "host A" by ``test_dp_remote`` (``python -c``, arguments
    ``ADDRESS SERVER_KEYS_DIR``): a DPLB front-end with one local engine and one on host B.

    Prints JSON events: ``serving`` (with the per-engine split of 16 requests), then,
    after the test writes ``cut`` and ``cut-done`` lines, ``lost`` with how long after
    ``cut`` the client declared host B's engine lost, why, and the split of 4 requests
    sent after (the group serves on: ``engine_loss="replace"``, the default).
    """
    import json
    import sys

    from client_support import request
    from corewire import DPLBAsyncMPClient

    address, keys = sys.argv[1], sys.argv[2]

    def emit(event: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        client = DPLBAsyncMPClient(
            data_parallel_size=2,
            data_parallel_size_local=1,
            data_parallel_address=address,
            curve_keys=keys,
            engine_args=LIGHT,
            ready_timeout=90,
            health_check_interval=0.5,
            health_check_timeout=2.0,
        )
        try:
            ids = [f"net-{i}" for i in range(16)]
            for rid in ids:
                await client.add_request_async(request(rid, max_tokens=3))
            done = await collect_finished(client, ids)
            per_engine: dict[str, int] = {}
            for f in done.values():
                per_engine[str(f.engine_index)] = per_engine.get(str(f.engine_index), 0) + 1
            emit({"event": "serving", "per_engine": per_engine})
            assert (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "cut"
            cut_at = time.monotonic()
            assert (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "cut-done"
            await wait_until(
                lambda: client.lost_engines or client.engine_dead,
                timeout=30,
                what="the client to notice",
            )
            after_s = time.monotonic() - cut_at
            reason = client._claims.reason(1) or client.resources.dead_reason
            later = [f"later-{i}" for i in range(4)]
            for rid in later:
                await client.add_request_async(request(rid, max_tokens=3))
            served = await collect_finished(client, later)
            emit(
                {
                    "event": "lost" if client.lost_engines == [1] else "dead",
                    "after_s": after_s,
                    "reason": reason,
                    "served_after": sorted(f.engine_index for f in served.values()),
                }
            )
        finally:
            client.shutdown()

    asyncio.run(main())
    return 0


def start_remote_engine(
    address: str,
    index: int,
    size: int,
    keys: Path | None = None,
    netns: str | None = None,
    engine: str | None = None,
    engine_args: dict[str, Any] | None = None,
) -> subprocess.Popen[bytes]:
    """``corewire engine --connect`` in a child process (inside ``netns`` if given),
    the reference engine with ``engine_args`` (:data:`LIGHT` unless given)."""
    cmd = [
        sys.executable, "-m", "corewire.cli", "engine",
        "--connect", address,
        "--engine-index", str(index),
        "--data-parallel-size", str(size),
        "--engine-args", json.dumps(LIGHT if engine_args is None else engine_args),
    ]  # fmt: skip
    if engine is not None:
        cmd += ["--engine", engine]
    if keys is not None:
        cmd += ["--curve-keys", str(keys)]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    env = {**os.environ, "COREWIRE_LOG_LEVEL": "WARNING"}
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL; always reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()
