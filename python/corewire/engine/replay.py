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

``release`` (``engine_args`` never holds it; it is the process target's own option,
default 0.25.1) is the vLLM version whose wire it speaks: that version's ready response,
requests and output layout (0.33.0: ``weight_version`` ``"default"`` on every step's
message, as :mod:`corewire.wire.outputs` converts them).

It stops on SIGTERM and when the process that started it dies. :class:`EngineLink` and
:class:`ReplayEngine` are reusable by test engines that misbehave on purpose. The link's
sockets and output messages come from :mod:`corewire.engine.link`, as the engine core's
do; only its receive differs (one blocking call, no poll, for the lowest round trip).

Wire format: docs/protocol.md §3.1, §4 and §5 (the minimal engine of §5.8, without a
model).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from corewire import releases
from corewire.codec import Encoder, request_decoder
from corewire.engine.interface import EngineInfo
from corewire.engine.link import connect_socket, engine_outputs, stamp_unstamped
from corewire.engine.ready_layouts import ready_response_for
from corewire.protocol import (
    REQUEST_ABORT,
    REQUEST_ADD,
    REQUEST_UTILITY,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    UtilityCall,
    UtilityOutput,
    UtilityResult,
    engine_identity,
    utility_failure_text,
    utility_result_wire,
)
from corewire.wire.outputs import DEFAULT_WEIGHT_VERSION, StepOutputs, output_converter

__all__ = [
    "EngineLink",
    "ReplayEngine",
    "encode_plain_outputs",
    "replay_frame",
    "run_replay_engine",
]

#: How often an idle engine checks that its parent is alive.
_PARENT_POLL_MS = 200


def replay_frame(batch: int, engine_index: int = 0, release: str | None = None) -> bytes:
    """One encoded ``EngineCoreOutputs`` with ``batch`` outputs of one new token each
    (every eighth request finishing), like a decode step of a busy engine, in
    ``release``'s layout (None: 0.25.1)."""
    outputs = [
        EngineCoreOutput(
            request_id=f"cmpl-{i:08x}-0",
            new_token_ids=[1000 + i],
            finish_reason=FinishReason.LENGTH if i % 8 == 7 else None,
        )
        for i in range(batch)
    ]
    message: Any = engine_outputs(engine_index, outputs=outputs)
    to_wire = output_converter(release)
    if to_wire is not None:
        message = to_wire(StepOutputs(message, DEFAULT_WEIGHT_VERSION))
    frames = Encoder(release=release).encode(message)
    return bytes(frames[0])


def _plain_value(obj: Any) -> Any:
    if isinstance(obj, UtilityResult):
        return utility_result_wire(obj)
    raise TypeError(f"{type(obj).__name__} is not plain msgpack")


_plain_encoder = msgspec.msgpack.Encoder(enc_hook=_plain_value)


def encode_plain_outputs(outputs: EngineCoreOutputs) -> bytes | None:
    """``outputs`` encoded by plain msgspec, the same bytes as the codec's encoding for
    a fraction of the cost; None when they hold anything but plain msgpack values
    (arrays, tensors), which only the codec encodes."""
    try:
        return _plain_encoder.encode(outputs)
    except TypeError:
        return None


