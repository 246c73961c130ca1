"""A lightweight engine process that speaks the wire protocol without a model.

:func:`run_replay_engine` has the signature of ``run_engine_core`` and is given to a
client as ``engine_main``. The process connects like any engine (DEALER with its index
as identity, PUSH for outputs), sends its ready message, and then:

- ``ADD`` requests stream one token per step, every running request in one
  ``EngineCoreOutputs`` per step, until ``max_tokens`` (``engine_args["step_delay"]``
  seconds between steps, default 0);
- utility ``replay(batch, count)`` replies, then pushes ``count`` copies of one
  pre-encoded frame holding ``batch`` outputs as fast as ZeroMQ takes them (the
  client benchmark measures the receiving side with it);
- utility ``echo(x)`` returns ``x``; ``is_sleeping`` returns False; others fail with the
  protocol's failure text.

It stops on SIGTERM and when the process that started it dies. :class:`EngineLink` and
:class:`ReplayEngine` are reusable by test engines that misbehave on purpose.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from corewire.codec import Encoder, MsgspecDecoder
from corewire.engine.interface import EngineInfo
from corewire.engine.ready import ready_response
from corewire.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    UtilityOutput,
    UtilityResult,
)

__all__ = ["EngineLink", "ReplayEngine", "replay_frame", "run_replay_engine"]

_ADD = EngineCoreRequestType.ADD.value
_ABORT = EngineCoreRequestType.ABORT.value
_UTILITY = EngineCoreRequestType.UTILITY.value
#: How often an idle engine checks that its parent is alive.
_PARENT_POLL_MS = 200


def replay_frame(batch: int, engine_index: int = 0) -> bytes:
    """One encoded ``EngineCoreOutputs`` with ``batch`` outputs of one new token each
    (every eighth request finishing), like a decode step of a busy engine."""
    outputs = [
        EngineCoreOutput(
            request_id=f"cmpl-{i:08x}-0",
            new_token_ids=[1000 + i],
            finish_reason=FinishReason.LENGTH if i % 8 == 7 else None,
        )
        for i in range(batch)
    ]
    frames = Encoder().encode(
        EngineCoreOutputs(engine_index=engine_index, outputs=outputs, timestamp=time.monotonic())
    )
    return bytes(frames[0])


class EngineLink:
    """The engine side of the two links: DEALER for requests, PUSH for outputs."""

    def __init__(
        self,
        engine_index: int,
        input_address: str,
        output_address: str,
        parent_pid: int | None = None,
    ) -> None:
        self.engine_index = engine_index
        self.parent_pid = parent_pid
        self.ctx = zmq.Context(io_threads=1)
        self.requests = self.ctx.socket(zmq.DEALER)
        self.requests.setsockopt(zmq.IDENTITY, engine_index.to_bytes(2, "little"))
        self.outputs = self.ctx.socket(zmq.PUSH)
        # A blocking receive returns every so often to check on the parent process.
        self.requests.setsockopt(zmq.RCVTIMEO, _PARENT_POLL_MS)
        for sock in (self.requests, self.outputs):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self.requests.connect(input_address)
        self.outputs.connect(output_address)
        self.encoder = Encoder()
        self._plain = msgspec.msgpack.Encoder()

    def send_ready(self) -> None:
        """The one ready message, on the requests link: a complete ready response, so
        that vLLM's own client (which decodes it strictly) can drive this engine too."""
        ready = ready_response(EngineInfo(), engine_index=self.engine_index)
        self.requests.send(msgspec.msgpack.encode(ready))

    def parent_alive(self) -> bool:
        """Whether the process that started this engine is still alive."""
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def recv(self, block: bool) -> list[bytes] | None:
        """The next request ``[type, payload, *aux]``; None when there is none (waiting
        up to the parent-check interval when ``block``)."""
        try:
            # One call, no separate poll: the round trip of a utility call is the
            # latency a client benchmark measures.
            if block:
                return self.requests.recv_multipart()
            return self.requests.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def push(self, outputs: EngineCoreOutputs) -> None:
        """Encode and send ``outputs`` (stamped now if they carry no timestamp: vLLM's
        front-end takes a 0.0 for a missing one and uses its own clock)."""
        if not outputs.timestamp:
            outputs.timestamp = time.monotonic()
        self.outputs.send_multipart(self.encoder.encode(outputs), copy=False)

    def reply(self, call_id: int, result: Any = None, failure: str | None = None) -> None:
        """Answer utility call ``call_id``."""
        if failure is None:
            try:
                # EngineCoreOutputs with only utility_output, as plain msgpack: the same
                # bytes as the struct's encoding, for a fraction of the cost.
                payload = self._plain.encode(
                    [
                        self.engine_index,
                        [],
                        None,
                        time.monotonic(),
                        [call_id, None, [None, result]],
                        None,
                        None,
                        None,
                    ]
                )
            except TypeError:  # a result with arrays or tensors
                pass
            else:
                self.outputs.send(payload)
                return
        utility = UtilityOutput(
            call_id=call_id,
            failure_message=failure,
            result=None if failure is not None else UtilityResult(result),
        )
        self.push(EngineCoreOutputs(engine_index=self.engine_index, utility_output=utility))

    def close(self) -> None:
        """Close the sockets and the context."""
        self.requests.close(linger=0)
        self.outputs.close(linger=0)
        self.ctx.term()


