"""``SyncMPClient``: the blocking client, with a daemon output thread.

Wire format: docs/protocol.md §4 (what it sends) and §5 (what it reads, through the
output link).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import inspect
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import zmq

from corewire.client.core import HEALTH_CHECK_METHOD, MPClient
from corewire.client.ft_status import StatusDrops
from corewire.client.input_backlog import total_held
from corewire.client.liveness import SilenceJudge
from corewire.client.output_link import PAUSED, STOPPED, OutputLink
from corewire.errors import EngineDeadError, UtilityError
from corewire.metrics import for_client
from corewire.protocol import EngineCoreOutputs, EngineCoreRequest, UtilityCall, engine_index_of
from corewire.protocol import EngineCoreRequestType as RequestType

__all__ = ["SyncMPClient"]

logger = logging.getLogger("corewire.client")

#: How often a paused output thread looks whether the consumer made room.
_PAUSE_POLL_MS = 5
#: Default ``add_request_timeout``: seconds ``add_request`` blocks on a full input
#: backlog before it raises ``InputBacklogTimeout`` (an engine that read nothing for this
#: long is stopped or far behind; a caller that prefers to wait longer says so).
DEFAULT_ADD_REQUEST_TIMEOUT_S = 30.0
#: ``add_request``'s ``timeout`` default: the client's ``add_request_timeout``.
_CLIENT_DEFAULT: Any = object()


class _Backlog:
    """The output queue of a :class:`SyncMPClient` as its :class:`OutputLink` sees it: a
    ``queue.Queue`` and its backlog, counted as outputs plus one per message.
    ``produced`` is written by the output thread only, ``consumed`` by the consumer
    only, so neither needs a lock."""

    __slots__ = (
        "consumed",
        "high",
        "low",
        "paused",
        "pauses",
        "produced",
        "put_nowait",
        "queue",
        "resumed_at",
    )

    def __init__(self, high: int | None) -> None:
        #: The outputs, and exceptions for the consumer.
        self.queue: queue.Queue[Any] = queue.Queue()
        self.produced = 0
        self.consumed = 0
        self.high = high if high is not None else 1 << 62
        self.low = self.high // 2
        #: Whether the output thread waits for the consumer (it reads nothing).
        self.paused = False
        #: Times it waited, and when (monotonic) it last went on: a health check does
        #: not count time in which the backlog was full.
        self.pauses = 0
        self.resumed_at = 0.0
        #: What the link calls with every output message and exception.
        self.put_nowait = self._put

    def _put(self, item: Any) -> None:
        self.queue.put_nowait(item)
        if not isinstance(item, BaseException):
            self.produced += len(item.outputs) + 1

    @property
    def held(self) -> int:
        """Outputs received and not yet taken."""
        return self.produced - self.consumed

    def full(self) -> bool:
        """Whether the backlog reached its high-water mark (then counted as a pause)."""
        if self.produced - self.consumed < self.high:
            return False
        self.pauses += 1
        return True


class SyncMPClient(MPClient):
    """Blocking client of engine cores in child processes (vLLM's ``SyncMPClient``).

    A daemon thread receives the engine's frames: utility replies complete
    ``concurrent.futures`` futures, outputs go to a ``queue.Queue`` read by
    :meth:`get_output`. Engine death fails every pending call and output waiter with
    :class:`corewire.EngineDeadError`, and every later call raises it. Parameters as
    :class:`MPClient`. Use it from one thread at a time.

    Backpressure (``max_output_backlog``): past the high-water mark the thread stops
    reading until :meth:`get_output` took the backlog down to half of it; utility
    replies behind the waiting outputs wait too (see :meth:`check_health`). On the input
    side (``max_input_backlog``), :meth:`add_request` blocks while the engine's backlog
    is full, up to ``add_request_timeout`` seconds (default 30; None: no limit).

    Engine status messages (vLLM 0.33.0's call id -2) have nowhere to go here: they are
    dropped, counted in :attr:`ft_status_dropped`, the first one logged.
    """

    def __init__(
        self, *, add_request_timeout: float | None = DEFAULT_ADD_REQUEST_TIMEOUT_S, **kwargs: Any
    ) -> None:
        #: Seconds :meth:`add_request` blocks on a full input backlog (None: no limit).
        self.add_request_timeout = add_request_timeout
        # Before any engine starts: a bad COREWIRE_METRICS value fails here.
        metrics = for_client(kwargs.get("client_index", 0))
        hook = self._plain_hook()
        self._status_drops = drops = StatusDrops()
        super().__init__(asyncio_mode=False, **kwargs)
        self._backlog = backlog = _Backlog(self.max_output_backlog)
        self.outputs_queue = backlog.queue
        resources = self.resources
        resources.set_fail_queue(self.outputs_queue.put_nowait)
        if metrics is not None:
            resources.metrics = metrics
            metrics.watch(
                lambda: backlog.held,
                resources.registry.__len__,
                total_held(resources.input_backlogs),
            )
        # Made on the thread: a client closed during construction starts no thread, and
        # its socket, closed by then, could not be read.
        make_link = functools.partial(
            OutputLink,
            self.output_socket,
            self.decoder,
            resources,
            backlog,
            name="output thread",
            client_ref=weakref.ref(self),
            hook=hook,
            status=drops,
            # vLLM's SyncMPClient queues every message but utility replies.
            queue_empty=True,
        )
        wake_r, wake_w = os.pipe()
        thread = threading.Thread(
            target=_output_thread,
            args=(make_link, wake_r, self.output_socket, backlog),
            name="corewire-output-thread",
            daemon=True,
        )

        def stop() -> None:
            # Closing the write end wakes the thread (EOF), which closes the read end.
            with contextlib.suppress(OSError):
                os.close(wake_w)

        if not resources.threads.start(thread, stop):
            os.close(wake_r)  # the engine died during construction: no thread to close it

    def _plain_hook(self) -> Any:
        """This class's ``process_engine_outputs`` hook, run on the output thread; an
        async one cannot run there."""
        hook = type(self).process_engine_outputs
        if hook is not None and inspect.iscoroutinefunction(hook):
            raise TypeError(f"{type(self).__name__}.process_engine_outputs must not be async")
        return hook

    @property
    def ft_status_dropped(self) -> int:
        """Engine status messages (call id -2, vLLM 0.33.0) received and dropped."""
        return self._status_drops.count

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next batch of outputs, blocking; raises :class:`EngineDeadError` once the
        engine is dead, ``ProtocolError`` for a frame that did not decode, and
        ``queue.Empty`` after ``timeout`` seconds."""
        item = self.outputs_queue.get(timeout=timeout)
        if isinstance(item, BaseException):
            if isinstance(item, EngineDeadError):
                self.outputs_queue.put_nowait(item)  # sticky: every later caller sees it
            raise self._format_exception(item) from None
        self._backlog.consumed += len(item.outputs) + 1
        return item  # type: ignore[no-any-return]

    def _send_input(
        self, request_type: RequestType, request: Any, engine: bytes | None = None
    ) -> None:
        """Send ``request`` to ``engine`` (default: the first)."""
        frames = self.encoder.encode(request)
        # The engine monitor may close the socket on another thread.
        with self.resources.loop_side.send_lock:
            self._send_message(engine or self.core_engine, request_type.value, frames, request)

    def add_request(self, request: EngineCoreRequest, timeout: Any = _CLIENT_DEFAULT) -> None:
        """Send a request; its outputs come from :meth:`get_output`.

        ``request`` is written in the client's protocol (see :class:`MPClient`). While
        the engine's input backlog is at ``max_input_backlog``, this blocks until the
        engine has read enough; after ``timeout`` seconds (default: the client's
        ``add_request_timeout``; None: no limit) it raises
        :class:`~corewire.errors.InputBacklogTimeout`, having sent nothing of the
        request, and :class:`EngineDeadError` as soon as the engine dies or the client
        closes meanwhile."""
        request.client_index = self.client_index
        if self._write_request is not None:
            request = self._write_request(request)
        engine = self.core_engine
        backlog = self._input_backlog(engine)
        if backlog.high is not None:
            # Outside the send lock: shutdown takes it to close the socket, and must not
            # wait for this wait.
            backlog.wait_blocking(
                self.add_request_timeout if timeout is _CLIENT_DEFAULT else timeout,
                self._engine_dead_error,
                engine_index_of(engine),
            )
        self._send_input(RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests by id (nothing is sent once the engine is dead)."""
        if request_ids and not self.resources.engine_dead:
            self._send_input(RequestType.ABORT, request_ids)

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call ``method(*args)`` on the engine and wait for its result.

        Raises :class:`UtilityError` when it fails in the engine, :class:`EngineDeadError`
        when the engine dies, ``TimeoutError`` after ``timeout`` seconds.
        """
        return self._call_utility(method, args, self.core_engine, timeout)

    def _call_utility(
        self, method: str, args: tuple[Any, ...], engine: bytes, timeout: float | None
    ) -> Any:
        resources = self.resources
        if self._write_utility_args is not None:
            args = self._write_utility_args(method, args)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = resources.registry.register(future)
        try:
            self._send_input(
                RequestType.UTILITY, UtilityCall(self.client_index, call_id, method, args), engine
            )
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            resources.registry.discard(call_id)
            raise TimeoutError(f"utility call {method!r} got no reply within {timeout} s") from None
        except BaseException:
            resources.registry.discard(call_id)
            raise

    def check_health(self, timeout: float = 5.0) -> None:
        """Raise :class:`EngineDeadError` when the engine is dead or does not answer a
        cheap utility call and sends nothing else for ``timeout`` seconds; a failure
        reply counts as alive.

        As :meth:`AsyncMPClient.check_health_async`: an engine still sending (working
        through a burst of input ahead of the call) is not hung, and a window in which
        the output backlog was full at any time (the reply waits behind unread outputs)
        does not count."""
        self.ensure_alive()
        resources = self.resources
        backlog = self._backlog
        liveness = resources.liveness
        for engine in self.core_engines:
            index = engine_index_of(engine)
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            call_id = resources.registry.register(future)
            try:
                self._send_input(
                    RequestType.UTILITY,
                    UtilityCall(self.client_index, call_id, HEALTH_CHECK_METHOD, ()),
                    engine,
                )
                judge = SilenceJudge(liveness, timeout, time.monotonic())
                wake_at = liveness.deadline((index,), judge.started, timeout)
                while True:
                    pauses = backlog.pauses
                    try:
                        future.result(max(0.0, wake_at - time.monotonic()))
                        break
                    except concurrent.futures.TimeoutError:
                        now = time.monotonic()
                        if (
                            backlog.paused
                            or backlog.pauses != pauses
                            or backlog.resumed_at >= judge.started
                        ):
                            judge.restart(now)  # the backlog was full: this window does not count
                            wake_at = now + timeout
                            continue
                        silent, wake_at = judge.judge([index], now)
                        if silent:
                            raise resources.dead_error(
                                f"engine core did not answer a health check within "
                                f"{timeout:g} s and sent nothing else meanwhile "
                                f"(engine {index})"
                            ) from None
            except UtilityError:
                pass
            finally:
                resources.registry.discard(call_id)

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``method`` on every worker of the engine; returns their results."""
        return self.call_utility("collective_rpc", method, timeout, args, kwargs)

    def get_supported_tasks(self) -> tuple[str, ...]:
        """Tasks the engine supports."""
        return tuple(self.call_utility("get_supported_tasks"))

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Start or stop the engine's profiler."""
        self.call_utility("profile", is_start, profile_prefix)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Drop the engine's prefix cache; returns whether it was reset."""
        return bool(
            self.call_utility("reset_prefix_cache", reset_running_requests, reset_connector)
        )

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Put the engine to sleep; ``mode`` as in vLLM ("abort", "wait", "keep")."""
        self.call_utility("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake a sleeping engine."""
        self.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        """Whether the engine sleeps."""
        return bool(self.call_utility("is_sleeping"))

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop scheduling new work (vLLM's arguments: pause mode, clear the cache)."""
        self.call_utility("pause_scheduler", mode, clear_cache)

    def resume_scheduler(self) -> None:
        """Resume scheduling."""
        self.call_utility("resume_scheduler")

    def is_scheduler_paused(self) -> bool:
        """Whether the scheduler is paused."""
        return bool(self.call_utility("is_scheduler_paused"))


def _output_thread(
    make_link: Callable[[], OutputLink], wake_r: int, sock: Any, backlog: _Backlog
) -> None:
    """Drive the link ``make_link()`` makes until woken through ``wake_r``; while the
    backlog is full, wait for the consumer instead of reading."""
    try:
        link = make_link()
    except BaseException:
        os.close(wake_r)
        raise
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(wake_r, zmq.POLLIN)
    waker = zmq.Poller()
    waker.register(wake_r, zmq.POLLIN)
    try:
        while True:
            if any(fd == wake_r for fd, _ in poller.poll()):
                return
            # After each pass (MORE included) the thread looks whether it must stop; the
            # poll answers at once while messages are queued.
            status = link.pump()
            if status is STOPPED:
                return
            if status is PAUSED:
                backlog.paused = True
                while backlog.held > backlog.low:
                    if waker.poll(_PAUSE_POLL_MS):
                        return
                backlog.resumed_at = time.monotonic()
                backlog.paused = False
    except Exception as exc:
        link.fail(exc)
    finally:
        os.close(wake_r)