class EngineLink:
    """The engine side of the two links: DEALER for requests, PUSH for outputs.

    The sockets come from :func:`~corewire.engine.link.connect_socket` and the outputs
    from :func:`~corewire.engine.link.engine_outputs`, as the engine core's. The receive
    is its own, not :class:`~corewire.engine.link.Receiver`, on purpose: a Receiver owns
    a thread that polls until a stop flag and hands each message to a handler, while
    the replay engine receives and steps on ONE thread, taking at most one message
    between two steps (:meth:`recv` with ``block=False``) and blocking in a single
    ``recv_multipart`` only when idle. A poll before each receive would add a system
    call to every utility round trip, the latency the client benchmark measures, and a
    second thread would add a hand-off to it; the replay engine exists to measure the
    client, so its engine side must cost as little as possible.
    """

    def __init__(
        self,
        engine_index: int,
        input_address: str,
        output_address: str,
        parent_pid: int | None = None,
        release: str | None = None,
    ) -> None:
        self.engine_index = engine_index
        self.parent_pid = parent_pid
        #: The vLLM wire version this link speaks.
        self.wire_release = releases.get(release)
        # None for 0.25.1: messages go out as built.
        self._to_wire = output_converter(self.wire_release)
        self.ctx = zmq.Context(io_threads=1)
        unbounded = ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0))
        try:
            # A blocking receive returns every so often to check on the parent process.
            self.requests = connect_socket(
                self.ctx,
                zmq.DEALER,
                input_address,
                identity=engine_identity(engine_index),
                options=(*unbounded, (zmq.RCVTIMEO, _PARENT_POLL_MS)),
            )
            try:
                self.outputs = connect_socket(self.ctx, zmq.PUSH, output_address, options=unbounded)
            except BaseException:
                self.requests.close(linger=0)
                raise
        except BaseException:
            self.ctx.term()
            raise
        self.encoder = Encoder(release=self.wire_release)

    def send_ready(self) -> None:
        """The one ready message, on the requests link: a complete ready response (of
        the link's protocol), so that vLLM's own client (which decodes it strictly) can
        drive this engine too."""
        ready = ready_response_for(self.wire_release, EngineInfo(), engine_index=self.engine_index)
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

    def push(self, outputs: EngineCoreOutputs, *, step: bool = False) -> None:
        """Encode and send ``outputs`` (stamped now if they carry no timestamp); ``step``:
        a step made them (a protocol with ``weight_version`` stamps it)."""
        message: Any = stamp_unstamped(outputs)
        if self._to_wire is not None:
            message = self._to_wire(
                StepOutputs(message, DEFAULT_WEIGHT_VERSION) if step else message
            )
        frames = self.encoder.encode(message)
        self.outputs.send_multipart(frames, copy=False)

    def reply(self, call_id: int, result: Any = None, failure: str | None = None) -> None:
        """Answer utility call ``call_id``."""
        utility = UtilityOutput(
            call_id=call_id,
            failure_message=failure,
            result=None if failure is not None else UtilityResult(result),
        )
        outputs = engine_outputs(self.engine_index, utility_output=utility)
        if self._to_wire is not None:
            self.push(outputs)
            return
        payload = encode_plain_outputs(outputs)
        if payload is None:  # a result with arrays or tensors
            self.push(outputs)
        else:
            self.outputs.send(payload)

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
        self._decode_request = request_decoder(
            getattr(link, "wire_release", None), for_engine=True
        ).decode
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
        if kind == REQUEST_UTILITY:
            call = UtilityCall._make(msgspec.msgpack.decode(payload))
            call_id, method, args = call.call_id, call.method, call.args or ()
            handler = getattr(self, f"utility_{method}", None)
            if handler is None:
                self.link.reply(call_id, failure=utility_failure_text(method, "no such method"))
                return
            try:
                result = handler(*args)
            except Exception as exc:
                self.link.reply(call_id, failure=utility_failure_text(method, exc))
                return
            self.link.reply(call_id, result)
            after, self._after_reply = self._after_reply, None
            if after is not None:
                after()
        elif kind == REQUEST_ADD:
            self.add(self._decode_request(list(message[1:])))
        elif kind == REQUEST_ABORT:
            finished = set()
            for request_id in msgspec.msgpack.decode(payload):
                if self.running.pop(request_id, None) is not None:
                    finished.add(request_id)
            if finished:
                self.link.push(
                    engine_outputs(
                        self.link.engine_index,
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
        self.link.push(engine_outputs(self.link.engine_index, outputs=outputs), step=True)

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
        release = getattr(self.link, "wire_release", None)
        return self.push_after_reply(replay_frame(batch, self.link.engine_index, release), count)

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
    release: str | None = None,
    **_options: Any,
) -> None:
    """Process target (``engine_main``) running a :class:`ReplayEngine`.

    ``engine`` is ignored; ``engine_args`` may set ``step_delay``; ``release`` is the
    vLLM wire version (None: 0.25.1).
    """
    link = EngineLink(engine_index, input_address, output_address, parent_pid, release)
    try:
        ReplayEngine(link, **(engine_args or {})).serve()
    finally:
        link.close()
