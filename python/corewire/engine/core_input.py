"""The input thread of an engine core: it sends the ready response on each request link,
then decodes every request frame and queues it for the busy loop, answering what does not
decode where the sender can be named (docs/protocol.md §3.1, §4, §9)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from corewire.codec import MsgspecDecoder, request_decoder
from corewire.dp_messages import StartWave
from corewire.engine import ready_layouts
from corewire.engine.frame_head import array_length, read_head
from corewire.engine.inputs import AbortRequests, AddRefused, AddRequest, InputItem, IOFailed
from corewire.engine.interface import NO_MODEL_LEN_LIMIT
from corewire.engine.link import Receiver, connect_socket
from corewire.errors import ProtocolError
from corewire.protocol import (
    REQUEST_ABORT,
    REQUEST_ADD,
    REQUEST_START_DP_WAVE,
    REQUEST_UTILITY,
    EngineCoreRequest,
    UtilityCall,
    field_position,
)

__all__ = ["INPUT_QUEUE_HIGH", "INPUT_QUEUE_LOW", "InputThread"]

logger = logging.getLogger("corewire.engine")

# Where the ids an undecoded frame is answered by sit in its payload array.
_REQUEST_ID = field_position(EngineCoreRequest, "request_id")
_PROMPT_TOKEN_IDS = field_position(EngineCoreRequest, "prompt_token_ids")
_CLIENT_INDEX = field_position(EngineCoreRequest, "client_index")
# The fields of a UTILITY payload read from a frame that does not decode.
_CALL_HEAD = tuple(UtilityCall._fields.index(f) for f in ("client_index", "call_id", "method"))
# Decoded input the input thread may queue ahead of the busy loop; past the high mark it
# waits (sleeping, so without the GIL) until the loop took the queue down to the low
# one. Unbounded, a burst let the input thread decode tens of thousands of requests
# ahead while the busy loop waited for the GIL: on a loaded machine the engine sent
# nothing for seconds and a healthy engine failed its health check. Bounded, unread
# input waits in ZeroMQ, where the front-end's input backlog counts it.
INPUT_QUEUE_HIGH = 2048
INPUT_QUEUE_LOW = 1024
_INPUT_WAIT_S = 0.001


def _own_method(engine: Any, name: str) -> bool:
    """Whether ``engine`` itself implements the utility ``name`` (not the defaults)."""
    return callable(getattr(engine, name, None))


class InputThread:
    """The input thread's part of :class:`~corewire.engine.core.EngineCoreProc` (a mixin:
    its engine, queues and stop state are the engine core's)."""

    def configure_socket(self, sock: zmq.Socket, address: str) -> None:
        """Hook run on every socket just before it connects to ``address`` (e.g. to
        apply CURVE keys for ``tcp://`` peers); does nothing here."""

    def _ready_message(self) -> dict[str, Any]:
        """The ready response, sent once on each request link when it is connected, in
        the keys this engine's protocol asks for (``ready_layouts.ready_response_for``)."""
        return ready_layouts.ready_response_for(
            self.release,
            self.engine_info,
            engine_index=self.engine_index,
            data_parallel_size=self.data_parallel_size,
            dp_stats_address=self.dp_stats_address,
            facts=self._ready_facts(),
        )

    def _ready_facts(self) -> ready_layouts.ReadyFacts:
        """What 0.33.0's ready response asks beyond :class:`EngineInfo`, as this engine
        is: one device group of ``world_size`` workers (tensor parallel), its own
        scheduling limits, LoRA and sleep only if the engine implements them."""
        info = self.engine_info
        engine = self.engine
        supports_lora = _own_method(engine, "add_lora")
        return ready_layouts.ReadyFacts(
            tensor_parallel_size=info.world_size,
            max_num_seqs=NO_MODEL_LEN_LIMIT if info.max_num_seqs is None else info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            supports_lora=supports_lora,
            max_loras=info.max_loras if supports_lora else 0,
            enable_sleep_mode=_own_method(engine, "sleep"),
        )

    def _open_extra_inputs(
        self, ctx: zmq.Context[Any]
    ) -> list[tuple[zmq.Socket[Any], Callable[[list[zmq.Frame]], None]]]:
        """Hook run on the input thread after the ready responses went out: more sockets
        for it to poll, each with the function that handles its messages. It may block
        (e.g. on a coordinator's go-ahead) while :meth:`input_stopping` is false. The
        input thread closes the sockets. None here."""
        return []

    def input_stopping(self) -> bool:
        """Whether the input thread was told to stop (for hooks that wait)."""
        return self._input_stop.is_set()

    def _connect(self, socket_type: int, address: str, **options: Any) -> zmq.Socket[Any]:
        """A socket of this engine connected to ``address`` (through
        :meth:`configure_socket`); see :func:`~corewire.engine.link.connect_socket`."""
        return connect_socket(
            self._ctx, socket_type, address, configure=self.configure_socket, **options
        )

    def _input_thread_main(self) -> None:
        receiver = Receiver()
        try:
            ready = msgspec.msgpack.encode(self._ready_message())
            decoder = _InputDecoder(self)
            for address in self.input_addresses:
                sock = self._connect(zmq.DEALER, address, identity=self.identity)
                receiver.add(sock, decoder.decode)
                # The ROUTER cannot address this engine until it has heard from it.
                sock.send(ready)
            for sock, handler in self._open_extra_inputs(self._ctx):
                receiver.add(sock, handler)
            self.ready_event.set()
            receiver.run(self._input_stop, on_wake=self._malformed_log.flush)
        except Exception as exc:
            if not self._input_stop.is_set():
                logger.exception("engine input thread failed")
                self.input_queue.put(IOFailed(exc))
        finally:
            receiver.close()


