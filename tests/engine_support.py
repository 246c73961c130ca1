"""Helpers for the engine tests: a raw pyzmq front-end and engines that misbehave.

The front-end is what a vLLM 0.25.1 front-end does on the wire, written with nothing but
pyzmq and msgspec: it binds a ROUTER and a PULL on ``ipc://`` endpoints in a private
directory, waits for an engine's ready message, and sends hand-built request frames.

The engine classes here are loaded inside spawned engine processes by
"engine_support:Name" (pytest puts this directory on ``sys.path``, and ``spawn`` children
inherit it).
"""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from corewire.codec import Encoder, MsgspecDecoder
from corewire.engine import Engine
from corewire.engine.launch import run_engine_core
from corewire.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    UtilityOutput,
)

#: Engine args that keep the reference engine light on a shared CI machine.
LIGHT_REFERENCE = {"num_threads": 1, "device": "cpu"}


class FrontEnd:
    """A raw front-end: ROUTER (requests) and PULL (outputs) bound in ``ipc_dir``.

    ``num_outputs`` > 1 binds one PULL per front-end client (``client_index``).
    Everything it starts or opens is released by :meth:`close`.
    """

    def __init__(
        self, ipc_dir: Path, tag: str = "fe", num_outputs: int = 1, rcvhwm: int | None = None
    ) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.input_address = f"ipc://{ipc_dir}/{tag}-in"
        self.output_addresses = [f"ipc://{ipc_dir}/{tag}-out{i}" for i in range(num_outputs)]
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.bind(self.input_address)
        self.pulls: list[zmq.Socket[Any]] = []
        for address in self.output_addresses:
            pull = self.ctx.socket(zmq.PULL)
            pull.linger = 0
            if rcvhwm is not None:
                pull.rcvhwm = rcvhwm
            pull.bind(address)
            self.pulls.append(pull)
        self.encoder = Encoder()
        self.decoder = MsgspecDecoder(EngineCoreOutputs)
        self.procs: list[multiprocessing.process.BaseProcess] = []
        # Engine 0's identity (docs/protocol.md §2) until wait_ready sees the engine's own.
        self.identity = b"\x00\x00"
        # Outputs received while waiting for something else (e.g. a utility reply).
        self.backlog: collections.deque[EngineCoreOutputs] = collections.deque()
        self._next_call_id = 1

    @property
    def output_address(self) -> str:
        """The first (client 0) output address."""
        return self.output_addresses[0]

    # ------------------------------------------------------------------ processes

    def start_engine(
        self,
        engine: str | None = None,
        engine_args: dict[str, Any] | None = None,
        engine_index: int = 0,
        **kwargs: Any,
    ) -> multiprocessing.process.BaseProcess:
        """Start ``run_engine_core`` in a spawned child, as a client does."""
        output: str | list[str] = (
            self.output_addresses if len(self.output_addresses) > 1 else self.output_address
        )
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            kwargs={
                "engine_index": engine_index,
                "input_address": self.input_address,
                "output_address": output,
                "engine": engine,
                "engine_args": engine_args,
                "parent_pid": os.getpid(),
                **kwargs,
            },
            name=f"corewire-engine-{engine_index}",
            daemon=True,
        )
        proc.start()
        self.procs.append(proc)
        return proc

    def wait_ready(self, timeout: float = 60.0) -> tuple[bytes, dict[str, Any]]:
        """Receive one ready message; returns ``(identity, ready map)``."""
        if not self.router.poll(timeout * 1000):
            raise AssertionError(f"no ready message within {timeout} s")
        identity, payload = self.router.recv_multipart()
        self.identity = identity
        return identity, msgspec.msgpack.decode(payload)

    # ------------------------------------------------------------------ sending

    def send_frames(self, frames: Iterable[Any], identity: bytes | None = None) -> None:
        """Send raw frames (after the identity) to the engine."""
        self.router.send_multipart([identity or self.identity, *frames], copy=False)

    def send(self, request_type: bytes, obj: Any) -> None:
        """Encode ``obj`` with corewire's Encoder and send it as ``request_type``."""
        self.send_frames([request_type, *self.encoder.encode(obj)])

    def add(self, request: EngineCoreRequest) -> None:
        """Send an ADD request."""
        self.send(EngineCoreRequestType.ADD.value, request)

    def abort(self, request_ids: list[str]) -> None:
        """Send an ABORT request."""
        self.send(EngineCoreRequestType.ABORT.value, request_ids)

    def call(self, method: str, *args: Any, timeout: float = 30.0) -> UtilityOutput:
        """Make a utility call and wait for its reply (other outputs go to the backlog)."""
        call_id = self._next_call_id
        self._next_call_id += 1
        self.send(EngineCoreRequestType.UTILITY.value, [0, call_id, method, list(args)])
        return self.wait_utility(call_id, timeout)

    def wait_utility(self, call_id: int, timeout: float = 30.0) -> UtilityOutput:
        """Wait for the reply to ``call_id``."""
        deadline = time.monotonic() + timeout
        while True:
            # Straight from the socket: the backlog only holds non-matching messages.
            msg = self._recv_socket(max(0.0, deadline - time.monotonic()), 0)
            if isinstance(msg, bytes):
                raise AssertionError(f"engine sent {msg!r} while waiting for call {call_id}")
            uo = msg.utility_output
            if uo is not None and uo.call_id == call_id:
                return uo
            self.backlog.append(msg)

    def value(self, method: str, *args: Any) -> Any:
        """A utility call's result value; fails the test on a failure reply."""
        reply = self.call(method, *args)
        assert reply.failure_message is None, reply.failure_message
        assert reply.result is not None
        return reply.result.result

    # ------------------------------------------------------------------ receiving

    def recv_raw(self, timeout: float = 30.0, client: int = 0) -> list[zmq.Frame]:
        """The next message's frames from output socket ``client``."""
        if not self.pulls[client].poll(timeout * 1000):
            raise AssertionError(f"no output within {timeout} s")
        return self.pulls[client].recv_multipart(copy=False)

    def recv(self, timeout: float = 30.0, client: int = 0) -> EngineCoreOutputs | bytes:
        """The next decoded message (``ENGINE_CORE_DEAD`` is returned as bytes)."""
        if client == 0 and self.backlog:
            return self.backlog.popleft()
        return self._recv_socket(timeout, client)

    def _recv_socket(self, timeout: float, client: int) -> EngineCoreOutputs | bytes:
        frames = self.recv_raw(timeout, client)
        if len(frames) == 1 and frames[0].bytes == ENGINE_CORE_DEAD:
            return ENGINE_CORE_DEAD
        return self.decoder.decode(frames)

    def nothing_for(self, seconds: float, client: int = 0) -> bool:
        """Whether no message arrives on output socket ``client`` for ``seconds``."""
        return not self.backlog and not self.pulls[client].poll(seconds * 1000)

    def collect(
        self, request_ids: Iterable[str], timeout: float = 60.0, client: int = 0
    ) -> dict[str, list[EngineCoreOutput]]:
        """Receive until every request in ``request_ids`` finished; outputs per request."""
        pending = set(request_ids)
        result: dict[str, list[EngineCoreOutput]] = {rid: [] for rid in pending}
        deadline = time.monotonic() + timeout
        while pending:
            msg = self.recv(max(0.0, deadline - time.monotonic()), client)
            if isinstance(msg, bytes):
                raise AssertionError(f"engine sent {msg!r} while requests were running")
            for out in msg.outputs:
                result.setdefault(out.request_id, []).append(out)
                if out.finish_reason is not None:
                    pending.discard(out.request_id)
        return result

    def generate(self, request: EngineCoreRequest, timeout: float = 60.0) -> list[int]:
        """Run one request to completion; returns its tokens."""
        self.add(request)
        outs = self.collect([request.request_id], timeout)[request.request_id]
        return [t for o in outs for t in o.new_token_ids]

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Stop every engine this front-end started, then close the sockets."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            proc.close()
        self.procs.clear()
        self.router.close(0)
        for pull in self.pulls:
            pull.close(0)
        self.ctx.term()


