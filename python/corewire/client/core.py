"""The client base: sockets, engine processes, the ready handshake, death handling.

Wire format: docs/protocol.md §2 (sockets and identities) and §3 (start-up).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq
import zmq.asyncio

from corewire import releases
from corewire.client._resources import ClientResources
from corewire.client.futures import complete_future
from corewire.client.input_backlog import (
    DEFAULT_MAX_INPUT_BACKLOG,
    FROM_ENVIRONMENT,
    InputBacklog,
    message_bytes,
    resolve_max_input_backlog,
)
from corewire.client.ready import ReadyWait
from corewire.codec import Encoder, native_decoder
from corewire.curve import require_curve_for
from corewire.engine.startup import check_engine_spec, engine_process_main
from corewire.errors import EngineDeadError, UtilityError
from corewire.ipcdir import make_private_dir
from corewire.protocol import engine_identity, failed_method
from corewire.wire.requests import request_writer, utility_args_writer

__all__ = [
    "DEFAULT_ENGINE_MAIN",
    "DEFAULT_MAX_INPUT_BACKLOG",
    "MPClient",
    "make_output_decoder",
    "resolve_utility_output",
]

logger = logging.getLogger("corewire.client")

#: Process target that runs an engine core (see ``corewire.engine.launch``).
DEFAULT_ENGINE_MAIN = "corewire.engine.launch:run_engine_core"
#: Seconds to wait for every engine's ready message (vLLM waits as long: model loading).
DEFAULT_READY_TIMEOUT_S = 600.0
#: Utility method the health check calls: cheap, and every vLLM-style engine has it.
HEALTH_CHECK_METHOD = "is_sleeping"
#: Default ``max_output_backlog``: outputs (plus one per message) decoded and waiting for
#: the consumer, past which the client stops reading its output socket. 64 full batches
#: of 1024 requests: a consumer that keeps up with its engine never comes near it, and
#: it bounds a slow one's backlog to tens of MB.
DEFAULT_MAX_OUTPUT_BACKLOG = 65536
#: ZeroMQ's receive high-water mark (messages) of the output socket when the backlog is
#: bounded: what waits undecoded in this process once the client stopped reading; past
#: it the engines' sends block and their loops pause.
OUTPUT_RCVHWM = 128


def make_output_decoder(release: str | None = None) -> Any:
    """The decoder of engine output frames: the Rust ``NativeDecoder`` of ``release``
    (None: the default version)."""
    return native_decoder(release)


def _resolve(target: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(target):
        return target
    module_name, sep, attr = target.partition(":")
    if not sep:
        raise ValueError(f"expected 'module:function', got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class MPClient:
    """Base of the clients that drive engine cores in other processes over ZeroMQ.

    It binds a ROUTER (requests) and a PULL (outputs) socket, on ``ipc://`` endpoints in
    a private 0700 directory unless ``client_addresses`` names others; starts one engine
    process per index in ``engine_indices`` (spawn), or uses engines started elsewhere
    when ``client_addresses`` is given; waits for every engine's ready message; and
    watches the processes. Every resource belongs to :attr:`resources`, released by
    :meth:`shutdown` or, when the client is collected, by a finalizer.

    Parameters:
        engine: ``"module:Class"`` of the engine to run, or None for the reference engine.
        engine_args: keyword arguments for the engine class.
        client_addresses: ``{"input_address": ..., "output_address": ...}``: bind these
            and wait for engines started elsewhere (``corewire engine``) to connect.
        engine_indices: engine indices (ZeroMQ identities) to start or wait for.
        client_index: stamped on requests and utility calls (several front-ends).
        ready_timeout: seconds to wait for the engines' ready messages.
        engine_main: process target with the signature of
            ``corewire.engine.launch.run_engine_core`` (a callable or "module:function");
            for engines that speak the protocol without ``EngineCoreProc``.
        engine_options: more keyword arguments for every engine process.
        max_output_backlog: outputs received and not yet taken by the consumer (each
            message counts one more than its outputs), past which the client stops
            reading its output socket until the consumer took half of them; ZeroMQ's
            high-water marks then block the engines' sends and their loops pause
            stepping (backpressure: nothing is dropped). None: unbounded, as vLLM.
            Utility replies travel behind the outputs sent before them and wait as they
            do; a health check does not count the time the backlog was full.
        max_input_backlog: bytes sent toward one engine that ZeroMQ has not released
            yet (the engine has not read them), past which new requests wait for room:
            ``add_request_async`` awaits, ``SyncMPClient.add_request`` blocks up to its
            timeout (:class:`~corewire.errors.InputBacklogTimeout`). Bounded per engine
            (:mod:`corewire.client.input_backlog` says why these bytes); aborts and
            utility calls never wait; nothing is dropped. Default: the environment's
            ``COREWIRE_MAX_INPUT_BACKLOG`` (bytes; ``none`` for unbounded), else
            ``DEFAULT_MAX_INPUT_BACKLOG`` (64 MiB). None: unbounded, as vLLM.
        protocol: the vLLM version the engines speak (any release of
            ``corewire.releases.SUPPORTED``; default ``corewire.releases.DEFAULT``, the
            installed vLLM's release, else the newest), in both directions: it picks the
            decoder of their outputs and the layout of what is sent. A ``"0.33.0"``
            client writes 0.33.0's ``EngineCoreRequest`` whether it is given
            ``corewire.protocol.EngineCoreRequest`` (converted by field name, see
            :mod:`corewire.wire.requests`) or
            ``corewire.wire.layouts.types_for("0.33.0")["EngineCoreRequest"]``, and
            ``add_lora``'s LoRA in 0.33.0's layout; a ``"0.25.1"`` client sends what it
            is given (its encoder refuses 0.33.0's structs). The engines a client
            starts are told it (``release=`` to the process target).
    """

    #: Subclasses (DP) may define ``process_engine_outputs(self, outputs)``, plain or
    #: async: it sees every output message before the queue does.
    process_engine_outputs: Callable[..., Any] | None = None
    #: Whether ``engine`` is checked in this process before engines start (the default
    #: process target's; another target may read ``engine`` its own way).
    _check_engine = False

    def __init__(
        self,
        *,
        asyncio_mode: bool,
        engine: str | None = None,
        engine_args: Mapping[str, Any] | None = None,
        client_addresses: Mapping[str, str] | None = None,
        engine_indices: Sequence[int] = (0,),
        client_index: int = 0,
        client_count: int = 1,
        ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
        engine_main: str | Callable[..., Any] = DEFAULT_ENGINE_MAIN,
        max_output_backlog: int | None = DEFAULT_MAX_OUTPUT_BACKLOG,
        max_input_backlog: Any = FROM_ENVIRONMENT,
        release: str | None = None,
        protocol: str | None = None,
        **engine_options: Any,
    ) -> None:
        #: The vLLM release whose wire the engines speak (checked before anything starts);
        #: ``protocol=`` is its deprecated name.
        self.release = releases.get(releases.named(release, protocol, type(self).__name__))
        if max_output_backlog is not None and max_output_backlog < 2:
            raise ValueError(f"max_output_backlog must be >= 2 or None, got {max_output_backlog}")
        #: The output backlog's high-water mark (None: unbounded); see the class docstring.
        self.max_output_backlog = max_output_backlog
        #: The input backlog's bound in bytes per engine (None: unbounded); see the class
        #: docstring.
        self.max_input_backlog = resolve_max_input_backlog(max_input_backlog)
        self.client_index = client_index
        self.client_count = client_count
        self.engine = engine
        self.engine_args = dict(engine_args or {})
        self.engine_options = engine_options
        self.ready_timeout = ready_timeout
        self.encoder = Encoder(release=self.release)
        # None for 0.25.1: its requests go out as given, with no per-request cost.
        self._write_request = request_writer(self.release)
        self._write_utility_args = utility_args_writer(self.release)
        self.decoder = self._make_output_decoder()
        ctx = zmq.Context(io_threads=1)
        self.ctx = ctx
        # The finalizer owns everything; nothing in `resources` points back to `self`.
        self.resources = resources = ClientResources(ctx)
        self._finalizer = weakref.finalize(self, resources)
        success = False
        try:
            if client_addresses is None:
                resources.ipc_dir = make_private_dir("ipc")
                self.input_address = f"ipc://{resources.ipc_dir}/input"
                self.output_address = f"ipc://{resources.ipc_dir}/output"
            else:
                self.input_address = client_addresses["input_address"]
                self.output_address = client_addresses["output_address"]
            self.input_socket = self._make_socket(zmq.ROUTER, self.input_address)
            self.output_socket = self._make_socket(
                zmq.PULL, self.output_address, asyncio_mode=asyncio_mode
            )
            self.engine_indices = list(engine_indices)
            #: ZeroMQ identities of the engines, in index order (2 bytes little-endian).
            self.core_engines = [engine_identity(i) for i in self.engine_indices]
            self.core_engine = self.core_engines[0]
            self._launch_engines(engine_main, external=client_addresses is not None)
            #: Ready message of each engine (identity -> map; empty when it sent none).
            self.ready_info = self._wait_for_ready(self.core_engines, ready_timeout)
            resources.start_monitor()
            success = True
        finally:
            if not success:
                self._finalizer()

    # -- setup -----------------------------------------------------------------------

    def _make_output_decoder(self) -> Any:
        """The decoder of this client's output frames (a front-end adapter may configure
        its own, e.g. stats types)."""
        return make_output_decoder(self.release)

    def _launch_engines(self, engine_main: str | Callable[..., Any], external: bool) -> None:
        """Start the engines, once the sockets are bound and before the ready wait.

        Engines started elsewhere (``external``) connect by themselves; a front-end
        adapter that launches engines its own way (vLLM's handshake) overrides this.
        """
        if not external:
            self._engine_main = _resolve(engine_main)
            self._check_engine = engine_main == DEFAULT_ENGINE_MAIN
            self._start_engine_processes(self.engine_indices)

    def _make_socket(self, kind: int, address: str, *, asyncio_mode: bool = False) -> Any:
        """Bind a socket of ``kind`` on ``address``; it belongs to :attr:`resources`."""
        if asyncio_mode:
            sock: Any = zmq.asyncio.Socket(self.ctx, kind)
        else:
            sock = self.ctx.socket(kind)
        self.resources.loop_side.sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        # Unbounded queues, as vLLM: a full ROUTER pipe would drop requests silently. The
        # output PULL of a bounded backlog has a finite receive limit, which drops
        # nothing: its engines' sends block (backpressure).
        sock.setsockopt(zmq.SNDHWM, 0)
        bounded = kind == zmq.PULL and self.max_output_backlog is not None
        sock.setsockopt(zmq.RCVHWM, OUTPUT_RCVHWM if bounded else 0)
        # The plain client has no CURVE: an address other hosts can reach would let anyone
        # who reaches the port inject requests, so only ipc:// and loopback TCP are bound.
        require_curve_for(address, None)
        sock.bind(address)
        return sock

    def _engine_process_kwargs(self, index: int) -> dict[str, Any]:
        """Keyword arguments of engine ``index``'s process target (DP adds its own).

        A client of another protocol than the default passes it on (``release=``), so
        that the engines it starts speak it; a default client passes nothing, as before
        (a process target of its own need not take the argument)."""
        kwargs = {
            "engine_index": index,
            "input_address": self.input_address,
            "output_address": self.output_address,
            "engine": self.engine,
            "engine_args": self.engine_args,
            "parent_pid": os.getpid(),
            **self.engine_options,
        }
        if self.release != releases.DEFAULT:
            kwargs["release"] = self.release
        return kwargs

    def _start_engine_processes(
        self, indices: Sequence[int], *, joining: bool = False
    ) -> list[Any]:
        """Start one engine process per index (spawn); they belong to :attr:`resources`
        (``joining``: not watched until admitted, see :meth:`ProcessGroup.add_engine`)."""
        if indices and self._check_engine:
            # What this process can check fails here, before any process starts.
            check_engine_spec(self.engine, self.engine_args)
        ctx = multiprocessing.get_context("spawn")
        started = []
        for index in indices:
            name = f"corewire-engine-{index}"
            report = self._startup_report_path(name)
            if report is not None and os.path.exists(report):
                os.unlink(report)  # an earlier process's (scale-up after a failed one)
            proc = ctx.Process(
                target=engine_process_main,
                args=(self._engine_main, report),
                kwargs=self._engine_process_kwargs(index),
                name=name,
                daemon=True,
            )
            proc.start()
            self.resources.processes.add_engine(index, proc, joining=joining)
            started.append(proc)
        return started

    def _startup_report_path(self, process_name: str) -> str | None:
        """Where engine process ``process_name`` reports why it failed to start (see
        :mod:`corewire.engine.startup`); None without a private ipc directory."""
        ipc_dir = self.resources.ipc_dir
        return None if ipc_dir is None else os.path.join(ipc_dir, f"{process_name}.startup-error")

    def _wait_for_ready(
        self, identities: Sequence[bytes], timeout: float
    ) -> dict[bytes, dict[str, Any]]:
        """Wait until every engine in ``identities`` has sent its ready message.

        Raises ``RuntimeError`` when a local process exits first and ``TimeoutError``
        after ``timeout`` seconds, naming the engines that are missing.
        """
        return self._ready_wait(identities, self.resources.processes.handles(), timeout).wait()

    def _ready_wait(
        self, identities: Sequence[bytes], processes: Sequence[Any], timeout: float
    ) -> ReadyWait:
        """A ready handshake with the engines ``identities`` on the ROUTER, failing when
        one of ``processes`` exits first."""
        return ReadyWait(
            self.input_socket,
            identities,
            processes,
            timeout,
            address=self.input_address,
            report_path=self._startup_report_path,
            on_unexpected=self._unexpected_ready(),
        )

    def _unexpected_ready(self) -> Callable[[bytes, dict[str, Any]], None] | None:
        """Who takes a ready message from an engine a ready wait did not wait for (None:
        it is logged); a client whose engines may rejoin hands it on."""
        return None

    # -- state -----------------------------------------------------------------------

    @property
    def engine_pids(self) -> list[int]:
        """Process ids of the engine processes this client started (none for external
        engines)."""
        return self.resources.processes.engine_pids

    @property
    def engine_ranks_managed(self) -> list[int]:
        """Indices (data-parallel ranks) of the engines this client drives (vLLM's name)."""
        return list(self.engine_indices)

    def dp_engines_running(self) -> bool:
        """Whether a data-parallel group is in a running wave; always False without DP."""
        return False

    @property
    def engine_dead(self) -> bool:
        """Whether the engine died (or the client was shut down)."""
        return self.resources.engine_dead

    @property
    def protocol_errors(self) -> int:
        """Engine frames that broke the protocol so far. Each failed alone: a frame that
        named requests was raised to the output consumer (``ProtocolError.request_ids``),
        a utility reply to its caller, and one that named neither was dropped (counted
        here, logged, and in the ``corewire_protocol_errors_total`` metric)."""
        return self.resources.bad_frames.total

    def ensure_alive(self) -> None:
        """Raise :class:`EngineDeadError` if the engine is dead or the client closed."""
        if self.resources.engine_dead:
            raise self.resources.dead_error()

    def _format_exception(self, exc: BaseException) -> BaseException:
        """The exception a caller sees: :class:`EngineDeadError` once the engine is dead."""
        if self.resources.engine_dead and not isinstance(exc, EngineDeadError):
            return self.resources.dead_error()
        return exc

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engines and release every resource; idempotent.

        Pending calls and output waiters get :class:`EngineDeadError`. ``timeout`` is how
        long the engines get to exit after SIGTERM before they are killed (vLLM's
        signature; default ``TERMINATE_GRACE_S``).
        """
        if timeout is not None:
            self.resources.processes.terminate_grace = max(0.0, timeout)
        self._finalizer()

    def __enter__(self) -> MPClient:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    # -- sending ---------------------------------------------------------------------

    def _input_backlog(self, engine: bytes) -> InputBacklog:
        """The input backlog of ``engine`` (made on first use: engines come and go)."""
        backlogs = self.resources.input_backlogs
        backlog = backlogs.get(engine)
        if backlog is None:
            backlog = backlogs[engine] = InputBacklog(self.max_input_backlog)
            if self.resources.engine_dead:  # its death reached the backlogs made before
                backlog.fail(self.resources.dead_error())
        return backlog

    def _engine_dead_error(self) -> EngineDeadError | None:
        """The death error once the engine is dead or the client closed, else None."""
        resources = self.resources
        return resources.dead_error() if resources.engine_dead else None

    def _send_message(
        self, engine: bytes, request_type: bytes, frames: list[Any], keep: Any
    ) -> None:
        """Send ``[engine, request_type, *frames]`` now (a ROUTER never blocks).

        With aux frames, ZeroMQ sends views of caller memory: ``keep`` (the objects that
        own it) stays alive in the send tracker until ZeroMQ is done with them.

        The bytes count toward ``engine``'s input backlog; this never waits for room
        (callers that must, wait before: :class:`InputBacklog`).
        """
        resources = self.resources
        if resources.engine_dead:
            raise resources.dead_error()
        backlog = resources.input_backlogs.get(engine) or self._input_backlog(engine)
        mark = backlog.high is not None and backlog.note(message_bytes(frames))
        pending = resources.tracker
        if len(pending):
            pending.reap()  # release finished sends' tensors now, not at the next big send
        # Plain sends cost a third of one send_multipart (no per-part checks).
        send = self.input_socket.send
        send(engine, zmq.SNDMORE)
        send(request_type, zmq.SNDMORE)
        last = len(frames) - 1
        if not last:
            if mark:
                # A marker (see InputBacklog): explicit zero-copy, or pyzmq would copy a
                # small frame and its tracker would be done at once.
                frame = zmq.Frame(frames[0], copy=False, track=True)
                backlog.marked(send(frame, copy=False, track=True))
            else:
                send(frames[0], copy=False)
            return
        for i in range(last):
            send(frames[i], zmq.SNDMORE, copy=False)
        # ZeroMQ frees a message's parts in order, so the last part's tracker covers them
        # all, but only if that part is not copied: pyzmq copies parts under its copy
        # threshold, whose trackers are done at once. An explicit zero-copy Frame is not.
        tracker = send(zmq.Frame(frames[last], copy=False, track=True), copy=False, track=True)
        pending.track(tracker, keep)
        if mark:
            backlog.marked(tracker)


def resolve_utility_output(future: Any, utility: Any) -> None:
    """Complete a pending utility ``future`` (asyncio or concurrent) from its reply."""
    message = utility.failure_message
    if message is None:
        result = utility.result
        complete_future(future, None if result is None else result.result)
    else:
        complete_future(future, exc=UtilityError(message, failed_method(message)))