class _InputDecoder:
    """Decodes request frames on the input thread and queues them for the busy loop.

    A frame that does not decode is logged (rate-limited), counted and dropped; it never
    stops the thread. When a broken ADD still names its request id, or a broken UTILITY
    its call id, the sender gets an answer (an ERROR finish, a failure reply) instead of
    waiting forever; the ids are read by :func:`~corewire.engine.frame_head.read_head`,
    which needs no recursion, so a frame nested past any decoder's limit is answered too.
    """

    def __init__(self, proc: Any) -> None:
        # proc: the engine core (an InputThread) whose queue and counters this feeds.
        self._proc = proc
        self._queue_put = proc.input_queue.put
        self._qsize = proc.input_queue.qsize
        # The protocol's request layout (0.33.0 appends fields, and its LoRA differs).
        self._add_decoder = request_decoder(proc.release, for_engine=True)
        self._any_decoder = MsgspecDecoder()
        self._log = proc._malformed_log
        self._max_model_len = proc.engine_info.max_model_len
        self._single_client = len(proc.output_addresses) == 1

    def _put(self, item: InputItem) -> None:
        """Queue ``item`` for the busy loop; past :data:`INPUT_QUEUE_HIGH` queued, wait
        until it took the queue down to :data:`INPUT_QUEUE_LOW` (or a stop)."""
        self._queue_put(item)
        if self._qsize() >= INPUT_QUEUE_HIGH:
            proc = self._proc
            proc.input_pauses += 1
            stopping = proc._input_stop.is_set
            while self._qsize() > INPUT_QUEUE_LOW and not stopping():
                time.sleep(_INPUT_WAIT_S)

    def decode(self, frames: list[zmq.Frame]) -> None:
        """Decode one request message and queue it (or answer / drop it if broken)."""
        if len(frames) < 2:
            self._log.warning(
                "dropping a malformed request of %d frame(s): need type and payload",
                len(frames),
            )
            return
        request_type = frames[0].bytes
        try:
            if request_type == REQUEST_ADD:
                self._decode_add(frames)
            elif request_type == REQUEST_UTILITY:
                self._decode_utility(frames)
            elif request_type == REQUEST_ABORT:
                ids = self._any_decoder.decode(frames[1:])
                if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                    raise ProtocolError("ABORT payload must be an array of request-id strings")
                self._put(AbortRequests(ids))
            elif request_type == REQUEST_START_DP_WAVE:
                self._put(StartWave.from_payload(self._any_decoder.decode(frames[1:])))
            else:
                raise ProtocolError(f"unknown request type {request_type!r}")
        except Exception as exc:  # nothing a peer sends may stop the input thread
            self._log.warning("dropping a malformed request: %s", exc)

    def _decode_add(self, frames: list[zmq.Frame]) -> None:
        payload = frames[1].buffer
        # The prompt's length, from its array header, before decoding anything: a
        # prompt over the limit costs no decode, however large (the busy loop checks
        # again, for prompt_embeds and for frames this header read cannot follow).
        declared = array_length(payload, _PROMPT_TOKEN_IDS)
        if declared is not None and declared > self._max_model_len:
            limit = f"prompt of {declared} tokens exceeds max_model_len {self._max_model_len}"
            # The refusal goes to the sender: with several clients, only if its
            # client_index (after the prompt) was within reach; else decode after all.
            if self._refuse(payload, limit, need_client=not self._single_client):
                return
        try:
            request = self._add_decoder.decode(frames[1:])
        except ProtocolError as exc:
            self._refuse(payload, f"malformed request: {exc}")
            raise
        self._put(AddRequest(request))

    def _refuse(self, payload: Any, reason: str, need_client: bool = False) -> bool:
        """Queue the refusal of the ADD in ``payload`` if its request id (and, with
        ``need_client``, its client index) can be read; return whether it was."""
        head = read_head(payload, (_REQUEST_ID, _CLIENT_INDEX)) or {}
        request_id = head.get(_REQUEST_ID)
        client_index = head.get(_CLIENT_INDEX)
        if not isinstance(request_id, str):
            return False
        if type(client_index) is not int:
            if need_client:
                return False
            client_index = 0
        self._put(AddRefused(request_id, client_index, reason))
        return True

    def _decode_utility(self, frames: list[zmq.Frame]) -> None:
        try:
            call = self._any_decoder.decode(frames[1:])
        except ProtocolError as exc:
            # Still try to read the call id, to answer the caller instead of leaving it
            # waiting forever.
            head = read_head(frames[1].buffer, _CALL_HEAD) or {}
            self._fail_call({UtilityCall._fields[i]: v for i, v in head.items()}, exc)
            raise
        if isinstance(call, list) and len(call) >= len(UtilityCall._fields):
            item = UtilityCall._make(call[: len(UtilityCall._fields)])
            if (
                type(item.client_index) is int
                and type(item.call_id) is int
                and isinstance(item.method, str)
                and (item.args is None or isinstance(item.args, list))
            ):
                self._put(item._replace(args=item.args or ()))
                return
        error = ProtocolError(
            "malformed utility request: expected [client_index, call_id, method, args]"
        )
        if isinstance(call, list):
            self._fail_call(dict(zip(UtilityCall._fields, call, strict=False)), error)
        raise error

    def _fail_call(self, fields: dict[str, Any], error: ProtocolError) -> None:
        """Answer a broken utility call with a failure if its call id is readable
        (``fields``: what could be read of it, by :class:`UtilityCall` field name)."""
        call_id = fields.get("call_id")
        if type(call_id) is not int:
            return
        client_index = fields.get("client_index")
        method = fields.get("method")
        self._proc._reply_utility(
            client_index if type(client_index) is int else 0,
            call_id,
            method if isinstance(method, str) else "<unknown>",
            failure=error,
            fresh=True,
        )
