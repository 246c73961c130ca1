"""``AsyncMPClient``: the asyncio client with an output task, utility futures and
engine-death propagation.

Wire format: docs/protocol.md §4 (what it sends) and §5 (what it reads, through the
output link).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from corewire.client._resources import ClientResources
from corewire.client.core import HEALTH_CHECK_METHOD, MPClient
from corewire.client.ft_status import StatusKeeper
from corewire.client.input_backlog import total_held
from corewire.client.liveness import SilenceJudge
from corewire.client.output_link import (
    DRAIN_BUDGET,
    EMPTY,
    MORE,
    OUTPUT_BUDGET,
    PAUSED,
    STOPPED,
    OutputLink,
)
from corewire.errors import EngineDeadError, EngineLostError, UtilityError
from corewire.metrics import for_client
from corewire.protocol import (
    REQUEST_ABORT,
    REQUEST_ADD,
    REQUEST_UTILITY,
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityCall,
    engine_index_of,
)

__all__ = [
    "DRAIN_BUDGET",
    "OUTPUT_BUDGET",
    "AsyncMPClient",
    "OutputQueue",
]

logger = logging.getLogger("corewire.client")


class OutputQueue:
    """The outputs of an :class:`AsyncMPClient`, in arrival order.

    Like ``asyncio.Queue``, but cheaper, and with a sticky error: after
    :meth:`set_error`, :meth:`get` returns the queued items, then that error to every
    caller, for ever.

    It counts its backlog (:attr:`held`: the outputs of the queued messages plus one per
    message). :meth:`put_nowait` never refuses an item; the producer asks :meth:`full`
    and stops producing, and a getter that takes the backlog down to ``high // 2`` calls
    :attr:`on_room` once (the producer's cue to go on). ``high`` None: never full.
    """

    __slots__ = (
        "_error",
        "_items",
        "_waiters",
        "held",
        "high",
        "low",
        "on_room",
        "pauses",
        "resumed_at",
    )

    def __init__(self, high: int | None = None) -> None:
        self._items: deque[Any] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._error: BaseException | None = None
        #: Outputs (plus one per message) queued; exceptions count nothing.
        self.held = 0
        #: The high-water mark of :attr:`held` (None: unbounded) and the low one.
        self.high = high
        self.low = -1 if high is None else high // 2
        #: Called once when a getter takes :attr:`held` down to :attr:`low` after the
        #: producer saw :meth:`full` (set by the producer, cleared before the call).
        self.on_room: Callable[[], None] | None = None
        #: Times the queue was found full, and when (monotonic) the last such pause
        #: ended: a health check does not count time in which the backlog was full.
        self.pauses = 0
        self.resumed_at = 0.0

    def put_nowait(self, item: Any) -> None:
        """Append ``item`` and wake one waiting getter (loop thread only)."""
        self._items.append(item)
        if not isinstance(item, BaseException):
            self.held += len(item.outputs) + 1
        if self._waiters:
            self._wake_one()

    def full(self) -> bool:
        """Whether the backlog reached its high-water mark (the producer should wait
        for :attr:`on_room`)."""
        high = self.high
        if high is None or self.held < high:
            return False
        self.pauses += 1
        return True

    @property
    def paused(self) -> bool:
        """Whether the producer waits for room (:attr:`on_room` is set)."""
        return self.on_room is not None

    def take_nowait(self) -> Any:
        """The next queued item, or None when none is queued (the sticky error is
        :meth:`get`'s answer, not this one's)."""
        items = self._items
        if not items:
            return None
        item = items.popleft()
        if not isinstance(item, BaseException):
            held = self.held = self.held - len(item.outputs) - 1
            if held <= self.low and self.on_room is not None:
                on_room, self.on_room = self.on_room, None
                self.resumed_at = time.monotonic()
                on_room()
        return item

    def set_error(self, exc: BaseException) -> None:
        """Make ``exc`` the answer of every later :meth:`get` once the queue is empty."""
        if self._error is None:
            self._error = exc
        while self._waiters:
            self._wake_one()

    def _wake_one(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def get_nowait(self) -> Any:
        """The next item, the sticky error, or ``asyncio.QueueEmpty``."""
        if self._items:
            return self.take_nowait()
        if self._error is not None:
            return self._error
        raise asyncio.QueueEmpty

    async def get(self) -> Any:
        """The next item (an output or an exception), waiting for one."""
        while not self._items and self._error is None:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
                # This getter was woken for an item it will not take: pass it on.
                if self._items and not waiter.cancelled():
                    self._wake_one()
                raise
        return self.get_nowait()

    def qsize(self) -> int:
        """Number of queued items (the sticky error not counted)."""
        return len(self._items)

    def empty(self) -> bool:
        """Whether no item is queued."""
        return not self._items


class AsyncMPClient(MPClient):
    """Asyncio client of engine cores in child processes (vLLM's ``AsyncMPClient``).

    ``AsyncMPClient()`` starts one reference engine; ``engine="module:Class"`` and
    ``engine_args`` start a user's engine; ``client_addresses`` uses engines started
    elsewhere (see :class:`MPClient` for every parameter).

    An output task receives the engine's frames, resolves utility calls and queues
    outputs for :meth:`get_output_async`. It starts at construction when a loop is
    running, else on first use, and binds the client to that loop: using the client
    from another loop raises ``RuntimeError``. When an engine dies, every pending call
    and output waiter gets :class:`corewire.EngineDeadError`, and so does every later
    call.

    ``health_check_interval`` (seconds) starts a watchdog that declares the engine dead
    when it does not answer a health check within ``health_check_timeout``.

    :attr:`engine_status` holds the latest fault-tolerance status each engine pushed
    (vLLM 0.33.0's call id -2; see :mod:`corewire.client.ft_status`).
    """

    def __init__(
        self,
        *,
        health_check_interval: float | None = None,
        health_check_timeout: float = 5.0,
        **kwargs: Any,
    ) -> None:
        # Before any engine starts: a bad COREWIRE_METRICS value fails here.
        metrics = for_client(kwargs.get("client_index", 0))
        # What engine_status shows (kept under its own name: the clients inside vLLM
        # 0.34.0 show the managed engine's map under engine_status instead).
        self._engine_statuses: dict[int, dict[str, Any]] = {}
        super().__init__(asyncio_mode=True, **kwargs)
        self.health_check_interval = health_check_interval
        self.health_check_timeout = health_check_timeout
        self.outputs_queue = OutputQueue(self.max_output_backlog)
        self.resources.set_fail_queue(self.outputs_queue.set_error)
        if metrics is not None:
            self.resources.metrics = metrics
            queue = self.outputs_queue
            metrics.watch(
                lambda: queue.held,
                self.resources.registry.__len__,
                total_held(self.resources.input_backlogs),
            )
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # started by the first call made inside a loop
        self._ensure_output_queue_task()

    # -- loop binding and the output task ----------------------------------------------

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        bound = self.resources.loop
        if bound is loop:
            return loop
        if bound is None:
            self.resources.loop = loop
            return loop
        raise RuntimeError(
            f"{type(self).__name__} is bound to the event loop it was first used on; "
            "create one client per event loop"
        )

    def _make_output_link(self) -> OutputLink:
        """The link from the output socket to :attr:`outputs_queue`, with this client's
        ``process_engine_outputs`` hook and notification handler (looked up on the class,
        so the link holds no reference to the client)."""
        ref = weakref.ref(self)
        hook = type(self).process_engine_outputs
        handler = getattr(type(self), "eep_process_engine_core_notification", None)
        return OutputLink(
            self.output_socket,
            self.decoder,
            self.resources,
            self.outputs_queue,
            name="output task",
            client_ref=ref,
            hook=hook,
            hook_is_async=inspect.iscoroutinefunction(hook),
            notify=None if handler is None else _notification_starter(ref, self.resources, handler),
            status=StatusKeeper(self._engine_statuses),
        )

    @property
    def engine_status(self) -> dict[int, dict[str, Any]]:
        """Engine index -> the latest status map that engine pushed (call id -2, vLLM
        0.33.0 on, with fault tolerance on): ``{"id": index, "status": "healthy" |
        "unhealthy" | "dead", "fault_info"?: str}``, as the engine sent it. Replaced whole
        by each new one, on the event loop; empty until an engine sends one (an engine
        without fault tolerance never does). vLLM 0.33.0's front-end reads it under this
        name; a caller may add keys to an engine's map (vLLM records a failed
        fault-handling request there)."""
        return self._engine_statuses

    def _ensure_output_queue_task(self) -> None:
        """Start the output task (and the watchdog) if not started; idempotent."""
        resources = self.resources
        loop = self._bind_loop()
        if resources.output_task is not None or resources.closed:
            return
        hook = type(self).process_engine_outputs
        resources.output_task = task = loop.create_task(
            _output_task(
                weakref.ref(self), resources, self._make_output_link(), self.outputs_queue, hook
            ),
            name="corewire-output-task",
        )
        resources.loop_side.add_task(task)
        if self.health_check_interval is not None:
            resources.loop_side.add_task(
                loop.create_task(
                    _health_watchdog(
                        weakref.ref(self),
                        resources,
                        self.health_check_interval,
                        self.health_check_timeout,
                    ),
                    name="corewire-health-watchdog",
                )
            )

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next batch of outputs; raises :class:`EngineDeadError` once the engine is
        dead, and ``ProtocolError`` for a frame that did not decode."""
        resources = self.resources
        if resources.output_task is None or resources.loop is not asyncio.get_running_loop():
            self._ensure_output_queue_task()
        queue = self.outputs_queue
        item = queue.take_nowait()
        if item is None:
            item = await queue.get()
        if isinstance(item, BaseException):
            raise self._format_exception(item) from None
        return item  # type: ignore[no-any-return]

    # -- sending -----------------------------------------------------------------------

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        """Send a request to the engine; its outputs come from :meth:`get_output_async`.

        ``request`` is written in the client's protocol (see :class:`MPClient`). While
        the engine's input backlog is at ``max_input_backlog`` (or earlier callers wait),
        this waits for room, first come first sent; it raises :class:`EngineDeadError`
        at once when the engine dies or the client closes meanwhile, and a caller
        cancelled while waiting has sent nothing and leaves nothing behind."""
        request.client_index = self.client_index
        if self._write_request is not None:
            request = self._write_request(request)
        engine = self.core_engine
        backlog = self.resources.input_backlogs.get(engine) or self._input_backlog(engine)
        if backlog.must_wait():
            await backlog.wait_async()
            try:
                self._send_message(engine, REQUEST_ADD, self.encoder.encode(request), request)
            finally:
                backlog.pass_on()
        else:
            self._send_message(engine, REQUEST_ADD, self.encoder.encode(request), request)
        if self.resources.output_task is None:
            self._ensure_output_queue_task()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Abort requests by id (nothing is sent once the engine is dead)."""
        if request_ids and not self.resources.engine_dead:
            self._send_message(
                self.core_engine, REQUEST_ABORT, self.encoder.encode(request_ids), None
            )

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Call ``method(*args)`` on the engine and return its result.

        Raises :class:`UtilityError` when the method fails in the engine and
        :class:`EngineDeadError` when the engine dies first. A cancelled caller's call
        is forgotten at once; a late reply to it is ignored.
        """
        # The body of _call_utility_async, not a second coroutine around it: each
        # coroutine layer is created per call and passed through at both ends of the
        # await, and a sequential caller's round trip is mostly such per-call work.
        future, call_id = self._send_utility(method, args, self.core_engine)
        try:
            return await future
        except BaseException:
            self.resources.registry.discard(call_id)
            raise

    async def _call_utility_async(self, method: str, *args: Any, engine: bytes) -> Any:
        future, call_id = self._send_utility(method, args, engine)
        try:
            return await future
        except BaseException:
            self.resources.registry.discard(call_id)
            raise

    def _send_utility(
        self, method: str, args: tuple[Any, ...], engine: bytes
    ) -> tuple[asyncio.Future[Any], int]:
        """Register a utility call and send it to ``engine``: its future and call id (a
        call that could not be sent is not left registered)."""
        resources = self.resources
        loop = asyncio.get_running_loop()
        if loop is not resources.loop:
            self._bind_loop()
        if resources.engine_dead:
            raise resources.dead_error()
        if self._write_utility_args is not None:
            args = self._write_utility_args(method, args)
        future = loop.create_future()
        registry = resources.registry
        call_id = registry.register(future)
        try:
            frames = self.encoder.encode(UtilityCall(self.client_index, call_id, method, args))
            self._send_message(engine, REQUEST_UTILITY, frames, args)
            if resources.output_task is None:
                self._ensure_output_queue_task()
        except BaseException:
            registry.discard(call_id)
            raise
        return future, call_id

    # -- health ------------------------------------------------------------------------

    async def check_health_async(self, timeout: float = 5.0) -> None:
        """Raise :class:`EngineDeadError` when the engine is dead or any engine does not
        answer a cheap utility call and sends nothing else for ``timeout`` seconds
        (hung or stopped).

        A failure reply still proves the engine alive. The client's state is left
        unchanged: a later check may pass (a stopped engine that was continued). An
        engine whose latest fault-tolerance status is not ``healthy`` (see
        :attr:`engine_status`) is left out: vLLM's engines in fault handling answer
        nothing but the instruction they wait for, for as long as vLLM's window lasts.

        Bursts: the reply waits behind every input sent before it, which after a burst
        of requests may take longer than ``timeout`` to read. An engine counts as hung
        only once ``timeout`` seconds passed since the check began and since the last
        message of any kind it sent (:mod:`corewire.client.liveness`); one working
        through its input keeps sending, one stopped or stuck in a step does not, and is
        found ``timeout`` seconds after its last message (docs/protocol.md §7.1).

        Backpressure: while the output backlog is full, the client reads nothing, and
        the reply waits behind the outputs the engine sent before it. A window in which
        the backlog was full at any time does not count: the check starts its window
        again (so a slow consumer delays it, and never makes a healthy engine look
        dead; a hung engine is found ``timeout`` seconds after the consumer caught up).
        """
        self.ensure_alive()
        queue = self.outputs_queue
        liveness = self.resources.liveness
        # An engine in vLLM's fault handling answers nothing but the instruction it waits
        # for: by its own word it is alive, and its fate is the orchestrator's.
        probed = self._probed_engines()
        # Plain futures, no tasks or gather: whatever ends the wait (a timeout, the caller
        # cancelled), each call is withdrawn or its outcome read, so asyncio has nothing
        # to log as "never retrieved" or "destroyed but pending".
        calls: list[tuple[asyncio.Future[Any], int]] = []
        try:
            for engine in probed:
                calls.append(self._send_utility(HEALTH_CHECK_METHOD, (), engine))
            futures = [future for future, _ in calls]
            index_of = {
                future: engine_index_of(engine)
                for future, engine in zip(futures, probed, strict=True)
            }
            if not futures:
                return
            judge = SilenceJudge(liveness, timeout, time.monotonic())
            wake_at = liveness.deadline(index_of.values(), judge.started, timeout)
            while True:
                pauses = queue.pauses
                wait_s = wake_at - time.monotonic()
                _, pending = await asyncio.wait(futures, timeout=max(0.0, wait_s))
                if not pending:
                    break
                now = time.monotonic()
                if queue.paused or queue.pauses != pauses or queue.resumed_at >= judge.started:
                    judge.restart(now)  # the backlog was full: this window does not count
                    wake_at = now + timeout
                    continue
                # Engines that went into fault handling during the check: not waited for.
                held = {f for f in pending if self._in_fault_handling(index_of[f])}
                if held:
                    futures = [f for f in futures if f not in held]
                    pending -= held
                    if not pending:
                        break
                silent, wake_at = judge.judge([index_of[f] for f in pending], now)
                if silent:
                    error = self.resources.dead_error(
                        f"engine core did not answer a health check within {timeout:g} s "
                        f"and sent nothing else meanwhile (engine {silent[0]})"
                    )
                    error.engine_index = silent[0]  # type: ignore[attr-defined]
                    raise error
        finally:
            _withdraw(self.resources.registry, calls)
        for future in futures:
            exc = future.exception()
            if exc is not None and not isinstance(exc, UtilityError):
                raise self._format_exception(exc)

    def _probed_engines(self) -> list[bytes]:
        """The engines a health check asks: all but those in vLLM's fault handling (an
        engine there answers nothing but the instruction it waits for: by its own word
        it is alive, and its fate is the orchestrator's)."""
        return [e for e in self.core_engines if not self._in_fault_handling(engine_index_of(e))]

    def _in_fault_handling(self, engine_index: int) -> bool:
        """Whether engine ``engine_index``'s latest pushed status (vLLM's fault tolerance)
        says it is not serving: unhealthy and waiting for an instruction, or any other
        status but healthy (a later release's recovering or paused). Engines that push no
        status (fault tolerance off) never are."""
        status = self._engine_statuses.get(engine_index)
        return status is not None and status.get("status", "healthy") != "healthy"

    # -- utility wrappers (vLLM's client API) ------------------------------------------

    async def collective_rpc_async(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``method`` on every worker of the engine; returns their results."""
        return await self.call_utility_async("collective_rpc", method, timeout, args, kwargs)

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        """Tasks the engine supports (``"generate"``, ``"embed"``, ...)."""
        return tuple(await self.call_utility_async("get_supported_tasks"))

    async def profile_async(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Start or stop the engine's profiler."""
        await self.call_utility_async("profile", is_start, profile_prefix)

    async def reset_prefix_cache_async(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Drop the engine's prefix cache; returns whether it was reset."""
        return bool(
            await self.call_utility_async(
                "reset_prefix_cache", reset_running_requests, reset_connector
            )
        )

    async def reset_mm_cache_async(self) -> None:
        """Drop the engine's multimodal cache."""
        await self.call_utility_async("reset_mm_cache")

    async def reset_encoder_cache_async(self) -> None:
        """Drop the engine's encoder cache."""
        await self.call_utility_async("reset_encoder_cache")

    async def sleep_async(self, level: int = 1, mode: str = "abort") -> None:
        """Put the engine to sleep (free memory); ``mode`` says what happens to running
        requests (vLLM's pause modes: "abort", "wait", "keep")."""
        await self.call_utility_async("sleep", level, mode)

    async def wake_up_async(self, tags: list[str] | None = None) -> None:
        """Wake a sleeping engine."""
        await self.call_utility_async("wake_up", tags)

    async def is_sleeping_async(self) -> bool:
        """Whether the engine sleeps."""
        return bool(await self.call_utility_async("is_sleeping"))

    async def pause_scheduler_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop scheduling new work; ``mode`` says what happens to running requests
        ("abort", "wait", "keep"), ``clear_cache`` drops the prefix cache (vLLM's API)."""
        await self.call_utility_async("pause_scheduler", mode, clear_cache)

    async def scale_elastic_ep(self, new_data_parallel_size: int) -> None:
        """Elastic scaling needs a data-parallel client (:class:`~corewire.DPLBAsyncMPClient`)."""
        raise NotImplementedError(
            f"{type(self).__name__} drives a fixed set of engines: scaling to "
            f"{new_data_parallel_size} needs DPLBAsyncMPClient"
        )

    async def resume_scheduler_async(self) -> None:
        """Resume scheduling after :meth:`pause_scheduler_async`."""
        await self.call_utility_async("resume_scheduler")

    async def is_scheduler_paused_async(self) -> bool:
        """Whether the scheduler is paused."""
        return bool(await self.call_utility_async("is_scheduler_paused"))

    async def execute_dummy_batch_async(self) -> None:
        """Run one dummy batch in the engine (DP lockstep)."""
        await self.call_utility_async("execute_dummy_batch")

    async def add_lora_async(self, lora_request: Any) -> bool:
        """Load a LoRA adapter."""
        return bool(await self.call_utility_async("add_lora", lora_request))

    async def remove_lora_async(self, lora_id: int) -> bool:
        """Unload a LoRA adapter."""
        return bool(await self.call_utility_async("remove_lora", lora_id))

    async def list_loras_async(self) -> set[int]:
        """Ids of the loaded LoRA adapters."""
        return set(await self.call_utility_async("list_loras"))

    async def pin_lora_async(self, lora_id: int) -> bool:
        """Keep a LoRA adapter loaded."""
        return bool(await self.call_utility_async("pin_lora", lora_id))

    async def save_sharded_state_async(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        """Save the model's sharded state under ``path``."""
        await self.call_utility_async("save_sharded_state", path, pattern, max_size)


class _ReaderDriver:
    """Drives an :class:`OutputLink` from the descriptor's reader callback (no hook or a
    plain one): a reply completes its caller's future in the loop iteration that saw the
    descriptor turn readable, one task hand-off sooner than a task could.

    At most one pump per loop iteration, or the consumer could face twice the budget at
    once: the reader callback of an iteration in which a resumption is scheduled or
    already ran does nothing. That loses no wake-up: the resumption drains, or it drained
    up to an empty socket, after which a new message signals the descriptor again (and a
    descriptor left unread stays readable). While the backlog is full, ``busy`` stays
    set: pumping resumes only through the queue's ``on_room``.
    """

    __slots__ = ("busy", "link", "loop", "queue", "stopped")

    def __init__(self, link: OutputLink, queue: OutputQueue, loop: asyncio.AbstractEventLoop):
        self.link = link
        self.queue = queue
        self.loop = loop
        self.busy = True  # until the first resumption drained what came before the reader
        #: Done when the link ended; the output task awaits it.
        self.stopped: asyncio.Future[None] = loop.create_future()

    def _after(self, status: Any) -> bool:
        """Act on a pump's status; returns whether a resumption is due."""
        if status is MORE:
            return True
        if status is PAUSED:
            self.queue.on_room = self.on_room
        elif status is STOPPED and not self.stopped.done():
            self.stopped.set_result(None)
        return False

    def on_readable(self) -> None:
        """The reader callback."""
        if self.busy:
            return
        status = self.link.pump()
        if status is not EMPTY:
            self.busy = True  # stays set while paused, and for good once stopped
            if self._after(status):
                self.loop.call_soon(self.resume)  # budget spent: the consumer runs first

    def resume(self) -> None:
        """Go on pumping in a later loop iteration."""
        status = self.link.pump()
        if self._after(status):
            self.loop.call_soon(self.resume)
        elif status is EMPTY:
            self.loop.call_soon(self.release)

    def release(self) -> None:
        self.busy = False

    def on_room(self) -> None:
        # The consumer took the backlog down: read again, after the getter's own turn
        # (messages that came meanwhile left the descriptor without a new edge), unless
        # the output path ended while it waited.
        if not self.stopped.done():
            self.loop.call_soon(self.resume)


class _Readable:
    """Wakes the output task when the socket's descriptor turns readable (async hook).

    The callback stays registered with the loop for the task's lifetime; it completes
    the waiter the task left, if any (while the task drains, there is none).
    """

    __slots__ = ("loop", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiter: asyncio.Future[None] | None = None

    def fire(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        self.waiter = waiter = self.loop.create_future()
        return waiter


async def _drive_with_async_hook(
    link: OutputLink,
    queue: OutputQueue,
    readable: _Readable,
    client_ref: weakref.ref[AsyncMPClient],
    hook: Callable[..., Awaitable[None]],
) -> None:
    """Drive ``link`` from the output task, awaiting ``hook`` on each output message."""
    loop = asyncio.get_running_loop()
    hooked = None
    while True:
        status = link.pump(hooked)
        hooked = None
        if status is EMPTY:
            if client_ref() is None:
                return
            await readable.wait()
        elif status is MORE:
            await asyncio.sleep(0)
        elif status is PAUSED:
            room = loop.create_future()
            queue.on_room = functools.partial(_set_done, room)
            await room
        elif status is STOPPED:
            return
        else:
            client = client_ref()
            if client is None:
                return
            await hook(client, status)
            del client
            hooked = status


async def _output_task(
    client_ref: weakref.ref[AsyncMPClient],
    resources: ClientResources,
    link: OutputLink,
    queue: OutputQueue,
    hook: Any,
) -> None:
    """The output task: drives ``link`` until the engine dies, the client is shut down
    or collected (it references the client only through ``client_ref``).

    Without an async hook the work runs in the descriptor's reader callback
    (:class:`_ReaderDriver`) and the task only waits for the end; with one, the task
    receives and awaits it itself.

    Backpressure: once the queue's backlog reaches its high-water mark, nothing more is
    received until the consumer took it down to the low one (``queue.on_room``). The
    messages then wait in ZeroMQ, whose finite receive limit blocks the engines' sends
    in turn. A utility reply waits behind the outputs sent before it, as they do.
    """
    loop = asyncio.get_running_loop()
    fd = link.fd
    # The reader must go before the socket closes, and shutdown closes the socket before
    # this task's cancellation runs.
    remove_reader = functools.partial(_remove_reader, loop, fd)
    resources.loop_side.before_close.append(remove_reader)
    try:
        if link.async_hook:
            readable = _Readable(loop)
            loop.add_reader(fd, readable.fire)
            await _drive_with_async_hook(link, queue, readable, client_ref, hook)
        else:
            driver = _ReaderDriver(link, queue, loop)
            loop.add_reader(fd, driver.on_readable)
            loop.call_soon(driver.resume)  # messages queued before the reader was added
            await driver.stopped
    except asyncio.CancelledError:
        queue.set_error(resources.dead_error())
        raise
    except Exception as exc:
        link.fail(exc)
    finally:
        remove_reader()


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _remove_reader(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    with contextlib.suppress(Exception):  # the loop may be closed already
        loop.remove_reader(fd)


def _notification_starter(
    client_ref: weakref.ref[AsyncMPClient], resources: ClientResources, handler: Any
) -> Callable[[Any], None]:
    """The link's ``notify``: runs the elastic-scaling notification handler in its own
    task."""

    def notify(utility: Any) -> None:
        client = client_ref()
        result = utility.result
        if client is None or result is None:
            return
        task = asyncio.get_running_loop().create_task(
            handler(client, result.result), name="corewire-eep-notification"
        )
        resources.loop_side.add_task(task)

    return notify


def _withdraw(registry: Any, calls: list[tuple[asyncio.Future[Any], int]]) -> None:
    """End utility calls a caller stopped waiting for: unanswered ones leave the registry
    (a late reply is then dropped) and are cancelled; answered ones have their outcome
    read, so that a failure nobody will look at is not logged as never retrieved."""
    for future, call_id in calls:
        if not future.done():
            registry.discard(call_id)
            future.cancel()
        elif not future.cancelled():
            future.exception()


async def _health_watchdog(
    client_ref: weakref.ref[AsyncMPClient],
    resources: ClientResources,
    interval: float,
    timeout: float,
) -> None:
    """Declare the engines dead when a health check fails; kill the hung processes so
    the engine monitor closes the client."""
    while not resources.engine_dead:
        await asyncio.sleep(interval)
        client = client_ref()
        if client is None:
            return
        try:
            await client.check_health_async(timeout)
        except EngineLostError:
            continue  # an engine was lost during the check (the loss is handled): next round
        except EngineDeadError as exc:
            if resources.engine_dead:
                return
            index = getattr(exc, "engine_index", None)
            hook = resources.engine_loss
            if index is not None and hook is not None and hook.claim(index, str(exc)):
                if resources.processes.kill_engine(index):
                    # The client serves on without it; the engine monitor reports it lost.
                    logger.error("health check failed: %s; killing that engine", exc)
                else:
                    # Not a process of this client's (a remote or front-end-only
                    # engine): nothing to kill; what it held ends now, and it stays out
                    # of routing until an engine of its index rejoins.
                    logger.error("health check failed: %s; serving on without that engine", exc)
                    hook.lost(index)
                continue
            logger.error("health check failed: %s", exc)
            resources.mark_dead(str(exc))
            resources.processes.kill()
            return
        finally:
            del client