def start_engine_then_wait(
    input_address: str, output_address: str, conn: multiprocessing.connection.Connection
) -> None:
    """Target of an intermediate process: start an engine child (default parent watch),
    report its pid, then idle until killed."""
    proc = multiprocessing.get_context("spawn").Process(
        target=run_engine_core,
        kwargs={
            "engine_index": 0,
            "input_address": input_address,
            "output_address": output_address,
            "engine": "engine_support:QuietEngine",
        },
        name="corewire-engine-0",
    )
    proc.start()
    conn.send(proc.pid)
    signal.pause()


# ---------------------------------------------------------------------- test engines


class QuietEngine(Engine):
    """Accepts requests and never produces output; answers utility calls."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        """Remember the id."""
        self.requests.append(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Forget the ids."""
        self.requests = [r for r in self.requests if r not in request_ids]

    def step(self) -> list[EngineCoreOutput]:
        """Never called: there is never work."""
        return []

    def has_unfinished_requests(self) -> bool:
        """Never any work."""
        return False

    def echo(self, x: Any) -> Any:
        """Return ``x``."""
        return x

    def unsendable(self) -> object:
        """Return something that has no wire form."""
        return object()

    def failing_future(self, message: str) -> concurrent.futures.Future:
        """A future that another thread fails with ``ValueError(message)``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        threading.Timer(0.05, future.set_exception, (ValueError(message),)).start()
        return future


class FailingStepEngine(QuietEngine):
    """Raises from ``step()`` as soon as it has a request: a fatal engine error."""

    def has_unfinished_requests(self) -> bool:
        """Work as soon as a request arrived."""
        return bool(self.requests)

    def step(self) -> list[EngineCoreOutput]:
        """Fail."""
        raise RuntimeError("step exploded")


class UnencodableOutputEngine(FailingStepEngine):
    """Returns an output the encoder cannot send: the output thread fails, which is as
    fatal as a failing step."""

    def step(self) -> list[EngineCoreOutput]:
        """One output whose stop_reason has no wire form."""
        self.requests.clear()
        return [EngineCoreOutput("x", [1], stop_reason=object())]  # type: ignore[arg-type]


class BigPayloadEngine(QuietEngine):
    """On a request, emits ``count`` large messages back to back, as fast as it can.

    Message ``i`` holds ``num_tokens`` token ids ``(i + 1) * 1_000_000 + j`` (a payload well
    over ZeroMQ's copy threshold, so it is sent from corewire's reused encode buffers)
    and a ``tensor_elems`` int32 pooling tensor filled with ``i`` (an aux frame).
    """

    def __init__(self, count: int = 32, num_tokens: int = 20_000, tensor_elems: int = 1 << 18):
        super().__init__()
        self.count = count
        self.num_tokens = num_tokens
        self.tensor_elems = tensor_elems
        self.emitted = 0

    def step(self) -> list[EngineCoreOutput]:
        """One big message per step."""
        i = self.emitted
        self.emitted += 1
        last = self.emitted == self.count
        if last:
            self.requests.clear()
        base = (i + 1) * 1_000_000
        return [
            EngineCoreOutput(
                "big",
                list(range(base, base + self.num_tokens)),
                pooling_output=torch.full((self.tensor_elems,), i, dtype=torch.int32),
                finish_reason=FinishReason.LENGTH if last else None,
            )
        ]

    def has_unfinished_requests(self) -> bool:
        """Work while a request is present."""
        return bool(self.requests)