class ReplayEngine:
    """Serves requests and utility calls on an :class:`EngineLink` (see module doc).

    Subclasses add utility methods by defining ``utility_<name>(self, *args)``.
    """

    def __init__(self, link: EngineLink, step_delay: float = 0.0) -> None:
        self.link = link
        self.step_delay = step_delay
        #: request id -> [tokens sent, max_tokens]
        self.running: dict[str, list[int]] = {}
        self._decode_request = MsgspecDecoder(EngineCoreRequest).decode
        #: Work to do right after the current utility reply is sent.
        self._after_reply: Any = None

    def serve(self) -> None:
        """Loop until the parent dies (SIGTERM ends the process)."""
        link = self.link
        link.send_ready()
        while True:
            message = link.recv(block=not self.running)
            if message is not None:
                self.handle(message)
                continue
            if self.running:
                self.step()
            elif not link.parent_alive():
                return

    def handle(self, message: Sequence[bytes]) -> None:
        """Act on one request message."""
        kind, payload = message[0], message[1]
        if kind == _UTILITY:
            _, call_id, method, args = msgspec.msgpack.decode(payload)
            handler = getattr(self, f"utility_{method}", None)
            if handler is None:
                self.link.reply(call_id, failure=f"Call to {method} method failed: no such method")
                return
            try:
                result = handler(*args)
            except Exception as exc:
                self.link.reply(call_id, failure=f"Call to {method} method failed: {exc}")
                return
            self.link.reply(call_id, result)
            after, self._after_reply = self._after_reply, None
            if after is not None:
                after()
        elif kind == _ADD:
            self.add(self._decode_request(list(message[1:])))
        elif kind == _ABORT:
            finished = set()
            for request_id in msgspec.msgpack.decode(payload):
                if self.running.pop(request_id, None) is not None:
                    finished.add(request_id)
            if finished:
                self.link.push(
                    EngineCoreOutputs(
                        engine_index=self.link.engine_index,
                        outputs=[
                            EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT)
                            for rid in finished
                        ],
                        finished_requests=finished,
                    )
                )

    def add(self, request: EngineCoreRequest) -> None:
        """Start streaming ``request``."""
        params = request.sampling_params
        max_tokens = 16 if params is None or params.max_tokens is None else params.max_tokens
        self.running[request.request_id] = [0, max_tokens]

    def step(self) -> None:
        """One token for every running request, in one message."""
        if self.step_delay:
            time.sleep(self.step_delay)
        outputs = []
        for request_id, state in list(self.running.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outputs.append(
                EngineCoreOutput(
                    request_id, [state[0]], finish_reason=FinishReason.LENGTH if done else None
                )
            )
            if done:
                del self.running[request_id]
        self.link.push(
            EngineCoreOutputs(
                engine_index=self.link.engine_index, outputs=outputs, timestamp=time.monotonic()
            )
        )

    # -- utility methods -------------------------------------------------------------

    def utility_echo(self, value: Any = None) -> Any:
        """Returns its argument."""
        return value

    def utility_is_sleeping(self) -> bool:
        """Never sleeps."""
        return False

    def utility_replay(self, batch: int, count: int) -> int:
        """After the reply, push ``count`` frames of ``batch`` outputs; returns the
        frame's size in bytes."""
        return self.push_after_reply(replay_frame(batch, self.link.engine_index), count)

    def push_after_reply(self, frame: bytes, count: int) -> int:
        """Right after the current utility reply, push ``frame`` ``count`` times as fast
        as ZeroMQ takes it; returns the frame's size in bytes."""
        send = self.link.outputs.send

        def push_all() -> None:
            for _ in range(count):
                send(frame)

        self._after_reply = push_all
        return len(frame)


def run_replay_engine(
    *,
    engine_index: int,
    input_address: str,
    output_address: str,
    engine: str | None = None,
    engine_args: dict[str, Any] | None = None,
    parent_pid: int | None = None,
    **_options: Any,
) -> None:
    """Process target (``engine_main``) running a :class:`ReplayEngine`.

    ``engine`` is ignored; ``engine_args`` may set ``step_delay``.
    """
    link = EngineLink(engine_index, input_address, output_address, parent_pid)
    try:
        ReplayEngine(link, **(engine_args or {})).serve()
    finally:
        link.close()
