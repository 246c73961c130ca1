"""EngineCoreProc: the engine side of the engine-core protocol.

Three threads, as in vLLM's engine core:

- the *input thread* owns a DEALER socket connected to the front-end's ROUTER (and a DP
  engine's coordinator subscription). It sends the ready message first, then decodes
  every incoming request and queues it (as :mod:`corewire.engine.inputs` items);
- the *busy loop* (the thread that calls :meth:`EngineCoreProc.run`, normally the main
  thread) applies queued requests to the :class:`~corewire.engine.Engine` and calls
  ``step()`` while there is work;
- the *output thread* owns the PUSH socket(s) connected to the front-end's PULL and
  encodes and sends everything the busy loop queues.

The queues are :class:`queue.SimpleQueue`: ``put`` is safe from a signal handler, which is
how SIGTERM stops the loop without interrupting a step half-way.

Input the engine cannot take is answered where the sender can be named and otherwise
dropped, never fatal: a frame that does not decode (a failure reply to a readable call
id, an ERROR finish to a readable request id, however deep the frame is nested), a
request over ``max_model_len`` (refused before the engine sees it, whatever its kind),
a request the engine refuses (ERROR finish with a short safe reason in ``stop_reason``,
see :mod:`corewire.engine.reasons`). An ADD that reuses the id of a request still in
flight is dropped without any output: an ERROR under that id would end the running
request's stream on the front-end while its tokens keep coming (a request sent as
``resumable``, vLLM's streaming input, takes its later chunks under the same id: those
go to the engine). Each of these is logged at most a few times per interval
(:mod:`corewire.engine.logthrottle`) and counted; the ``engine_core_counters`` utility
reports the counts. Under vLLM 0.33.0's wire an ERROR finish also carries that
version's ``RequestError``: ``"validation_error"`` for a request refused for itself
(not for an engine fault), ``"engine_paused"`` (retryable) for an ADD that arrives while
``pause_generation`` refuses new requests (:mod:`corewire.engine.utilities_0_33_0`).

Wire format: docs/protocol.md §3.1 (ready response), §4 (requests it takes), §5 (outputs
it sends), §7 (ENGINE_CORE_DEAD and stopping) and §9 (error rules).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import msgspec
import zmq

from corewire import releases
from corewire.codec import Encoder, MsgspecDecoder, request_decoder
from corewire.dp_messages import StartWave, WaveComplete
from corewire.engine import ready_layouts
from corewire.engine.frame_head import array_length, read_head
from corewire.engine.inputs import (
    RESUME,
    STOP,
    AbortRequests,
    AddRefused,
    AddRequest,
    InputItem,
    IOFailed,
)
from corewire.engine.interface import INTERFACE_METHODS, NO_MODEL_LEN_LIMIT, Engine
from corewire.engine.link import Receiver, connect_socket, engine_outputs
from corewire.engine.logthrottle import ThrottledWarning
from corewire.engine.peer_watch import PeerWatch
from corewire.engine.ready import engine_info_of
from corewire.engine.reasons import reason_for, safe_reason
from corewire.engine.utilities import DEFAULT_UTILITIES, UtilityDefaults
from corewire.engine.utilities_0_33_0 import PAUSED_ERROR, Utilities0330, utility_names
from corewire.engine.utilities_0_34_0 import Utilities0340
from corewire.errors import ProtocolError
from corewire.layouts import RequestError
from corewire.logtext import Bounded, bounded
from corewire.protocol import (
    ENGINE_CORE_DEAD,
    REQUEST_ABORT,
    REQUEST_ADD,
    REQUEST_START_DP_WAVE,
    REQUEST_UTILITY,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    UtilityCall,
    UtilityOutput,
    UtilityResult,
    engine_identity,
    field_position,
    utility_failure_text,
)
from corewire.wire.outputs import (
    DEFAULT_WEIGHT_VERSION,
    StepOutputs,
    finish_output,
    output_converter,
)

__all__ = ["EngineCoreProc"]

logger = logging.getLogger("corewire.engine")

#: The utilities a release's front-end calls beyond an engine's own methods, answered from
#: the engine core's own state (None: the engine's methods answer every call), by the
#: release each set was written for (``Release.choose``): 0.27.0's calls (weight versions)
#: are in 0.33.0's set, and the rest of that set is never called there.
RELEASE_UTILITIES: dict[str, type[Utilities0330] | None] = {
    "0.25.1": None,
    "0.27.0": Utilities0330,
    "0.34.0": Utilities0340,
}

# Where the ids an undecoded frame is answered by sit in its payload array.
_REQUEST_ID = field_position(EngineCoreRequest, "request_id")
_PROMPT_TOKEN_IDS = field_position(EngineCoreRequest, "prompt_token_ids")
_CLIENT_INDEX = field_position(EngineCoreRequest, "client_index")
# The fields of a UTILITY payload read from a frame that does not decode.
_CALL_HEAD = tuple(UtilityCall._fields.index(f) for f in ("client_index", "call_id", "method"))

# Payload buffers kept for reuse by the output thread; more are allocated while ZeroMQ
# still holds the ones in flight (slow reader), but only this many are kept afterwards.
_MAX_FREE_BUFFERS = 8
# A buffer that grew past this is dropped instead of being kept for reuse.
_MAX_KEPT_BUFFER_BYTES = 16 << 20
# Backpressure. Output messages queued for the output thread at which the busy loop
# stops stepping (the PUSH blocks because the front-end stopped reading), and at which
# the output thread tells it to go on. A message is one step's outputs: a few queued
# messages are enough to keep the output thread busy while the loop steps.
OUTPUT_QUEUE_HIGH = 8
OUTPUT_QUEUE_LOW = 2
# Messages the PUSH socket queues for a front-end that is not reading (ZeroMQ's send
# high-water mark); a send past it blocks. Small, so that a paused front-end holds the
# engine back soon; a front-end that reads (vLLM's, with an unbounded receive queue)
# never lets it fill.
OUTPUT_SNDHWM = 128
# How often a paused loop looks at the output queue again if no resume note came.
_PAUSE_POLL_S = 0.05
# Decoded input the input thread may queue ahead of the busy loop; past the high mark it
# waits (sleeping, so without the GIL) until the loop took the queue down to the low
# one. Unbounded, a burst let the input thread decode tens of thousands of requests
# ahead while the busy loop waited for the GIL: on a loaded machine the engine sent
# nothing for seconds and a healthy engine failed its health check. Bounded, unread
# input waits in ZeroMQ, where the front-end's input backlog counts it.
INPUT_QUEUE_HIGH = 2048
INPUT_QUEUE_LOW = 1024
_INPUT_WAIT_S = 0.001
# The longest the busy loop applies queued input before it steps again.
_INPUT_SLICE_S = 0.05
# Once a stop is requested, how long the output thread waits for a front-end that takes
# nothing (it is shutting down without reading) before it drops what is left, and the
# linger of its sockets after it was blocked.
_STOP_SEND_WAIT_S = 0.25
_STOP_LINGER_MS = 250


def _address_list(address: str | Sequence[str], link: str) -> list[str]:
    """One address or several (one per front-end client) as a list; at least one."""
    addresses = [address] if isinstance(address, str) else list(address)
    if not addresses:
        raise ValueError(f"at least one {link} address is required")
    return addresses


def _take_buffer(
    in_flight: collections.deque[tuple[zmq.MessageTracker, bytearray, list[Any]]],
    free: list[bytearray],
) -> bytearray:
    """A payload buffer for the output thread: first the buffers ZeroMQ released go back
    to ``free`` (a bounded number, none that grew too big), then one is taken from it."""
    while in_flight and in_flight[0][0].done:
        buf = in_flight.popleft()[1]
        if len(free) < _MAX_FREE_BUFFERS and len(buf) <= _MAX_KEPT_BUFFER_BYTES:
            free.append(buf)
    return free.pop() if free else bytearray()


def _validation_error(reason: str) -> RequestError:
    """The ``RequestError`` of a request refused for itself (vLLM's front-end answers
    it with 400; only a protocol with the error field sends it)."""
    return RequestError("validation_error", reason)


def _own_method(engine: Any, name: str) -> bool:
    """Whether ``engine`` itself implements the utility ``name`` (not the defaults)."""
    return callable(getattr(engine, name, None))


class _Abandoned(Exception):
    """The front-end took no output for too long after a stop was requested."""


class _Encoded:
    """Frames encoded outside the output thread (utility replies); sent as they are."""

    __slots__ = ("frames",)

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames


class EngineCoreProc:
    """Runs an :class:`~corewire.engine.Engine` behind the engine-core sockets.

    ``input_address`` is the front-end's ROUTER (this side connects a DEALER whose
    identity is ``engine_index`` as 2 bytes little-endian), or one per front-end client;
    ``output_address`` is the front-end's PULL (one address, or one per front-end
    client: outputs then go to the socket of the request's ``client_index``).
    ``dp_stats_address`` is reported in the ready response (where front-ends subscribe
    to DP load stats). :attr:`ready_event` is set once the ready response went out on
    every request link (and :meth:`_open_extra_inputs` returned). With ``stop_notice``,
    a requested stop first finishes the requests in flight with ABORT and then sends
    ENGINE_CORE_DEAD (for front-ends that cannot take a stopped engine back).

    ``protocol`` is the vLLM version whose wire the engine speaks (any release of
    ``corewire.releases.SUPPORTED``, default ``corewire.releases.DEFAULT``: the installed
    vLLM's release, else the newest; nothing on the wire names
    it, so it is told): requests are
    read in its layout (``corewire.codec.request_decoder``; a 0.33.0 request reaches
    the engine as that version's struct, whose fields are 0.25.1's plus
    ``session_id`` and ``kv_hints``), the ready response has its keys, and outputs,
    which engines build as ``corewire.protocol`` structs, are converted into its layout
    on the output thread (:mod:`corewire.wire.outputs`).

    Utility calls go to the engine's public methods; the ones vLLM's front-end makes
    that the engine lacks are answered by
    :class:`~corewire.engine.utilities.UtilityDefaults`.

    Data-parallel subclasses set :attr:`data_parallel_size` (reported in the ready
    response), :attr:`coordinator_output` (a PUSH target after the client sockets, sent
    to by :meth:`_to_coordinator`) and :attr:`PROC_UTILITIES` (utility methods of the
    proc itself), and override these hooks: :meth:`configure_socket`,
    :meth:`_open_extra_inputs` (more sockets for the input thread, e.g. a coordinator's
    publisher), :meth:`_has_work`, :meth:`_process_engine_step`, :meth:`_report_load`,
    :meth:`_scheduler_stats`, :meth:`_handle_add`, :meth:`_handle_start_dp_wave` and
    :meth:`_handle_wave_complete`. An unknown keyword option is a ``TypeError`` (a
    launcher picks the data-parallel class whenever it has data-parallel options, see
    :func:`corewire.engine.launch.serve_engine`), so a misspelt option fails the start
    instead of being ignored.
    """

    #: Utility methods the proc itself answers (before the engine's own methods).
    PROC_UTILITIES: ClassVar[frozenset[str]] = frozenset({"engine_core_counters"})

    def __init__(
        self,
        engine: Engine,
        *,
        input_address: str | Sequence[str],
        output_address: str | Sequence[str],
        engine_index: int = 0,
        log_stats: bool = True,
        include_finished_set: bool = False,
        idle_poll_s: float = 1.0,
        linger_ms: int = 5000,
        dp_stats_address: str | None = None,
        stop_notice: bool = False,
        protocol: str | None = None,
    ) -> None:
        if not 0 <= engine_index < 1 << 16:
            raise ValueError(f"engine_index must fit in 2 bytes, got {engine_index}")
        #: The vLLM version whose wire this engine speaks (``corewire.releases``).
        self.protocol = releases.get(protocol)
        # Converts each queued message into the protocol's layout on the output thread
        # (None: engines' structs are that layout already, nothing to do).
        self._to_wire = output_converter(self.protocol)
        # Whether step messages carry a weight version (a release whose EngineCoreOutputs
        # has the field: 0.33.0 on).
        self._stamps_weight_version = self.protocol.weight_versions
        #: What a step's messages carry as ``weight_version`` (0.33.0 on; set by the
        #: ``set_weight_version`` utility).
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.engine = engine
        self.engine_index = engine_index
        self.identity = engine_identity(engine_index)
        self.input_addresses = _address_list(input_address, "input")
        self.input_address = self.input_addresses[0]
        self.dp_stats_address = dp_stats_address
        #: The DP group's size, reported in the ready response (1: no data parallelism).
        self.data_parallel_size = 1
        #: A DP coordinator's PULL that gets this engine's load (None: no coordinator).
        self.coordinator_output: str | None = None
        self.stop_notice = stop_notice
        # Ids of the requests the engine accepted and has not finished, each with its
        # ``resumable`` flag: a second ADD with one of them is dropped unless the first
        # was resumable (vLLM's streaming input: more chunks under the same id, which
        # the engine takes or refuses). The stop notice aborts them.
        self._in_flight: dict[str, bool] = {}
        # Warnings about dropped or refused input, rate-limited; their totals are the
        # counters engine_core_counters() reports.
        self._malformed_log = ThrottledWarning(logger, "malformed request")
        self._refused_log = ThrottledWarning(logger, "refused request")
        self._duplicate_log = ThrottledWarning(logger, "duplicate request id")
        # Read once, before any thread starts: the ready response repeats it.
        self.engine_info = engine_info_of(engine)
        self._utility_defaults = UtilityDefaults(engine)
        # The utilities a 0.33.0-on front-end calls that need this proc's own state, and
        # their names (RELEASE_UTILITIES says which).
        utilities = self.protocol.choose(RELEASE_UTILITIES)
        self._protocol_utilities = None if utilities is None else utilities(self)
        self._protocol_utility_names = (
            frozenset()
            if self._protocol_utilities is None
            else utility_names(type(self._protocol_utilities))
        )
        #: Set once the ready response went out on every request link.
        self.ready_event = threading.Event()
        self.output_addresses = _address_list(output_address, "output")
        self.log_stats = log_stats
        self.include_finished_set = include_finished_set
        self.idle_poll_s = idle_poll_s
        self.linger_ms = linger_ms
        self._init_threads_state()

    def _init_threads_state(self) -> None:
        """The queues, flags and sockets' context the three threads share (part of
        ``__init__``)."""
        self.input_queue: queue.SimpleQueue[InputItem] = queue.SimpleQueue()
        self.output_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Set by the busy loop when it pauses for the output queue, cleared by the output
        # thread when it sends the resume note (a plain bool: one writer at a time).
        self._output_paused = False
        # When a send last found the front-end not reading (monotonic seconds, 0: never).
        self._output_blocked_at = 0.0
        #: Times the busy loop paused stepping because the output queue was full.
        self.output_pauses = 0
        #: Times the input thread waited for the busy loop (INPUT_QUEUE_HIGH reached).
        self.input_pauses = 0
        # A plain bool, not an Event: request_stop() runs inside signal handlers, where
        # taking the Event's lock could deadlock against the interrupted main thread.
        self._stop_requested = False
        self._input_stop = threading.Event()
        self._dead_lock = threading.Lock()
        self._dead_sent = False
        self._exit_code = 0
        # Request ids aborted since the last output message (include_finished_set only).
        self._pending_finished: set[str] = set()
        # request id -> client index, only kept when there are several client sockets.
        self._request_clients: dict[str, int] = {}
        self._utility_encoder = Encoder(protocol=self.protocol)
        # Utility futures completed on the busy-loop thread (e.g. inside step()) reply
        # only after the outputs of that step, which the front-end must see first.
        self._loop_thread_id: int | None = None
        self._deferred_replies: list[tuple[Any, ...]] = []
        self._ctx = zmq.Context()
        self._input_thread: threading.Thread | None = None
        self._output_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        """Serve until stopped; return the exit status (0 clean stop, 1 fatal error).

        Starts the I/O threads, sends the ready message, runs the busy loop on the
        calling thread, then stops everything (the engine's ``shutdown()`` included).
        """
        self._loop_thread_id = threading.get_ident()
        # Everything alive now (torch's modules, the model) lives as long as the process:
        # frozen, the collector's full passes skip it. Unfrozen, each full pass walked
        # ~170k objects of torch alone (0.3 s idle, seconds on a loaded machine), in
        # whichever thread allocated, and an engine working through a burst sent nothing
        # meanwhile. No collection first: what garbage startup left is bounded, and a
        # full pass here would add its 0.3 s to every engine start.
        gc.freeze()
        self._start_io_threads()
        try:
            self.run_busy_loop()
            if self.stop_notice and self.linger_ms > 0:
                self._send_stop_notice()
        except Exception as exc:
            self._on_fatal(exc)
        finally:
            self._stop_requested = True
            self._close()
        return self._exit_code

    def _send_stop_notice(self) -> None:
        """A requested stop with ``stop_notice``: finish every request in flight with
        ABORT (as vLLM's engines do on SIGTERM), then send ENGINE_CORE_DEAD so that the
        front-end routes nothing more here (a vLLM front-end cannot take a stopped engine
        back, and its own client would otherwise never notice)."""
        ids = sorted(self._in_flight)
        self._in_flight.clear()
        if ids:
            self.engine.abort_requests(ids)
            self._send_outputs(
                self._outputs(
                    outputs=[
                        EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT) for rid in ids
                    ],
                    # Always named, as vLLM's engines name the requests they finish
                    # outside a step (a front-end's output handler forgets them by it).
                    finished_requests=set(ids),
                )
            )
        logger.info(
            "engine %d stopping: aborted %d request(s), telling the front-end",
            self.engine_index,
            len(ids),
        )
        self._send_engine_dead()
        # A front-end that already left must not hold the exit for the full linger.
        self.linger_ms = min(self.linger_ms, 2000)

    def request_stop(self, discard_pending: bool = False) -> None:
        """Ask the busy loop to stop after the current step. Safe in signal handlers.

        ``discard_pending`` drops unsent outputs instead of lingering to deliver them
        (when the front-end is known to be gone).
        """
        if discard_pending:
            self.linger_ms = 0
        self._stop_requested = True
        self.input_queue.put(STOP)

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`request_stop` was called or the loop is going down."""
        return self._stop_requested

    def _start_io_threads(self) -> None:
        name = f"corewire-engine-{self.engine_index}"
        self._output_thread = threading.Thread(
            target=self._output_thread_main, name=f"{name}-output", daemon=True
        )
        self._input_thread = threading.Thread(
            target=self._input_thread_main, name=f"{name}-input", daemon=True
        )
        self._output_thread.start()
        self._input_thread.start()

    def _close(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:
            logger.exception("engine shutdown() failed")
        for log in (self._malformed_log, self._refused_log, self._duplicate_log):
            log.close()
        self._input_stop.set()
        self.output_queue.put(STOP)
        deadline = time.monotonic() + self.linger_ms / 1000 + 2.0
        threads = [t for t in (self._input_thread, self._output_thread) if t is not None]
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            # A send blocked on a peer that went away: the threads are daemons and die
            # with the process; terminating the context now would hang on their sockets.
            logger.warning("engine I/O threads did not stop in time")
            return
        self._ctx.term()

    # ------------------------------------------------------------------ busy loop

    def run_busy_loop(self) -> None:
        """Alternate between applying queued input and stepping the engine."""
        while not self._stop_requested:
            self._process_input_queue()
            self._report_load()
            if self._stop_requested:
                break
            self._process_engine_step()
            self._report_load()
            self._flush_deferred_replies()

    def _has_work(self) -> bool:
        """Whether the loop should step instead of blocking on input."""
        return self.engine.has_unfinished_requests()

    def _process_input_queue(self) -> None:
        """Block for input while there is no work, or while the output queue is full
        (backpressure: input is still applied, nothing is stepped), then apply
        everything queued."""
        get = self.input_queue.get
        while not self._stop_requested:
            if not self._has_work():
                if self._pending_finished:
                    self._flush_finished()
                try:
                    item = get(timeout=self.idle_poll_s)
                except queue.Empty:
                    self._refused_log.flush()
                    self._duplicate_log.flush()
                    continue
            elif self.output_queue.qsize() >= OUTPUT_QUEUE_HIGH and self._output_full():
                try:
                    item = get(timeout=_PAUSE_POLL_S)
                except queue.Empty:
                    continue
            else:
                break
            if item is not RESUME:
                self._handle_input(item)
        # Bounded: behind a burst of input the loop still steps every _INPUT_SLICE_S, so
        # outputs keep flowing, and a front-end's health check sees an engine at work
        # (docs/protocol.md §7.1), not one that went silent for as long as the burst.
        deadline = time.monotonic() + _INPUT_SLICE_S
        handled = 0
        while not self._stop_requested:
            try:
                item = get(block=False)
            except queue.Empty:
                return
            if item is not RESUME:
                self._handle_input(item)
            handled += 1
            if not handled % 256 and time.monotonic() > deadline:
                return

    def _output_full(self) -> bool:
        """Pause stepping until the output thread reports room; False when the queue
        drained meanwhile. The output thread posts ``RESUME`` on the input queue."""
        if not self._output_paused:
            self._output_paused = True
            self.output_pauses += 1
        # Checked again after the flag is set: the output thread may have drained the
        # queue before it could see the flag (the poll timeout covers any other race).
        if self.output_queue.qsize() > OUTPUT_QUEUE_LOW:
            return True
        self._output_paused = False
        return False

    def _process_engine_step(self) -> bool:
        """Step the engine once if it has work; return whether outputs were sent."""
        if not self._has_work():
            return False
        outputs = self._make_outputs(self.engine.step())
        if outputs is None:
            return False
        self._send_outputs(outputs, step=True)
        return True

    def _make_outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs | None:
        """Wrap one step's outputs; None when there is nothing to send."""
        finished: set[str] | None = None
        if self.include_finished_set:
            finished = self._pending_finished
            self._pending_finished = set()
        in_flight = self._in_flight
        for out in outputs:
            if out.finish_reason is not None:
                in_flight.pop(out.request_id, None)
                if finished is not None:
                    finished.add(out.request_id)
        if not outputs and not finished:
            return None
        return self._outputs(
            outputs=outputs,
            scheduler_stats=self._scheduler_stats(),
            finished_requests=finished or None,
        )

    def _scheduler_stats(self) -> dict[str, Any] | None:
        """Stats attached to each output message (None unless ``log_stats``)."""
        return self.engine.scheduler_stats() if self.log_stats else None

    def _send_outputs(
        self, outputs: EngineCoreOutputs, client_index: int = 0, *, step: bool = False
    ) -> None:
        """Queue outputs for the output thread.

        ``client_index`` indexes :attr:`output_addresses`. With several client
        sockets, request outputs are instead split by the client that sent each request
        (``client_index`` then only routes a message that carries no request outputs).
        ``step``: one engine step made them; a protocol with ``weight_version`` stamps
        the current one on them (as :class:`~corewire.wire.outputs.StepOutputs`).
        """
        version = self.weight_version if step and self._stamps_weight_version else None
        if len(self.output_addresses) == 1 or outputs.utility_output is not None:
            if version is not None:
                self.output_queue.put((client_index, StepOutputs(outputs, version)))
            else:
                self.output_queue.put((client_index, outputs))
            return
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for out in outputs.outputs:
            index = self._request_clients.get(out.request_id, 0)
            if out.finish_reason is not None:
                self._request_clients.pop(out.request_id, None)
            by_client.setdefault(index, []).append(out)
        if not by_client:
            by_client[client_index] = []
        for index, outs in by_client.items():
            message = msgspec.structs.replace(outputs, outputs=outs)
            self.output_queue.put(
                (index, message if version is None else StepOutputs(message, version))
            )

    def _flush_finished(self) -> None:
        """Report aborted ids while idle, so a DP front-end can forget them."""
        finished, self._pending_finished = self._pending_finished, set()
        self._send_outputs(
            self._outputs(scheduler_stats=self._scheduler_stats(), finished_requests=finished)
        )

    def _outputs(self, **fields: Any) -> EngineCoreOutputs:
        """An output message of this engine, stamped now (see
        :func:`~corewire.engine.link.engine_outputs`)."""
        return engine_outputs(self.engine_index, **fields)

    @property
    def coordinator_index(self) -> int | None:
        """Index of the coordinator's PUSH among the output sockets (None: none)."""
        return None if self.coordinator_output is None else len(self.output_addresses)

    def _to_coordinator(self, outputs: EngineCoreOutputs) -> None:
        """Queue ``outputs`` for the DP coordinator (dropped without one)."""
        index = self.coordinator_index
        if index is not None:
            self.output_queue.put((index, outputs))

    def _report_load(self) -> None:
        """Hook run after each pass over the input queue, each step and each abort: a DP
        engine tells its coordinator its request counts if they changed. Nothing here."""

    # ------------------------------------------------------------------ requests

    def _handle_input(self, item: InputItem) -> None:
        try:
            self._dispatch_input(item)
        finally:
            self._flush_deferred_replies()

    def _dispatch_input(self, item: InputItem) -> None:
        if isinstance(item, AddRequest):
            self._handle_add(item.request)
        elif isinstance(item, AbortRequests):
            self._handle_abort(item.request_ids)
        elif isinstance(item, UtilityCall):
            self._handle_utility(item.client_index, item.call_id, item.method, item.args)
        elif isinstance(item, StartWave):
            self._handle_start_dp_wave(item.wave, item.exclude_engine_index)
        elif isinstance(item, WaveComplete):
            self._handle_wave_complete(item.wave)
        elif isinstance(item, AddRefused):
            self._refuse_undecoded(item.request_id, item.client_index, item.reason)
        elif isinstance(item, IOFailed):
            raise RuntimeError("fatal error in an engine I/O thread") from item.error
        elif item is STOP:
            self._stop_requested = True

    def _handle_add(self, request: EngineCoreRequest) -> None:
        """Hand a new request to the engine; a rejected request finishes with ERROR, a
        duplicate of a request in flight is dropped (see the module docstring)."""
        request_id = request.request_id
        if self._in_flight.get(request_id) is False:
            self._duplicate_log.warning(
                "dropping an ADD for request %r: a request with that id is in flight",
                request_id,
            )
            return
        if (
            self._refusing_new_requests()
            and not request.abort_immediately
            and request_id not in self._in_flight
        ):
            # Generation is paused (0.33.0's pause_generation): retry later, says vLLM.
            # The next input of an open streaming session (still in flight: duplicates
            # were dropped above) is not new work, and goes on, as in vLLM.
            self._finish_with_error(request_id, request.client_index, None, error=PAUSED_ERROR)
            return
        limit = self._check_limits(request)
        if limit is not None:
            self._finish_with_error(
                request_id, request.client_index, limit, error=_validation_error(limit)
            )
            return
        try:
            self.engine.add_request(request)
        except Exception as exc:
            reason = reason_for(exc)
            # The request's fault (a ValueError / TypeError) is a validation error; any
            # other is the engine's, reported as vLLM reports one: ERROR alone.
            error = _validation_error(reason) if isinstance(exc, (ValueError, TypeError)) else None
            self._finish_with_error(request_id, request.client_index, reason, exc, error)
            return
        self._in_flight[request_id] = request.resumable
        if len(self.output_addresses) > 1:
            self._request_clients[request_id] = request.client_index

    def _refusing_new_requests(self) -> bool:
        """Whether new ADDs are refused as paused (0.33.0's ``pause_generation``)."""
        utilities = self._protocol_utilities
        return utilities is not None and utilities.refuse_new_requests

    def _check_limits(self, request: EngineCoreRequest) -> str | None:
        """Why ``request`` exceeds the engine's limits, checked before it costs anything
        (the engine would otherwise validate, and maybe run, a prompt of any size)."""
        limit = self.engine_info.max_model_len
        if request.prompt_token_ids is not None:
            length = len(request.prompt_token_ids)
        else:
            shape = getattr(request.prompt_embeds, "shape", None)
            length = int(shape[0]) if shape else 0
        if length > limit:
            return f"prompt of {length} tokens exceeds max_model_len {limit}"
        return None

    def _refuse_undecoded(self, request_id: str, client_index: int, error: str) -> None:
        """An ADD the input thread refused without decoding it (it did not decode, or
        its header declared a prompt over the limit) but whose request id it read."""
        if request_id in self._in_flight:
            # Finishing it would end the running request's stream: drop it instead.
            self._duplicate_log.warning(
                "dropping a refused ADD for request %r: a request with that id is in flight",
                request_id,
            )
            return
        reason = safe_reason(error)
        self._finish_with_error(request_id, client_index, reason, error=_validation_error(reason))

    def _finish_with_error(
        self,
        request_id: str,
        client_index: int,
        reason: str | None,
        cause: BaseException | None = None,
        error: RequestError | None = None,
    ) -> None:
        """Finish a request the engine never took with ERROR; ``reason`` (already safe
        to show) goes to the client in ``stop_reason``, ``cause`` only to the log, and
        ``error`` (a protocol that has the field: 0.33.0 on) in ``error``."""
        shown = reason if reason is not None else (error.message if error else None)
        self._refused_log.warning(
            "request %r refused: %s", request_id, shown if cause is None else repr(cause)
        )
        if not 0 <= client_index < len(self.output_addresses):
            client_index = 0  # never an extra socket (a DP coordinator's) by mistake
        if len(self.output_addresses) > 1:
            # _send_outputs routes request outputs by this map, and forgets the id.
            self._request_clients[request_id] = client_index
        self._send_outputs(
            self._outputs(
                outputs=[
                    finish_output(self.protocol, request_id, FinishReason.ERROR, reason, error)
                ],
                # Always named, as vLLM's engines name a refused request whatever
                # include_finished_set says (vLLM 0.33.0's output handler needs it).
                finished_requests={request_id},
            ),
            client_index,
        )

    def _handle_abort(self, request_ids: list[str]) -> None:
        """Abort requests in the engine (errors here are fatal: engine state is unknown)."""
        self.engine.abort_requests(request_ids)
        for request_id in request_ids:
            self._request_clients.pop(request_id, None)
            self._in_flight.pop(request_id, None)
        if self.include_finished_set:
            self._pending_finished.update(request_ids)
        # Aborts may arrive while the loop waits for input (a paused scheduler holding
        # requests): the load changed now, not at the next step.
        self._report_load()

    def _handle_start_dp_wave(self, new_wave: int, exclude_engine_index: int) -> None:
        """START_DP_WAVE: only meaningful with data parallelism; ignored here."""
        logger.debug("ignoring START_DP_WAVE(%d, %d)", new_wave, exclude_engine_index)

    def _handle_wave_complete(self, wave: int) -> None:
        """WAVE_COMPLETE from corewire's coordinator; ignored without data parallelism."""
        logger.debug("ignoring WAVE_COMPLETE(%d)", wave)

    # ------------------------------------------------------------------ utilities

    def _handle_utility(self, client_index: int, call_id: int, method: str, args: list) -> None:
        try:
            result = self._resolve_utility(method)(*args)
        except Exception as exc:
            self._reply_utility(client_index, call_id, method, failure=exc)
            return
        if isinstance(result, concurrent.futures.Future):

            def _done(future: concurrent.futures.Future) -> None:
                if threading.get_ident() == self._loop_thread_id:
                    self._deferred_replies.append((client_index, call_id, method, future))
                else:
                    self._reply_future(client_index, call_id, method, future)

            result.add_done_callback(_done)
        else:
            self._reply_utility(client_index, call_id, method, result)

    def _reply_future(
        self, client_index: int, call_id: int, method: str, future: concurrent.futures.Future
    ) -> None:
        try:
            value = future.result()
        except BaseException as exc:  # CancelledError is a BaseException
            self._reply_utility(client_index, call_id, method, failure=exc, fresh=True)
        else:
            self._reply_utility(client_index, call_id, method, value, fresh=True)

    def _flush_deferred_replies(self) -> None:
        """Send the replies of futures completed on the busy-loop thread; call after
        queueing the outputs produced alongside them (the base loop does)."""
        while self._deferred_replies:
            replies, self._deferred_replies = self._deferred_replies, []
            for client_index, call_id, method, future in replies:
                self._reply_future(client_index, call_id, method, future)

    def engine_core_counters(self) -> dict[str, int]:
        """Input this process dropped or refused since it started (the utility call
        ``engine_core_counters``): frames that did not decode, ADDs dropped for reusing
        the id of a request in flight, requests finished with ERROR at once, the
        warnings about them left out of the log, and the times the loop paused stepping
        because the front-end was not taking its outputs (backpressure)."""
        logs = (self._malformed_log, self._refused_log, self._duplicate_log)
        return {
            "malformed_frames": self._malformed_log.total,
            "duplicate_requests": self._duplicate_log.total,
            "refused_requests": self._refused_log.total,
            "log_lines_suppressed": sum(log.suppressed for log in logs),
            "output_pauses": self.output_pauses,
            "input_pauses": self.input_pauses,
        }

    def _resolve_utility(self, method: str) -> Any:
        if method in self.PROC_UTILITIES:
            return getattr(self, method)
        if method in self._protocol_utility_names:
            return getattr(self._protocol_utilities, method)
        return self._engine_utility(method)

    def _engine_utility(self, method: str) -> Any:
        """The engine's own utility ``method``, or the default answer for it."""
        if method.startswith("_") or method in INTERFACE_METHODS:
            raise AttributeError(f"{Bounded(method)!r} is not a utility method")
        fn = getattr(self.engine, method, None)
        if fn is None and method in DEFAULT_UTILITIES:
            fn = getattr(self._utility_defaults, method)
        if fn is None:
            raise AttributeError(f"engine has no utility method {Bounded(method)!r}")
        if not callable(fn):
            raise TypeError(f"{Bounded(method)!r} is not callable")
        return fn

    def _reply_utility(
        self,
        client_index: int,
        call_id: int,
        method: str,
        value: Any = None,
        *,
        failure: BaseException | None = None,
        fresh: bool = False,
    ) -> None:
        """Encode a utility reply now (so that an unsendable result becomes a failure
        reply naming the method) and queue the frames."""
        # Future callbacks run on arbitrary threads; the shared encoder is not reentrant.
        encoder = Encoder(protocol=self.protocol) if fresh else self._utility_encoder
        wire = self._wire_message
        if failure is not None:
            frames = encoder.encode(wire(self._utility_failure(call_id, method, failure)))
        else:
            try:
                frames = encoder.encode(
                    wire(
                        self._outputs(
                            utility_output=UtilityOutput(call_id, None, UtilityResult(value))
                        )
                    )
                )
            except (TypeError, ValueError, OverflowError) as exc:
                err = TypeError(f"result of type {type(value).__name__} cannot be sent: {exc}")
                frames = encoder.encode(wire(self._utility_failure(call_id, method, err)))
        self.output_queue.put((client_index, _Encoded(frames)))

    def _wire_message(self, message: Any) -> Any:
        """``message`` in this engine's protocol layout (for frames encoded outside the
        output thread)."""
        return message if self._to_wire is None else self._to_wire(message)

    def _utility_failure(
        self, call_id: int, method: str, failure: BaseException
    ) -> EngineCoreOutputs:
        if not isinstance(failure, concurrent.futures.CancelledError):
            logger.debug("utility call %s failed: %r", bounded(method), bounded(failure))
        message = utility_failure_text(method, failure)
        return self._outputs(utility_output=UtilityOutput(call_id, message, None))

    # ------------------------------------------------------------------ fatal

    def _on_fatal(self, exc: BaseException) -> None:
        logger.error("engine core hit a fatal error, shutting down", exc_info=exc)
        self._exit_code = 1
        self._send_engine_dead()

    def _send_engine_dead(self) -> None:
        """Queue ENGINE_CORE_DEAD for every client socket, once per process."""
        with self._dead_lock:
            if self._dead_sent:
                return
            self._dead_sent = True
        self.output_queue.put((0, ENGINE_CORE_DEAD))

    # ------------------------------------------------------------------ input thread

    def configure_socket(self, sock: zmq.Socket, address: str) -> None:
        """Hook run on every socket just before it connects to ``address`` (e.g. to
        apply CURVE keys for ``tcp://`` peers); does nothing here."""

    def _ready_message(self) -> dict[str, Any]:
        """The ready response, sent once on each request link when it is connected, in
        the keys this engine's protocol asks for (``ready_layouts.ready_response_for``)."""
        return ready_layouts.ready_response_for(
            self.protocol,
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

    # ------------------------------------------------------------------ output thread

    def _output_thread_main(self) -> None:
        sockets: list[zmq.Socket] = []
        linger = self.linger_ms
        hwm = ((zmq.SNDHWM, OUTPUT_SNDHWM),)
        peers = PeerWatch()

        def configure(sock: zmq.Socket[Any], address: str) -> None:
            self.configure_socket(sock, address)
            peers.attach(sock)  # before the connect, so that no connection goes unseen

        try:
            for address in self.output_addresses:
                sockets.append(
                    connect_socket(
                        self._ctx,
                        zmq.PUSH,
                        address,
                        linger_ms=self.linger_ms,
                        options=hwm,
                        configure=configure,
                    )
                )
            if self.coordinator_output is not None:
                # No linger: load reports are disposable, and a coordinator that is gone
                # must not hold this process at exit.
                sockets.append(self._connect(zmq.PUSH, self.coordinator_output, options=hwm))
            self._output_loop(sockets, peers)
            if time.monotonic() - self._output_blocked_at < 1.0:
                # The front-end was not reading lately: what ZeroMQ still queues may
                # never be taken, and must not hold the exit for the whole linger.
                linger = min(linger, _STOP_LINGER_MS)
        except _Abandoned:
            logger.warning(
                "engine %d stopping: the front-end took no output for %.1f s; dropping "
                "%d unsent message(s)",
                self.engine_index,
                _STOP_SEND_WAIT_S,
                self.output_queue.qsize(),
            )
            linger = 0
        except Exception as exc:
            logger.exception("engine output thread failed")
            with self._dead_lock:
                first = not self._dead_sent
                self._dead_sent = True
            if first:
                for sock in sockets[: len(self.output_addresses)]:
                    with contextlib.suppress(zmq.ZMQError):
                        sock.send(ENGINE_CORE_DEAD, flags=zmq.NOBLOCK)
            self.input_queue.put(IOFailed(exc))
        finally:
            clients = len(self.output_addresses)
            # Lingering delivers what is queued to a front-end still there; for one that
            # has gone it would only hold the exit (docs/protocol.md §7).
            gone = [not peers.has_peer(sock) for sock in sockets[:clients]]
            peers.close()
            if any(gone) and linger > 0:
                logger.info(
                    "engine %d stopping: no front-end connected on %d output link(s); "
                    "not waiting to deliver what is left there",
                    self.engine_index,
                    sum(gone),
                )
            for sock, no_peer in zip(sockets[:clients], gone, strict=True):
                sock.close(linger=0 if no_peer else min(linger, self.linger_ms))
            for sock in sockets[clients:]:
                # close(linger=) would override the coordinator socket's LINGER of 0.
                sock.close(linger=0)

    def _output_loop(self, sockets: list[zmq.Socket], peers: PeerWatch) -> None:
        """Encode and send until the stop sentinel (``peers``: polled whenever the queue
        is empty).

        Payloads are encoded into reusable bytearrays. ZeroMQ sends large frames without
        copying, so a buffer is reused only once its tracker says ZeroMQ released it;
        until then it waits in ``in_flight`` together with its frames (which keep the
        aux arrays alive too).
        """
        encoder = Encoder(protocol=self.protocol)
        to_wire = self._to_wire
        free: list[bytearray] = []
        in_flight: collections.deque[tuple[zmq.MessageTracker, bytearray, list[Any]]] = (
            collections.deque()
        )
        num_clients = len(self.output_addresses)
        output_queue = self.output_queue
        get = output_queue.get
        qsize = output_queue.qsize
        wait = self._wait_writable
        SNDMORE = zmq.SNDMORE
        NOBLOCK = zmq.NOBLOCK
        Again = zmq.Again
        while True:
            if self._output_paused and qsize() <= OUTPUT_QUEUE_LOW:
                self._output_paused = False
                self.input_queue.put(RESUME)
            if not qsize():
                peers.poll()
            item = get()
            if item is STOP:
                return
            index, message = item
            if message is ENGINE_CORE_DEAD:
                self._send_dead(sockets[:num_clients])
                continue
            sock = sockets[index] if -len(sockets) <= index < len(sockets) else sockets[0]
            if isinstance(message, _Encoded):
                wait(sock)
                sock.send_multipart(message.frames, copy=False)
                continue
            if to_wire is not None:
                message = to_wire(message)
            buf = _take_buffer(in_flight, free)
            frames = encoder.encode_into(message, buf)
            # The payload's own tracker decides when `buf` is free again: the one
            # send_multipart returns belongs to the last frame, which for a small aux
            # frame (copied) is done at once while ZeroMQ still holds the payload.
            last = len(frames) - 1
            # Only a message's first part can block (ZeroMQ takes the rest once it took
            # the first): when the front-end stopped reading, wait for room.
            try:
                tracker = sock.send(buf, (SNDMORE if last else 0) | NOBLOCK, copy=False, track=True)
            except Again:
                wait(sock)
                tracker = sock.send(buf, SNDMORE if last else 0, copy=False, track=True)
            for i in range(1, last + 1):
                sock.send(frames[i], SNDMORE if i < last else 0, copy=False)
            if not isinstance(tracker, zmq.MessageTracker) or tracker.done:
                free.append(buf)
            else:
                in_flight.append((tracker, buf, frames))

    def _send_dead(self, client_sockets: list[zmq.Socket]) -> None:
        """ENGINE_CORE_DEAD to every client (output thread)."""
        for sock in client_sockets:
            self._wait_writable(sock)
            sock.send(ENGINE_CORE_DEAD)

    def _wait_writable(self, sock: zmq.Socket) -> None:
        """Return once ``sock`` takes a message; raise :class:`_Abandoned` when a stop
        was requested and the front-end took nothing for ``_STOP_SEND_WAIT_S``."""
        if sock.poll(0, zmq.POLLOUT):
            return
        deadline = None
        self._output_blocked_at = time.monotonic()
        while not sock.poll(50, zmq.POLLOUT):
            now = self._output_blocked_at = time.monotonic()
            if self._stop_requested:
                if deadline is None:
                    deadline = now + _STOP_SEND_WAIT_S
                elif now > deadline:
                    raise _Abandoned


class _InputDecoder:
    """Decodes request frames on the input thread and queues them for the busy loop.

    A frame that does not decode is logged (rate-limited), counted and dropped; it never
    stops the thread. When a broken ADD still names its request id, or a broken UTILITY
    its call id, the sender gets an answer (an ERROR finish, a failure reply) instead of
    waiting forever; the ids are read by :func:`~corewire.engine.frame_head.read_head`,
    which needs no recursion, so a frame nested past any decoder's limit is answered too.
    """

    def __init__(self, proc: EngineCoreProc) -> None:
        self._proc = proc
        self._queue_put = proc.input_queue.put
        self._qsize = proc.input_queue.qsize
        # The protocol's request layout (0.33.0 appends fields, and its LoRA differs).
        self._add_decoder = request_decoder(proc.protocol, for_engine=True)
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
