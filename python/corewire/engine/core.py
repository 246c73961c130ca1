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

import gc
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec
import zmq

from corewire import releases
from corewire.codec import Encoder
from corewire.dp_messages import StartWave, WaveComplete
from corewire.engine.core_input import InputThread
from corewire.engine.core_output import OUTPUT_QUEUE_HIGH, OUTPUT_QUEUE_LOW, OutputThread
from corewire.engine.core_utilities import RELEASE_UTILITIES, UtilityAnswers
from corewire.engine.inputs import (
    RESUME,
    STOP,
    AbortRequests,
    AddRefused,
    AddRequest,
    InputItem,
    IOFailed,
)
from corewire.engine.interface import Engine
from corewire.engine.link import engine_outputs
from corewire.engine.logthrottle import ThrottledWarning
from corewire.engine.ready import engine_info_of
from corewire.engine.reasons import reason_for, safe_reason
from corewire.engine.utilities import UtilityDefaults
from corewire.engine.utilities_0_33_0 import PAUSED_ERROR, utility_names
from corewire.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    UtilityCall,
    engine_identity,
)
from corewire.wire.layouts import RequestError
from corewire.wire.outputs import (
    DEFAULT_WEIGHT_VERSION,
    StepOutputs,
    finish_output,
    output_converter,
)

__all__ = ["EngineCoreProc"]

logger = logging.getLogger("corewire.engine")

# How often a paused loop looks at the output queue again if no resume note came.
_PAUSE_POLL_S = 0.05
# The longest the busy loop applies queued input before it steps again.
_INPUT_SLICE_S = 0.05


def _address_list(address: str | Sequence[str], link: str) -> list[str]:
    """One address or several (one per front-end client) as a list; at least one."""
    addresses = [address] if isinstance(address, str) else list(address)
    if not addresses:
        raise ValueError(f"at least one {link} address is required")
    return addresses


def _validation_error(reason: str) -> RequestError:
    """The ``RequestError`` of a request refused for itself (vLLM's front-end answers
    it with 400; only a protocol with the error field sends it)."""
    return RequestError("validation_error", reason)


class EngineCoreProc(InputThread, OutputThread, UtilityAnswers):
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

    ``release`` is the vLLM version whose wire the engine speaks (any release of
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
        release: str | None = None,
        protocol: str | None = None,
    ) -> None:
        if not 0 <= engine_index < 1 << 16:
            raise ValueError(f"engine_index must fit in 2 bytes, got {engine_index}")
        #: The vLLM version whose wire this engine speaks (``corewire.releases``).
        self.release = releases.get(releases.named(release, protocol, type(self).__name__))
        # Converts each queued message into the protocol's layout on the output thread
        # (None: engines' structs are that layout already, nothing to do).
        self._to_wire = output_converter(self.release)
        # Whether step messages carry a weight version (a release whose EngineCoreOutputs
        # has the field: 0.33.0 on).
        self._stamps_weight_version = self.release.weight_versions
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
        utilities = self.release.choose(RELEASE_UTILITIES)
        self._release_utilities = None if utilities is None else utilities(self)
        self._release_utility_names = (
            frozenset()
            if self._release_utilities is None
            else utility_names(type(self._release_utilities))
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
        self._utility_encoder = Encoder(release=self.release)
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
        utilities = self._release_utilities
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
                    finish_output(self.release, request_id, FinishReason.ERROR, reason, error)
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
