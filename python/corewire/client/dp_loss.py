"""A load-balancing DP client that loses one engine and serves on (``engine_loss``).

:class:`EngineLossMixin` is the part of :class:`~corewire.DPLBAsyncMPClient` that acts
on :mod:`corewire.client.engine_loss`'s policies: it claims a death the engine monitor
or the health watchdog reports (:class:`_WeakLossHook`, on their threads), then on the
event loop ends what the lost engine held, takes it out of routing, calls and health
checks, tells corewire's coordinator, and with ``"replace"`` starts its replacement
(serialized with elastic scaling).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Sequence
from typing import Any, cast

import zmq

from corewire.client.engine_loss import (
    LossClaims,
    RestartBudget,
    engine_loss_policy,
    lost_outputs,
)
from corewire.client.futures import complete_future
from corewire.client.ready import parse_ready
from corewire.dp_messages import LostNotice
from corewire.errors import EngineDeadError, EngineLostError, ProtocolError
from corewire.protocol import REQUEST_ABORT, engine_identity, engine_index_of

__all__ = ["EngineLossMixin"]

logger = logging.getLogger("corewire.client")


async def _watch_rejoins(client_ref: Any, resources: Any) -> None:
    """Every :data:`REJOIN_POLL_S`, hand the ready messages of engines that connected to
    the client (a scaling step's own wait reads them while it runs)."""
    while not resources.engine_dead and not resources.closed:
        await asyncio.sleep(REJOIN_POLL_S)
        client = client_ref()
        if client is None:
            return
        lock = client._scale_lock
        if lock is None or not lock.locked():
            try:
                arrived = client._read_rejoins()
            except Exception:
                logger.exception("reading the ready messages of rejoining engines failed")
                arrived = []
            for index, info in arrived:
                client._rejoin_safely(index, info)
        del client


#: Seconds between tries to start a replacement that failed to start.
RETRY_DELAY_S = 1.0
#: How often the client looks for engines that rejoined (engines it did not start).
REJOIN_POLL_S = 0.25
#: :meth:`EngineLossMixin._replacement`'s answers (said in the log line of the loss).
STARTING = "starting a replacement"
AWAITING = "waiting for its launcher to start it again (it rejoins routing once ready)"
#: What a lost engine's part of a call to every engine is (left out of the answer).
_LOST = object()


class _WeakLossHook:
    """The client's :class:`~corewire.client.engine_loss.LossHook`, holding it weakly
    (the client's resources must not keep the client alive)."""

    def __init__(self, client: Any) -> None:
        self._client = weakref.ref(client)

    def claim(self, index: int, reason: str) -> bool:
        client = self._client()
        return client is not None and client._claim_loss(index, reason)

    def lost(self, index: int) -> None:
        client = self._client()
        if client is not None:
            client.resources.run_on_owner(lambda: client._engine_lost(index))


class EngineLossMixin:
    """``engine_loss`` for :class:`~corewire.DPLBAsyncMPClient` (see
    :mod:`corewire.client.engine_loss`); it uses that class's routing and DP state
    (``_router``, ``reqs_in_flight``, ``lb_engines``, ``_scale_lock``...)."""

    def _init_engine_loss(
        self,
        engine_loss: str | None,
        engines_coupled: bool,
        engine_restart_limit: int,
    ) -> None:
        """Choose the policy (before the engines start: a bad one starts nothing)."""
        policy = engine_loss_policy(engine_loss)
        if engines_coupled and policy != "fail":
            logger.warning(
                "engine_loss=%s: these engines are coupled (they run collectives together: "
                "one stops when a peer does), so losing one fails the whole group",
                policy,
            )
            policy = "fail"
        #: What losing one engine does: ``"replace"``, ``"isolate"`` or ``"fail"``.
        self.engine_loss = policy
        self._claims = LossClaims()
        # Engines lost whose work was ended (until they serve again).
        self._ended_losses: set[int] = set()
        # Engine lost -> whether a process of this group ran it (else it is an engine
        # this client only reaches, started by someone else: it may rejoin).
        self._lost_process: dict[int, bool] = {}
        self._restarts = RestartBudget(engine_restart_limit)
        # Engine identity -> call ids of the utility calls waiting on it.
        self._calls_on: dict[bytes, set[int]] = {}
        #: Engines lost, replaced, and ranks given up (replaced too often) so far.
        self.engines_lost = 0
        self.engines_replaced = 0
        self.ranks_given_up: set[int] = set()
        # A blocking view of the ROUTER for the rejoin watch (made at its first look).
        self._rejoin_socket: zmq.Socket[bytes] | None = None

    def _arm_engine_loss(self) -> None:
        """From now on a death the client can take alone is claimed, not fatal."""
        if self.engine_loss != "fail":
            self.resources.engine_loss = _WeakLossHook(self)

    # -- state ---------------------------------------------------------------------------

    @property
    def lost_engines(self) -> list[int]:
        """Engine indices lost and not (yet) serving again, in order."""
        return [i for i in self.engine_indices if i in self._claims]

    @property
    def serving_engines(self) -> list[int]:
        """Engine indices routed to now (the group's, less the lost ones)."""
        return [i for i in self.engine_indices if i not in self._claims]

    def _live_engines(self) -> list[bytes]:
        return [e for e in self.core_engines if engine_index_of(e) not in self._claims]

    # -- the loss ------------------------------------------------------------------------

    def _claim_loss(self, index: int, reason: str) -> bool:
        """Any thread: take the loss of engine ``index`` alone? (See ``LossHook.claim``.)"""
        resources = self.resources
        if self.engine_loss == "fail" or resources.engine_dead or resources.closed:
            return False
        if index not in self.engine_indices:
            return False
        had_process = index in resources.processes.engines  # before the monitor releases it
        if not self._claims.claim(index, reason, self.engine_indices):
            logger.error("engine %d lost and no other engine serves: the group fails", index)
            return False
        self._lost_process.setdefault(index, had_process)
        return True

    def _engine_lost(self, index: int) -> None:
        """Loop thread: end what engine ``index`` held and serve on without it."""
        if self.resources.engine_dead or index not in self.engine_indices:
            return
        if index in self._ended_losses or index not in self._claims:
            # Reported twice (the watchdog and the engine monitor): ended once; or
            # reported late, after the rank served again.
            return
        self._ended_losses.add(index)
        reason = self._claims.reason(index) or "lost"
        position = self.engine_indices.index(index)
        identity = self.core_engines[position]
        self.engines_lost += 1
        self._router.set_out(position, True)
        self.lb_engines[position] = list(self._idle_counts)
        # Its requests end now, in this release's layout, as an engine's error would.
        held = [rid for rid, pos in self.reqs_in_flight.items() if pos == position]
        for rid in held:
            del self.reqs_in_flight[rid]
            self.streaming_reqs.discard(rid)
        if held:
            self.outputs_queue.put_nowait(lost_outputs(held, index, reason, self.release))
        error = EngineLostError(index, reason)
        registry = self.resources.registry
        for call_id in self._calls_on.pop(identity, ()):
            future = registry.pop(call_id)
            if future is not None:
                complete_future(future, exc=error)
        backlog = self.resources.input_backlogs.pop(identity, None)
        if backlog is not None:
            backlog.fail(error)
        if self._coordinator is not None:
            # corewire's coordinator: count it idle (vLLM's has no such message).
            self._ensure_stats_update_task()
            self._send_to_coordinator(LostNotice(index).encode())
        if self.ray_backend is not None:
            self.ray_backend.engines.release([index])
        metrics = self.resources.metrics
        if metrics is not None:
            metrics.engine_lost(len(self.serving_engines))
        replacement = self._replacement(index)
        logger.error(
            "engine %d lost (%s): %d request(s) it held end with an error; serving on "
            "%d engine(s); %s",
            index,
            reason,
            len(held),
            len(self.serving_engines),
            replacement,
        )
        if replacement == STARTING:
            task = asyncio.get_running_loop().create_task(self._replace_engine(index))
            self.resources.loop_side.add_task(task)
        # AWAITING: the rejoin watch (_watch_rejoins) routes to it once it is back.

    def _replacement(self, index: int) -> str:
        """What replaces lost engine ``index``: :data:`STARTING` (this client starts
        one), :data:`AWAITING` (an engine this client did not start: its launcher may
        start one, which rejoins), or why nothing does."""
        if self.engine_loss != "replace":
            return f"it stays out of routing (engine_loss={self.engine_loss})"
        if not self._lost_process.get(index, False):
            return AWAITING
        if index not in self._local_indices or not self._starts_engines:
            # vLLM's launcher started it in this process's group and starts no rank alone.
            return "it stays out of routing (vLLM's launcher owns it and cannot start it again)"
        return STARTING

    async def _replace_engine(self, index: int) -> None:
        """Start a new engine for lost rank ``index`` and route to it once it is ready;
        give the rank up when it was replaced too often (or keeps failing to start)."""
        if self._scale_lock is None:
            self._scale_lock = asyncio.Lock()
        async with self._scale_lock:
            while True:
                if self.resources.engine_dead or index not in self.engine_indices:
                    return  # the client is gone, or a scale-down removed the rank
                if not self._restarts.spend(index):
                    self.ranks_given_up.add(index)
                    if self.resources.metrics is not None:
                        self.resources.metrics.rank_given_up()
                    logger.error(
                        "engine %d was replaced %d times in %g s: giving the rank up (it "
                        "stays out of routing; engine_loss falls back to isolate for it)",
                        index,
                        self._restarts.limit,
                        self._restarts.window_s,
                    )
                    return
                try:
                    await self._start_replacement(index)
                except EngineDeadError:
                    # The group died while its replacement started (its last serving
                    # engine was lost): the callers were told; nothing is left to do.
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    logger.warning("the replacement of engine %d failed to start: %s", index, exc)
                    await asyncio.sleep(RETRY_DELAY_S)
                    continue
                break
        self._serve_again(index, "replaced")

    # -- engines this client did not start: they rejoin -----------------------------------

    def _ensure_output_queue_task(self) -> None:
        started = self.resources.output_task is not None
        super()._ensure_output_queue_task()  # type: ignore[misc]
        resources = self.resources
        if started or resources.output_task is None or not self._watches_rejoins():
            return
        task = asyncio.get_running_loop().create_task(
            _watch_rejoins(weakref.ref(self), resources), name="corewire-rejoin-watch"
        )
        resources.loop_side.add_task(task)

    def _unexpected_ready(self) -> Any:
        # A ready wait of a scaling step or a replacement reads the ROUTER while the
        # rejoin watch does not: an engine that rejoined meanwhile is handed on to it.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None  # the start-up's wait: nothing has rejoined yet
        if not self._watches_rejoins():
            return None
        return lambda identity, info: loop.call_soon(
            self._rejoin_safely, engine_index_of(identity), info
        )

    def _rejoin_safely(self, index: int, info: dict[str, Any]) -> None:
        """:meth:`_engine_rejoined`, whose failure is logged (the watch must live on)."""
        try:
            self._engine_rejoined(index, info)
        except Exception:
            logger.exception("engine %d rejoined, and taking it back failed", index)

    def _watches_rejoins(self) -> bool:
        """Whether engines of this group may rejoin: some were not started by this client
        (their launcher may start one again) and a loss is not the whole group's."""
        processes = self.resources.processes.engines
        return self.engine_loss != "fail" and any(i not in processes for i in self.engine_indices)

    def _read_rejoins(self) -> list[tuple[int, dict[str, Any]]]:
        """Ready messages waiting on the ROUTER (engines that connected since the last
        look): ``(engine index, ready map)``; a malformed one is logged and skipped."""
        sock = self._rejoin_socket
        if sock is None:
            sock = self._rejoin_socket = zmq.Socket.shadow(self.input_socket.underlying)
        arrived = []
        while cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
            identity, *rest = sock.recv_multipart()
            try:
                info = parse_ready(identity, rest[-1] if rest else b"")
            except (ProtocolError, RuntimeError) as exc:
                logger.warning("an engine that connected sent no usable ready message: %s", exc)
                continue
            arrived.append((engine_index_of(identity), info))
        return arrived

    def _engine_rejoined(self, index: int, info: dict[str, Any]) -> None:
        """Loop thread: an engine of ``index`` connected and is ready. A lost rank serves
        again (``replace``); a rank still routed to was restarted before its loss was
        seen: its predecessor's requests end now, as a loss's, and are aborted on the new
        engine (which never had them) before it is routed to."""
        if index not in self.engine_indices or self.resources.engine_dead:
            logger.warning("engine %d connected, but it is not of this group: ignored", index)
            return
        if index not in self._ended_losses:
            # Its predecessor's loss not seen yet (or seen, claimed, and not yet ended):
            # end it now. Requests routed to the index meanwhile reached the newcomer,
            # which must not work on for nobody.
            identity = engine_identity(index)
            position = self.engine_indices.index(index)
            held = [rid for rid, pos in self.reqs_in_flight.items() if pos == position]
            reason = "a new engine of this index joined: the one before it is gone"
            # The newcomer serves, so this loss never leaves the group without an engine.
            self._claims.claim(index, reason, self.engine_indices, newcomer=True)
            self._lost_process.setdefault(index, False)
            self._engine_lost(index)
            if held:
                with contextlib.suppress(Exception):  # best effort: it may never have had them
                    self._send_message(identity, REQUEST_ABORT, self.encoder.encode(held), None)
        alone = not self.serving_engines
        if (self.engine_loss != "replace" or index in self.ranks_given_up) and not alone:
            logger.warning("engine %d rejoined; engine_loss=%s keeps it out of routing",
                           index, self.engine_loss)  # fmt: skip
            return
        self.ready_info[engine_identity(index)] = info
        self._serve_again(index, "rejoined")

    def _serve_again(self, index: int, how: str) -> None:
        """Lost engine ``index`` is back (``how``: replaced, rejoined): route to it."""
        position = self.engine_indices.index(index)
        self._ended_losses.discard(index)
        self._lost_process.pop(index, None)
        self._claims.release(index)
        self._router.set_out(position, False)
        self.lb_engines[position] = list(self._idle_counts)
        self.engines_replaced += 1
        if self.resources.metrics is not None:
            self.resources.metrics.engine_replaced(len(self.serving_engines))
        serving = len(self.serving_engines)
        logger.warning("engine %d %s: serving on %d engine(s)", index, how, serving)

    async def _start_replacement(self, index: int) -> None:
        """Start engine ``index`` as a scale-up starts one and wait until it is ready; a
        failed start leaves nothing behind."""
        try:
            procs = await self._start_joining_engines([index])
            ready = self._ready_wait([engine_identity(index)], procs, self.ready_timeout)
            self.ready_info.update(await ready.wait_async(self.ensure_alive))
            self.resources.processes.admit([index])
        except BaseException:
            retired = self.resources.processes.retire_engines([index])
            await self._stop_retired(retired, [index])
            raise

    # -- what the others see -------------------------------------------------------------

    def _lost_rank_error(self, rank: int) -> EngineLostError | None:
        if rank in self._claims:
            return EngineLostError(rank, self._claims.reason(rank) or "lost")
        return None

    def _track_call(self, engine: bytes, call_id: int, future: Any) -> None:
        """Remember which engine utility call ``call_id`` waits on (its loss fails it)."""
        if self.engine_loss == "fail":
            return
        calls = self._calls_on.setdefault(engine, set())
        calls.add(call_id)
        future.add_done_callback(lambda _f: calls.discard(call_id))

    async def _call_live_engines(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every engine serving; an engine lost meanwhile is left out
        of the answer (:class:`EngineDeadError` when none is left)."""
        engines = self._live_engines()
        results = await asyncio.gather(
            *(self._call_or_lost(method, args, engine) for engine in engines)
        )
        answered = [r for r in results if r is not _LOST]
        if not answered:
            self.ensure_alive()
            raise self.resources.dead_error("every engine was lost during the call")
        return answered

    async def _call_or_lost(self, method: str, args: Sequence[Any], engine: bytes) -> Any:
        try:
            return await self._call_utility_async(method, *args, engine=engine)
        except EngineLostError:
            return _LOST
