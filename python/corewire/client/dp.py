"""Data-parallel clients: :class:`DPAsyncMPClient` and :class:`DPLBAsyncMPClient`.

A data-parallel (DP) group is N engine processes run by one DP coordinator
(:mod:`corewire.coordinator`). Both clients:

- start the coordinator (unless ``coordinator_addresses`` names one another front-end
  started) and the engines this front-end owns, with the DP options they need;
- keep ``current_wave``, ``engines_running`` and ``lb_engines`` (``[waiting, running]``
  per engine they route to, ``[waiting, running, kv_cache_usage]`` from vLLM 0.33.0's
  coordinator; both are read, :mod:`corewire.client.dp_counts`) up to date from the
  coordinator's publications, in a task started lazily on first use
  (``corewire-dp-stats-task``);
- stamp ``client_index`` and ``current_wave`` on every request, and, with
  ``release="0.25.1"``, send the coordinator a first-request notice ``[engine_index,
  current_wave]`` when they put a request on an engine while the group is paused, so
  the other engines wake (START_DP_WAVE). With ``release="0.33.0"`` they send none: in
  vLLM 0.33.0 the engines start waves themselves (an idle engine that gets a request
  asks its coordinator), and 0.33.0's coordinator logs an error for such a notice;
- fan utility calls out to every engine they own and return engine 0's result
  (:meth:`DPAsyncMPClient.call_utility_consensus_async` insists the engines agree);
- die as a whole: the death of any engine (or of the coordinator) fails every waiter with
  :class:`~corewire.EngineDeadError`, as in vLLM.

:class:`DPAsyncMPClient` is for external load balancing: one front-end per engine (pass
``data_parallel_rank``), the front-ends sharing one coordinator.
:class:`DPLBAsyncMPClient` is one front-end over all N engines: it routes each request to
the least-loaded engine (:class:`corewire._native.Router`), sends aborts to the engine that
holds the request (``reqs_in_flight``), and scales the group while serving
(:meth:`DPLBAsyncMPClient.scale_elastic_ep`).

Engines on other hosts: ``data_parallel_address="tcp://HOST:PORT"`` makes the front-end
and the coordinator listen on four consecutive ports there too (requests, outputs,
coordinator stats, coordinator waves; see :class:`~corewire.coordinator.TcpEndpoints`), in
addition to the private ``ipc://`` endpoints its local engines use. A non-loopback HOST
requires ``curve_keys`` (a directory written by ``corewire keygen``): then only engines
holding an authorized key can connect. ``data_parallel_size_local`` engines (indices
``0 .. local-1``) start here; the others join with
``corewire engine --connect tcp://HOST:PORT --engine-index K --curve-keys DIR``.

Engines on a Ray cluster: ``data_parallel_backend="ray"`` (with ``ray_placement=
corewire.RayPlacement(...)``) places every engine this front-end drives as a Ray actor in
a placement group instead of starting processes; they connect back to the TCP endpoints
of ``data_parallel_address`` (chosen on this node's address unless given), behind CURVE
with keys the client makes (:mod:`corewire.client.ray_engines`). The loss of an actor or
of its node is the group's death, as any engine's.

Wire format: docs/protocol.md §8 (data-parallel coordination) and §5.6 (elastic-scaling
notifications).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from corewire._native import Router
from corewire.client._resources import ClientResources
from corewire.client.async_client import AsyncMPClient
from corewire.client.dp_counts import decode_publication, router_counts
from corewire.client.dp_loss import EngineLossMixin
from corewire.client.engine_loss import RESTART_LIMIT
from corewire.client.late_interaction import late_interaction_rank
from corewire.client.processes import stop_processes
from corewire.coordinator import CoordinatorAddresses, DPCoordinator, TcpEndpoints
from corewire.curve import is_loopback_address
from corewire.dp_messages import XPUB_SUBSCRIBE, FirstRequest, ScaleNotice
from corewire.engine.startup import check_engine_spec
from corewire.errors import ProtocolError
from corewire.keygen import CurveAuthenticator, CurveServerKeys, apply_server
from corewire.logtext import bounded
from corewire.protocol import (
    REQUEST_ABORT,
    REQUEST_ADD,
    EEPNotificationType,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    engine_identity,
    engine_index_of,
    finished_outputs,
)
from corewire.releases import get as get_release
from corewire.wire.outputs import output_converter

if TYPE_CHECKING:
    from corewire.client.ray_engines import RayBackend, RayPlacement

__all__ = ["DPAsyncMPClient", "DPConsensusError", "DPLBAsyncMPClient"]

logger = logging.getLogger("corewire.client")

#: How long a scaling step may take (engine start-up excluded: that is ``ready_timeout``).
SCALE_STEP_TIMEOUT_S = 30.0


class DPConsensusError(RuntimeError):
    """Engines of a DP group answered the same utility call differently."""

    def __init__(self, method: str, results: Sequence[Any]) -> None:
        super().__init__(f"engines disagree on {method}: {list(results)!r:.500}")
        self.method = method
        self.results = list(results)


class DPAsyncMPClient(AsyncMPClient):
    """Asyncio client of a data-parallel group with external load balancing.

    Drives the engine ``data_parallel_rank`` of a group of ``data_parallel_size`` (or the
    ``engine_indices`` given), sharing the group's coordinator with the other
    front-ends: the first front-end starts it (``coordinator_addresses`` None) and the
    others pass its :attr:`coordinator_addresses`. ``data_parallel_backend``: ``"mp"``
    (engines as child processes, the default) or ``"ray"`` (Ray actors placed by
    ``ray_placement``, a :class:`~corewire.RayPlacement`; see the module docstring).
    Other parameters as :class:`~corewire.AsyncMPClient`; see the module docstring for
    the DP behaviour.
    """

    def __init__(
        self,
        *,
        data_parallel_size: int = 1,
        data_parallel_rank: int = 0,
        engine_indices: Sequence[int] | None = None,
        data_parallel_size_local: int | None = None,
        data_parallel_address: str | None = None,
        coordinator_addresses: CoordinatorAddresses | None = None,
        curve_keys: str | None = None,
        data_parallel_backend: str = "mp",
        ray_placement: RayPlacement | None = None,
        **kwargs: Any,
    ) -> None:
        if data_parallel_backend not in ("mp", "ray"):
            raise ValueError(
                f"data_parallel_backend must be 'mp' or 'ray', got {data_parallel_backend!r}"
            )
        if ray_placement is not None and data_parallel_backend != "ray":
            raise ValueError("ray_placement needs data_parallel_backend='ray'")
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if engine_indices is None:
            engine_indices = self._default_engine_indices(data_parallel_size, data_parallel_rank)
        engine_indices = list(engine_indices)
        if any(not 0 <= i < data_parallel_size for i in engine_indices):
            raise ValueError(f"engine indices {engine_indices} outside 0..{data_parallel_size - 1}")
        local = (
            len(engine_indices) if data_parallel_size_local is None else data_parallel_size_local
        )
        #: Engines of the group, and those this front-end starts (the first ``local``).
        self.data_parallel_size = data_parallel_size
        self._local_indices = set(engine_indices[:local])
        #: The Ray side of the engines (``data_parallel_backend="ray"``), else None.
        self.ray_backend: RayBackend | None = None
        if data_parallel_backend == "ray":
            if local != len(engine_indices):
                raise ValueError(
                    "with data_parallel_backend='ray' Ray places every engine this "
                    "front-end drives: leave data_parallel_size_local unset"
                )
            if coordinator_addresses is not None:
                # Another front-end's coordinator would not know the keys this client
                # makes for its engines (nor listen where they could reach it).
                raise ValueError(
                    "with data_parallel_backend='ray' the client starts its group's own "
                    "coordinator: leave coordinator_addresses unset"
                )
            if kwargs.get("client_addresses") is not None:
                raise ValueError(
                    "with data_parallel_backend='ray' the client binds its own endpoints "
                    "(data_parallel_address names the TCP ones): leave client_addresses unset"
                )
            from corewire.client.ray_engines import RayBackend

            self.ray_backend = RayBackend.prepare(
                ray_placement, data_parallel_address, curve_keys, len(engine_indices)
            )
            data_parallel_address = self.ray_backend.data_parallel_address
            curve_keys = self.ray_backend.server_keys_dir
        try:
            self._set_up_group(
                data_parallel_size,
                engine_indices,
                data_parallel_address,
                coordinator_addresses,
                curve_keys,
                kwargs,
            )
        except BaseException:
            if self.ray_backend is not None:
                self.ray_backend.close()
            raise

    def _set_up_group(
        self,
        data_parallel_size: int,
        engine_indices: list[int],
        data_parallel_address: str | None,
        coordinator_addresses: CoordinatorAddresses | None,
        curve_keys: str | None,
        kwargs: dict[str, Any],
    ) -> None:
        """The rest of ``__init__``: the TCP endpoints, the coordinator, the client."""
        self._tcp: TcpEndpoints | None = None
        self._server_keys: CurveServerKeys | None = None
        if data_parallel_address is not None:
            self._listen_on(data_parallel_address, curve_keys)
        elif len(self._local_indices) < len(engine_indices):
            raise ValueError("engines on other hosts need data_parallel_address='tcp://HOST:PORT'")
        self._zap: CurveAuthenticator | None = None
        self._coordinator: DPCoordinator | None = None
        if coordinator_addresses is None:
            self._coordinator = self._start_coordinator(
                data_parallel_size, curve_keys, kwargs.get("release")
            )
            coordinator_addresses = self._coordinator.addresses
        #: Where this group's coordinator listens (give it to the other front-ends).
        self.coordinator_addresses = coordinator_addresses
        #: Wave state from the coordinator (see :mod:`corewire.coordinator`).
        self.current_wave = 0
        self.engines_running = False
        #: ``[waiting, running]`` per engine this front-end routes to, from the coordinator
        #: (``[waiting, running, kv_cache_usage]`` from vLLM 0.33.0's, and before the
        #: first publication when ``release="0.33.0"``, as vLLM 0.33.0's client).
        self._idle_counts: list[Any] = (
            [0, 0, 0.0] if get_release(kwargs.get("release")).counts_carry_kv_usage else [0, 0]
        )
        self.lb_engines: list[list[Any]] = [list(self._idle_counts) for _ in engine_indices]
        self._stats_socket: Any = None
        self._stats_task: asyncio.Task[None] | None = None
        self._stats_waiters: list[tuple[int, asyncio.Future[None]]] = []
        try:
            super().__init__(engine_indices=engine_indices, **kwargs)
        except BaseException:
            if self._coordinator is not None:
                self._coordinator.shutdown()
            raise
        # vLLM 0.33.0's front-ends send none (its engines start the waves).
        self._first_request_notices = not self.release.engine_led_waves
        if self._coordinator is not None:
            # Watched and stopped with the engines: its death kills the client too.
            self.resources.processes.set_coordinator(self._coordinator)

    def _listen_on(self, data_parallel_address: str, curve_keys: str | None) -> None:
        """Plan the TCP endpoints of ``data_parallel_address`` (bound with the sockets),
        behind CURVE with ``curve_keys``, which a non-loopback address requires."""
        self._tcp = TcpEndpoints.from_address(data_parallel_address)
        if curve_keys is not None:
            self._server_keys = CurveServerKeys.from_dir(curve_keys)
        elif not is_loopback_address(data_parallel_address):
            raise ValueError(
                f"listening on {data_parallel_address} exposes the engines to other "
                "hosts: pass curve_keys (write them with `corewire keygen DIR`), or use "
                "a loopback address"
            )

    def _start_coordinator(
        self, size: int, curve_keys: str | None, release: str | None
    ) -> DPCoordinator:
        """Start the group's coordinator (this is the first front-end), with the TCP
        endpoints of ``data_parallel_address`` for engines on other hosts, publishing in
        ``release``'s shape (called before the client's own attributes are set)."""
        remote = None
        if self._tcp is not None:
            remote = (self._tcp.coordinator_stats, self._tcp.coordinator_publish)
        return DPCoordinator(
            size,
            remote=remote,
            curve_server_dir=curve_keys if self._server_keys is not None else None,
            release=release,
        )

    @staticmethod
    def _default_engine_indices(size: int, rank: int) -> list[int]:
        """External load balancing: this front-end drives engine ``rank`` only."""
        return [rank]

    def dp_engines_running(self) -> bool:
        """Whether the group is in a running wave (from the coordinator's publications)."""
        return self.engines_running

    @property
    def coordinator_pid(self) -> int | None:
        """Process id of the coordinator this client started, if it started one."""
        return None if self._coordinator is None else self._coordinator.pid

    # -- setup hooks of MPClient ---------------------------------------------------------

    def _make_socket(self, kind: int, address: str, *, asyncio_mode: bool = False) -> Any:
        if not is_loopback_address(address):
            # The base class binds ``client_addresses`` plainly: only the TCP endpoints of
            # data_parallel_address get CURVE, so nothing else may face other hosts.
            raise ValueError(
                f"binding {address} exposes the engines to other hosts: use "
                "data_parallel_address='tcp://HOST:PORT' with curve_keys instead"
            )
        sock = super()._make_socket(kind, address, asyncio_mode=asyncio_mode)
        if kind == zmq.ROUTER:
            # A replacement engine connects under the identity of the one it replaces: it
            # takes the identity over even if the dead peer's connection lingers.
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self._tcp is not None and kind in (zmq.ROUTER, zmq.PULL):
            # Local engines use the private ipc endpoint bound above; engines on other
            # hosts come in over TCP, behind CURVE when keys are given.
            if self._server_keys is not None:
                if self._zap is None:
                    self._zap = CurveAuthenticator(self.ctx, self._server_keys.authorized)
                    self.resources.threads.add(self._zap.thread, self._zap.stop)
                apply_server(sock, self._server_keys)
            sock.bind(self._tcp.input if kind == zmq.ROUTER else self._tcp.output)
        return sock

    def _start_engine_processes(
        self, indices: Sequence[int], *, joining: bool = False
    ) -> list[Any]:
        if self.ray_backend is not None:
            return self._start_ray_engines(indices, joining=joining)
        local = [i for i in indices if i in self._local_indices]
        return super()._start_engine_processes(local, joining=joining)

    def _ray_engine_options(self, indices: Sequence[int]) -> dict[int, dict[str, Any]]:
        """What each Ray actor's engine is built with: a local engine's options, but the
        TCP endpoints, the coordinator's remote links and the CURVE client keys."""
        backend = self.ray_backend
        assert backend is not None and self._tcp is not None
        if self._check_engine:
            check_engine_spec(self.engine, self.engine_args)
        links = list(self.coordinator_addresses.for_engine(remote=True))
        options = {}
        for index in indices:
            kwargs = self._engine_process_kwargs(index)
            kwargs.pop("parent_pid", None)  # Ray ends an actor whose owner exits
            kwargs.update(
                input_address=self._tcp.input,
                output_address=self._tcp.output,
                coordinator_addresses=links,
                curve_keys=backend.client_keys,
            )
            options[index] = kwargs
        return options

    def _start_ray_engines(self, indices: Sequence[int], *, joining: bool) -> list[Any]:
        """Place the engines at ``indices`` as Ray actors (one placement group), which
        connect to this front-end's TCP endpoints; their handles join the process group
        as local processes would."""
        backend = self.ray_backend
        assert backend is not None
        if not indices:
            return []
        options = self._ray_engine_options(indices)
        # Released with the client, after its engines stopped (a start that fails
        # half-way included).
        if backend.close not in self.resources.after_processes:
            self.resources.after_processes.append(backend.close)
        return self._admit_ray_engines(
            backend.engines.start(options, timeout=self.ready_timeout), joining
        )

    def _admit_ray_engines(self, handles: list[Any], joining: bool) -> list[Any]:
        """Own the started actors' handles (client thread: the process group's rule)."""
        resources = self.resources
        for handle in handles:
            resources.processes.add_engine(handle.index, handle, joining=joining)
        return handles

    async def _start_joining_engines(self, indices: list[int]) -> list[Any]:
        """Start the engines a scale-up adds. On Ray, placing them (waiting for the
        cluster's resources) runs off the event loop, which keeps serving."""
        backend = self.ray_backend
        if backend is None:
            return self._start_engine_processes(indices, joining=True)
        options = self._ray_engine_options(indices)
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        placing = loop.run_in_executor(
            None,
            lambda: backend.engines.start(options, timeout=self.ready_timeout, cancel=cancel),
        )
        try:
            handles = await asyncio.shield(placing)
        except asyncio.CancelledError:
            # The placement runs on in its thread until it sees ``cancel``; what it started
            # by then is owned (stopped with the client) and retired at once.
            cancel.set()
            placing.add_done_callback(self._retire_abandoned)
            raise
        return self._admit_ray_engines(handles, joining=True)

    def _retire_abandoned(self, placing: asyncio.Future[list[Any]]) -> None:
        """A cancelled scale-up's Ray engines arrived after all: own, then stop them."""
        if placing.cancelled() or placing.exception() is not None:
            return  # nothing started (a failed start leaves nothing behind)
        handles = self._admit_ray_engines(placing.result(), joining=True)
        if self.resources.closed:
            self.resources.processes.stop()  # the client is gone: stop them here
            return
        indices = [h.index for h in handles]
        retired = self.resources.processes.retire_engines(indices)
        task = asyncio.get_running_loop().create_task(self._stop_retired(retired, indices))
        self.resources.loop_side.add_task(task)

    async def _stop_retired(self, procs: list[Any], indices: Sequence[int]) -> None:
        """Stop engines retired from the group (off the loop), then release what Ray
        reserved for them."""
        await asyncio.get_running_loop().run_in_executor(None, stop_processes, procs)
        if self.ray_backend is not None:
            self.ray_backend.engines.release(indices)

    def _engine_process_kwargs(self, index: int) -> dict[str, Any]:
        kwargs = super()._engine_process_kwargs(index)
        kwargs["data_parallel_size"] = self.data_parallel_size
        kwargs["coordinator_addresses"] = self.coordinator_addresses.for_engine()
        return kwargs

    # -- coordinator stats -------------------------------------------------------------

    def _ensure_stats_update_task(self) -> None:
        """Start the task that follows the coordinator's publications; idempotent."""
        resources = self.resources
        if self._stats_task is not None or resources.closed:
            return
        loop = self._bind_loop()
        sock = zmq.asyncio.Socket(self.ctx, zmq.XSUB)
        resources.loop_side.sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.coordinator_addresses.front_publish)
        self._stats_socket = sock
        self._send_to_coordinator(XPUB_SUBSCRIBE)
        self._stats_task = task = loop.create_task(
            _stats_update_loop(weakref.ref(self), resources, sock),
            name="corewire-dp-stats-task",
        )
        resources.loop_side.add_task(task)

    def _apply_stats(self, counts: list[list[Any]] | None, wave: int, running: bool) -> None:
        """One publication ``[counts, current_wave, engines_running]`` arrived; ``counts``
        is None when only the wave state changed (vLLM's coordinator sends that)."""
        self.current_wave = wave
        self.engines_running = running
        if counts is None:
            return
        idle = self._idle_counts
        if counts and len(counts[0]) != len(idle):
            idle = [0, 0, 0.0] if len(counts[0]) == 3 else [0, 0]
        self.lb_engines = [
            counts[i] if i < len(counts) else list(idle) for i in self.engine_indices
        ]
        for size, waiter in list(self._stats_waiters):
            if len(counts) == size and not waiter.done():
                waiter.set_result(None)

    def _send_to_coordinator(self, payload: bytes) -> None:
        """Queue ``payload`` for the coordinator on the stats socket (loop thread).

        Through the asyncio socket, never a raw view of it: a raw send may consume the
        edge of ZeroMQ's descriptor that the stats task's pending receive waits for,
        and that receive would then never wake again.
        """
        sent = self._stats_socket.send(payload, zmq.NOBLOCK)  # done at once (NOBLOCK)
        if sent.done() and not sent.cancelled() and sent.exception() is not None:
            logger.debug("message to the DP coordinator dropped: %s", sent.exception())

    def _send_first_request_notice(self, engine_index: int) -> None:
        # Assume running until the coordinator says otherwise: one notice per pause.
        self.engines_running = True
        self._send_to_coordinator(FirstRequest(engine_index, self.current_wave).encode())

    async def _tell_coordinator_size(self, size: int) -> None:
        """Send ``["scale", size]`` and wait until the coordinator publishes ``size``;
        raises :class:`~corewire.EngineDeadError` as soon as the group dies."""
        self.ensure_alive()
        self._ensure_stats_update_task()
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        entry = (size, waiter)
        self._stats_waiters.append(entry)
        try:
            self._send_to_coordinator(ScaleNotice(size).encode())
            deadline = loop.time() + SCALE_STEP_TIMEOUT_S
            # Nothing completes this waiter when the group dies: look every half second.
            while not waiter.done():
                self.ensure_alive()
                if loop.time() > deadline:
                    raise TimeoutError(f"the DP coordinator did not adopt size {size}")
                await asyncio.wait((waiter,), timeout=0.5)
        finally:
            self._stats_waiters.remove(entry)

    # -- requests ------------------------------------------------------------------------

    def get_core_engine_for_request(self, request: EngineCoreRequest) -> bytes:
        """The engine a request goes to: its ``data_parallel_rank`` when set (it must be
        one of this front-end's engines), else this front-end's first engine."""
        rank = request.data_parallel_rank
        if rank is None:
            return self.core_engine
        if rank not in self.engine_indices:
            raise ValueError(
                f"data_parallel_rank {rank} is not an engine of this front-end "
                f"({self.engine_indices})"
            )
        return self.core_engines[self.engine_indices.index(rank)]

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        """Send a request (stamped with ``client_index`` and ``current_wave``) to its
        engine; wake the group if it is paused."""
        if self._stats_task is None:
            self._ensure_stats_update_task()
        request.client_index = self.client_index
        request.current_wave = self.current_wave
        if self._write_request is not None:
            request = self._write_request(request)
        # Encoded before routing: a request that cannot be encoded must not count as in
        # flight on an engine (that count would never come down).
        frames = self.encoder.encode(request)
        held = self._holds(request.request_id)
        engine = self.get_core_engine_for_request(request)
        # The bound is per engine: a request waits for room on the engine it was routed
        # to (a stopped engine holds back its own requests, not the group's), and a
        # caller that gives up un-notes its routing.
        backlog = self.resources.input_backlogs.get(engine) or self._input_backlog(engine)
        if backlog.must_wait():
            try:
                await backlog.wait_async()
            except BaseException:
                if not held:
                    self._unroute(request, engine)
                raise
            try:
                self._send_message(engine, REQUEST_ADD, frames, request)
            finally:
                backlog.pass_on()
        else:
            self._send_message(engine, REQUEST_ADD, frames, request)
        if not self.engines_running and self._first_request_notices:
            self._send_first_request_notice(engine_index_of(engine))
        if self.resources.output_task is None:
            self._ensure_output_queue_task()

    def _holds(self, request_id: str) -> bool:
        """Whether routing already records ``request_id`` on an engine (an open streaming
        session's next input): a wait given up must not forget it then."""
        return False

    def _unroute(self, request: EngineCoreRequest, engine: bytes) -> None:
        """Undo what routing ``request`` to ``engine`` recorded (it was not sent)."""

    # -- utilities -----------------------------------------------------------------------

    async def _call_all_engines(self, method: str, *args: Any) -> list[Any]:
        return list(
            await asyncio.gather(
                *(self._call_utility_async(method, *args, engine=e) for e in self.core_engines)
            )
        )

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Call ``method(*args)`` on every engine; return the first engine's result.

        Any engine's failure raises (:class:`~corewire.UtilityError`); a cancelled
        caller's calls are all forgotten.
        """
        return (await self._call_all_engines(method, *args))[0]

    async def call_utility_consensus_async(self, method: str, *args: Any) -> Any:
        """Like :meth:`call_utility_async`, but raise :class:`DPConsensusError` unless
        every engine returned the same value."""
        results = await self._call_all_engines(method, *args)
        first = results[0]
        if any(r != first for r in results[1:]):
            raise DPConsensusError(method, results)
        return first


class DPLBAsyncMPClient(EngineLossMixin, DPAsyncMPClient):
    """Asyncio client that load-balances over all engines of a data-parallel group.

    ``DPLBAsyncMPClient(data_parallel_size=N)`` starts N reference engines and the
    coordinator. Each request goes to the least-loaded engine by the coordinator's
    counts, floored by this client's own requests in flight (both scaled by
    ``client_count``, the front-ends routing over the same engines, and the rotation of
    ties starting at this client's share of them, as vLLM's client routes; see
    :class:`corewire._native.Router`); an explicit ``data_parallel_rank`` wins. With
    ``release="0.33.0"`` the waiting requests of an engine whose KV cache is more than
    half full weigh more, and a streaming session's inputs stay on one engine, as in vLLM
    0.33.0 (:mod:`corewire.client.dp_counts`, :meth:`get_core_engine_for_request`).
    Aborts go to the engine holding the request. :meth:`scale_elastic_ep` grows or
    shrinks the group while serving.

    Hybrid balancing (vLLM's ``--data-parallel-hybrid-lb``: one front-end per node over
    that node's ranks): ``engine_indices`` a run of consecutive ranks, such as ``[2, 3]``
    of a group of four; the router balances over those, on their slice of the
    coordinator's counts, as vLLM's client does.

    One engine lost (its process died, or the health watchdog found it hung):
    ``engine_loss="replace"`` (the default; ``COREWIRE_ENGINE_LOSS`` where the plugin
    builds the client) fails only its requests and calls, serves on the others and
    starts a new engine for the rank, at most ``engine_restart_limit`` times in 5
    minutes; ``"isolate"`` does not replace it; ``"fail"`` is vLLM's behaviour (the
    whole client dies). ``engines_coupled=True`` (engines that run collectives together)
    always fails whole. See :mod:`corewire.client.engine_loss`.
    """

    def __init__(
        self,
        *,
        data_parallel_size: int = 1,
        engine_loss: str | None = None,
        engines_coupled: bool = False,
        engine_restart_limit: int = RESTART_LIMIT,
        **kwargs: Any,
    ) -> None:
        self._init_engine_loss(engine_loss, engines_coupled, engine_restart_limit)
        indices = kwargs.get("engine_indices")
        indices = list(range(data_parallel_size)) if indices is None else list(indices)
        if not indices or indices != list(range(indices[0], indices[0] + len(indices))):
            # The router's choices are positions in core_engines: the engines must be one
            # run of ranks in order (all of them, or a node's own in hybrid balancing).
            raise ValueError(
                "DPLBAsyncMPClient drives consecutive engine ranks in order (0..size-1, or "
                f"a node's own ranks in hybrid balancing), got engine_indices={indices}"
            )
        # Engines report finished and aborted ids: reqs_in_flight is cleaned from them.
        kwargs.setdefault("include_finished_set", True)
        #: Request id -> index of the engine holding it (for aborts).
        self.reqs_in_flight: dict[str, int] = {}
        #: Open streaming-input sessions (``resumable`` requests; ``release="0.33.0"``
        #: only), whose aborts go to every engine.
        self.streaming_reqs: set[str] = set()
        # Every front-end routing over these engines (vLLM's API servers) starts at its
        # own share of them and counts its requests as that many front-ends' (vLLM's
        # client_count and client_index).
        self._router = Router(
            len(indices), kwargs.get("client_index", 0), kwargs.get("client_count", 1)
        )
        self._route = self._router.route
        self._note_finished = self._router.note_finished
        self._scale_lock: asyncio.Lock | None = None
        self._notifications: list[tuple[str, int]] = []
        self._notification_event: asyncio.Event | None = None
        super().__init__(data_parallel_size=data_parallel_size, **kwargs)
        # vLLM 0.33.0's KV-pressure rule (the counts carry kv_cache_usage from then on)
        # and its streaming-session affinity.
        rules = self.release
        self._kv_pressure = rules.kv_pressure_routing
        self._sessions = rules.session_affinity
        self._arm_engine_loss()

    @property
    def _starts_engines(self) -> bool:
        """Whether this client started its engines (it can start a replacement)."""
        return getattr(self, "_engine_main", None) is not None

    @staticmethod
    def _default_engine_indices(size: int, rank: int) -> list[int]:
        return list(range(size))

    @property
    def router(self) -> Router:
        """The routing state (in-flight counts, loads); for inspection."""
        return self._router

    def _apply_stats(self, counts: list[list[Any]] | None, wave: int, running: bool) -> None:
        super()._apply_stats(counts, wave, running)
        if counts is not None:
            # This client's engines' counts (a node's slice in hybrid balancing).
            self._router.update_counts(router_counts(self.lb_engines, self._kv_pressure))

    def get_core_engine_for_request(self, request: EngineCoreRequest) -> bytes:
        """Route ``request`` (least loaded, or its ``data_parallel_rank``) and remember
        which engine holds it.

        With ``release="0.33.0"``, as vLLM 0.33.0: a request whose id is in flight (the
        next input of a streaming session) goes to the engine that holds it, and a
        ``resumable`` request opens (a final, non-resumable one closes) a session in
        :attr:`streaming_reqs`. A late-interaction pooling request goes to the engine its
        query key names, as vLLM pins it (:mod:`corewire.client.late_interaction`)."""
        if self._sessions:
            if request.resumable:
                self.streaming_reqs.add(request.request_id)
            else:
                self.streaming_reqs.discard(request.request_id)
            index = self.reqs_in_flight.get(request.request_id)
            if index is not None and index < len(self.core_engines):
                return self.core_engines[index]
        rank = request.data_parallel_rank
        if rank is None and request.pooling_params is not None:
            rank = late_interaction_rank(request.pooling_params, len(self.core_engines))
        if rank is not None and self._claims:
            lost = self._lost_rank_error(self.engine_indices[0] + rank)
            if lost is not None:
                raise lost
        index = self._route(rank)
        self.reqs_in_flight[request.request_id] = index
        return self.core_engines[index]

    def _holds(self, request_id: str) -> bool:
        return request_id in self.reqs_in_flight

    # -- one engine lost (engine_loss; corewire.client.dp_loss) ------------------------------

    def _send_utility(
        self, method: str, args: tuple[Any, ...], engine: bytes
    ) -> tuple[asyncio.Future[Any], int]:
        lost = self._lost_rank_error(engine_index_of(engine))
        if lost is not None:
            raise lost
        future, call_id = super()._send_utility(method, args, engine)
        self._track_call(engine, call_id, future)
        return future, call_id

    async def _call_all_engines(self, method: str, *args: Any) -> list[Any]:
        if self.engine_loss == "fail":
            return await super()._call_all_engines(method, *args)
        return await self._call_live_engines(method, *args)

    def _probed_engines(self) -> list[bytes]:
        claims = self._claims
        return [e for e in super()._probed_engines() if engine_index_of(e) not in claims]

    def _unroute(self, request: EngineCoreRequest, engine: bytes) -> None:
        """Forget a request that waited for room on ``engine`` and was not sent: it is not
        in flight there (the router's count of it comes down)."""
        index = self.core_engines.index(engine) if engine in self.core_engines else None
        if index is not None and self.reqs_in_flight.get(request.request_id) == index:
            del self.reqs_in_flight[request.request_id]
            self._note_finished(index)

    def process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Output-task hook: forget finished requests (ids the engines report in
        ``finished_requests``, aborted ones included)."""
        finished = outputs.finished_requests
        if finished:
            pop = self.reqs_in_flight.pop
            note = self._note_finished
            for request_id in finished:
                index = pop(request_id, None)
                if index is not None:
                    note(index)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Abort requests by id, each on the engine that holds it; unknown ids (already
        finished) are skipped. An open streaming session (``release="0.33.0"``) is
        aborted on every engine, as vLLM 0.33.0 does: an input in flight when the session
        ended may have opened it again anywhere."""
        if not request_ids or self.resources.engine_dead:
            return
        by_engine: dict[int, list[str]] = {}
        get = self.reqs_in_flight.get
        sessions = self.streaming_reqs
        for request_id in request_ids:
            if sessions and request_id in sessions:
                sessions.discard(request_id)
                for every in range(len(self.core_engines)):
                    by_engine.setdefault(every, []).append(request_id)
                continue
            index = get(request_id)
            if index is not None and index < len(self.core_engines):
                by_engine.setdefault(index, []).append(request_id)
        for index, ids in by_engine.items():
            self._send_message(
                self.core_engines[index], REQUEST_ABORT, self.encoder.encode(ids), None
            )

    # -- elastic scaling -------------------------------------------------------------------

    async def eep_process_engine_core_notification(self, notification: Any) -> None:
        """Elastic-scaling notification ``[type, engine_rank]`` from an engine (call_id
        -1, delivered by the output task)."""
        try:
            kind, rank = notification
            entry = (str(kind), int(rank))
        except (TypeError, ValueError):
            logger.warning("ignoring malformed scaling notification %r", bounded(notification))
            return
        self._notifications.append(entry)
        if self._notification_event is not None:
            self._notification_event.set()

    async def _wait_notifications(self, expected: set[tuple[str, int]]) -> None:
        # ``expected`` holds EEPNotificationType members: a str enum, equal to (and
        # hashing like) the plain strings that arrive in the notifications.
        if self._notification_event is None:
            self._notification_event = asyncio.Event()
        event = self._notification_event
        while not expected <= set(self._notifications):
            self.ensure_alive()
            # An engine lost meanwhile sends nothing more: not waited for.
            expected = {e for e in expected if e[1] not in self._claims}
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), 0.5)
            except asyncio.TimeoutError:
                continue
        for entry in expected:
            self._notifications.remove(entry)

    async def scale_elastic_ep(self, new_size: int) -> None:
        """Grow or shrink the group to ``new_size`` engines while serving.

        Growing starts local engines ``old .. new_size-1`` and waits for them; shrinking
        finishes every request on engines ``new_size ..`` with ``FinishReason.ABORT``
        (none is lost silently) and stops them. The remaining engines, the coordinator and
        the routing all move to the new size before this returns. Calls are serialized.
        """
        if type(new_size) is not int or new_size < 1:
            raise ValueError(f"new_size must be a positive int, got {new_size!r}")
        if self.engine_indices[0] != 0:
            # As vLLM: elastic scaling is the whole group's, driven from rank 0.
            raise ValueError(
                "scale_elastic_ep needs the client of the whole group (engines from rank 0); "
                f"this one drives ranks {self.engine_indices}"
            )
        self._bind_loop()
        self.ensure_alive()
        if self._scale_lock is None:
            self._scale_lock = asyncio.Lock()
        async with self._scale_lock:
            # Leftovers of a step that failed half-way must not satisfy this step's waits.
            self._notifications.clear()
            self._ensure_stats_update_task()
            if self.resources.output_task is None:
                self._ensure_output_queue_task()
            old_size = len(self.core_engines)
            if new_size > old_size:
                await self._scale_up(old_size, new_size)
            elif new_size < old_size:
                await self._scale_down(old_size, new_size)

    async def _scale_up(self, old_size: int, new_size: int) -> None:
        new_indices = list(range(old_size, new_size))
        self.data_parallel_size = new_size
        self._local_indices.update(new_indices)
        # Not watched while they join: a new engine that fails to start fails this
        # scale-up (the ready wait watches it), not the client.
        identities = [engine_identity(i) for i in new_indices]
        try:
            procs = await self._start_joining_engines(new_indices)
            # On this loop: the ROUTER is used only from this thread.
            ready = self._ready_wait(identities, procs, self.ready_timeout)
            self.ready_info.update(await ready.wait_async(self.ensure_alive))
            self.resources.processes.admit(new_indices)
        except BaseException:
            # The group stays as it was: the new engines never joined it.
            retired = self.resources.processes.retire_engines(new_indices)
            await self._stop_retired(retired, new_indices)
            self.data_parallel_size = old_size
            self._local_indices.difference_update(new_indices)
            raise
        # The coordinator first: until it knows the new size it ignores the new engines'
        # reports (and their requests for a wave), so it could not wait for their work.
        await self._tell_coordinator_size(new_size)
        # Only now can the ROUTER address them: route and fan out to them from here on.
        self.engine_indices += new_indices
        self.core_engines += identities
        self.lb_engines += [list(self._idle_counts) for _ in new_indices]
        self._router.resize(new_size)
        await self._reconfigure(range(old_size), new_size)

    async def _scale_down(self, old_size: int, new_size: int) -> None:
        removed = list(range(new_size, old_size))
        # A lost engine among them has nothing to shut down, and sends no notice.
        lost = {i for i in removed if i in self._claims}
        removed_identities = [
            e for e in self.core_engines[new_size:] if engine_index_of(e) not in lost
        ]
        # No new request or utility call goes to the removed engines from here on.
        self._router.resize(new_size)
        del self.engine_indices[new_size:]
        del self.core_engines[new_size:]
        del self.lb_engines[new_size:]
        self.data_parallel_size = new_size
        # Their exit is expected now, not a death.
        procs = self.resources.processes.retire_engines(removed)
        try:
            await asyncio.wait_for(
                asyncio.gather(
                    *(
                        self._call_utility_async("shutdown_for_scale_down", engine=identity)
                        for identity in removed_identities
                    )
                ),
                SCALE_STEP_TIMEOUT_S,
            )
            await asyncio.wait_for(
                self._wait_notifications(
                    {(EEPNotificationType.SHUTDOWN_COMPLETE, i) for i in removed if i not in lost}
                ),
                SCALE_STEP_TIMEOUT_S,
            )
        finally:
            # Whatever happened, nothing may still wait on a removed engine's request.
            self._abort_leftovers(set(removed))
            await self._stop_retired(procs, removed)
            self._local_indices.difference_update(removed)
            for index in removed:
                self._claims.release(index)  # the rank is gone, not lost
                self._ended_losses.discard(index)
                self._lost_process.pop(index, None)
        await self._reconfigure(range(new_size), new_size)
        await self._tell_coordinator_size(new_size)

    async def _reconfigure(self, indices: Sequence[int], new_size: int) -> None:
        # A lost engine has nothing to reconfigure (its replacement starts at new_size).
        indices = [i for i in indices if i not in self._claims]
        await asyncio.wait_for(
            asyncio.gather(
                *(
                    self._call_or_lost("reconfigure_data_parallel", (new_size,), engine_identity(i))
                    for i in indices
                )
            ),
            SCALE_STEP_TIMEOUT_S,
        )
        await asyncio.wait_for(
            self._wait_notifications(
                {(EEPNotificationType.RECONFIGURE_FINISHED, i) for i in indices}
            ),
            SCALE_STEP_TIMEOUT_S,
        )

    def _abort_leftovers(self, removed: set[int]) -> None:
        """Finish, client-side, requests a removed engine never answered for (it died
        before aborting them): the caller sees ABORT instead of waiting forever."""
        leftovers = [rid for rid, index in self.reqs_in_flight.items() if index in removed]
        if not leftovers:
            return
        for rid in leftovers:
            del self.reqs_in_flight[rid]
        logger.warning("finishing %d request(s) of removed engines as aborted", len(leftovers))
        outputs = finished_outputs(leftovers, FinishReason.ABORT, engine_index=min(removed))
        # The consumer reads this release's fields (weight_version, error...): the same
        # conversion an engine of this release applies to what it sends.
        to_wire = output_converter(self.release)
        self.outputs_queue.put_nowait(outputs if to_wire is None else to_wire(outputs))


async def _stats_update_loop(
    client_ref: weakref.ref[DPAsyncMPClient], resources: ClientResources, sock: Any
) -> None:
    """Follow the coordinator's publications: only the latest of a burst matters."""
    raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
    try:
        while not resources.closed:
            frame = await sock.recv()
            # Edge-triggered: drain everything that is there, keep the newest.
            while True:
                try:
                    frame = raw.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
            try:
                counts, wave, running = decode_publication(frame)
            except ProtocolError as exc:
                logger.warning("ignoring a malformed coordinator publication: %s", bounded(exc))
                continue
            client = client_ref()
            if client is None:
                return
            try:
                client._apply_stats(counts, wave, bool(running))
            except (ValueError, TypeError, OverflowError) as exc:
                logger.warning("ignoring a malformed coordinator publication: %s", bounded(exc))
            del client
    except asyncio.CancelledError:
        raise
    except Exception:
        if not resources.closed:
            logger.exception("corewire DP stats task failed")
