"""``SyncMPClient``: the blocking client, with a daemon output thread."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from typing import Any

import zmq

from corewire.client._resources import ClientResources
from corewire.client.core import HEALTH_CHECK_METHOD, MPClient, resolve_utility_output
from corewire.client.salvage import fail_undecodable
from corewire.errors import EngineDeadError, ProtocolError, UtilityError
from corewire.metrics import for_client
from corewire.protocol import ENGINE_CORE_DEAD, EngineCoreOutputs, EngineCoreRequest
from corewire.protocol import EngineCoreRequestType as RequestType

__all__ = ["SyncMPClient"]

logger = logging.getLogger("corewire.client")

_DEAD_LEN = len(ENGINE_CORE_DEAD)
#: How often a paused output thread looks whether the consumer made room.
_PAUSE_POLL_MS = 5


class _Backlog:
    """The output backlog of a :class:`SyncMPClient`, counted as outputs plus one per
    message: ``produced`` is written by the output thread only, ``consumed`` by the
    consumer only, so neither needs a lock."""

    __slots__ = ("consumed", "high", "low", "paused", "pauses", "produced", "resumed_at")

    def __init__(self, high: int | None) -> None:
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

    def held(self) -> int:
        """Outputs received and not yet taken."""
        return self.produced - self.consumed


class SyncMPClient(MPClient):
    """Blocking client of engine cores in child processes (vLLM's ``SyncMPClient``).

    A daemon thread receives the engine's frames: utility replies complete
    ``concurrent.futures`` futures, outputs go to a ``queue.Queue`` read by
    :meth:`get_output`. Engine death fails every pending call and output waiter with
    :class:`corewire.EngineDeadError`, and every later call raises it. Parameters as
    :class:`MPClient`. Use it from one thread at a time.

    Backpressure (``max_output_backlog``): past the high-water mark the thread stops
    reading until :meth:`get_output` took the backlog down to half of it; utility
    replies behind the waiting outputs wait too (see :meth:`check_health`).
    """

    def __init__(self, **kwargs: Any) -> None:
        # Before any engine starts: a bad COREWIRE_METRICS value fails here.
        metrics = for_client(kwargs.get("client_index", 0))
        super().__init__(asyncio_mode=False, **kwargs)
        self.outputs_queue: queue.Queue[Any] = queue.Queue()
        self._backlog = backlog = _Backlog(self.max_output_backlog)
        resources = self.resources
        resources.set_fail_queue(self.outputs_queue.put_nowait)
        if metrics is not None:
            resources.metrics = metrics
            metrics.watch(backlog.held, resources.registry.__len__)
        wake_r, wake_w = os.pipe()
        thread = threading.Thread(
            target=_output_thread,
            args=(
                self.output_socket,
                wake_r,
                self.decoder,
                resources,
                self.outputs_queue,
                backlog,
            ),
            name="corewire-output-thread",
            daemon=True,
        )

        def stop() -> None:
            # Closing the write end wakes the thread (EOF), which closes the read end.
            with contextlib.suppress(OSError):
                os.close(wake_w)

        if not resources.start_thread(thread, stop):
            os.close(wake_r)  # the engine died during construction: no thread to close it

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
        with self.resources.send_lock:
            self._send_message(engine or self.core_engine, request_type.value, frames, request)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request; its outputs come from :meth:`get_output`."""
        request.client_index = self.client_index
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
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = resources.registry.register(future)
        try:
            self._send_input(
                RequestType.UTILITY, (self.client_index, call_id, method, args), engine
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
        cheap utility call within ``timeout`` seconds; a failure reply counts as alive.

        A window of ``timeout`` seconds in which the output backlog was full at any
        time (the reply waits behind unread outputs) does not count: the check waits
        on, as :meth:`AsyncMPClient.check_health_async` does."""
        self.ensure_alive()
        resources = self.resources
        backlog = self._backlog
        for engine in self.core_engines:
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            call_id = resources.registry.register(future)
            try:
                self._send_input(
                    RequestType.UTILITY,
                    (self.client_index, call_id, HEALTH_CHECK_METHOD, ()),
                    engine,
                )
                while True:
                    pauses, started = backlog.pauses, time.monotonic()
                    try:
                        future.result(timeout)
                        break
                    except concurrent.futures.TimeoutError:
                        if (
                            not backlog.paused
                            and backlog.pauses == pauses
                            and backlog.resumed_at < started
                        ):
                            raise resources.dead_error(
                                f"engine core did not answer a health check within {timeout:g} s"
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
    sock: zmq.Socket,
    wake_r: int,
    decoder: Any,
    resources: ClientResources,
    outputs: queue.Queue[Any],
    backlog: _Backlog,
) -> None:
    """Receive, decode and dispatch frames until woken through ``wake_r``; while the
    backlog is full, wait for the consumer instead of reading."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(wake_r, zmq.POLLIN)
    waker = zmq.Poller()
    waker.register(wake_r, zmq.POLLIN)
    high = backlog.high
    recv = sock.recv
    metrics = resources.metrics
    # Metrics on: a decoder that times and counts each message; off: the plain one.
    decode = decoder.decode if metrics is None else metrics.wrap_decode(decoder.decode)
    pop = resources.registry.pop
    put = outputs.put_nowait
    NOBLOCK = zmq.NOBLOCK
    try:
        while True:
            if any(fd == wake_r for fd, _ in poller.poll()):
                return
            while True:  # drain: the descriptor is edge-triggered
                try:
                    first = recv(NOBLOCK, copy=False)
                except zmq.Again:
                    break
                frames = [first]
                while first.more:
                    first = recv(copy=False)
                    frames.append(first)
                if (
                    len(frames) == 1
                    and len(frames[0]) == _DEAD_LEN
                    and (frames[0].bytes == ENGINE_CORE_DEAD)
                ):
                    resources.mark_dead("Engine core sent ENGINE_CORE_DEAD (fatal error).")
                    return
                try:
                    decoded = decode(frames)
                except ProtocolError as exc:
                    if fail_undecodable(exc, frames, pop, metrics):
                        put(exc)
                    continue
                utility = decoded.utility_output
                if utility is None:
                    put(decoded)
                    backlog.produced += len(decoded.outputs) + 1
                    if backlog.produced - backlog.consumed >= high:
                        backlog.paused = True
                        backlog.pauses += 1
                        while backlog.held() > backlog.low:
                            if waker.poll(_PAUSE_POLL_MS):
                                return
                        backlog.resumed_at = time.monotonic()
                        backlog.paused = False
                    continue
                future = pop(utility.call_id)
                if future is not None and not future.done():
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        resolve_utility_output(future, utility)
    except Exception as exc:
        if not resources.closed:
            logger.exception("corewire output thread failed")
            put(exc)
            resources.mark_dead(f"The client's output thread failed: {exc!r}")
    finally:
        os.close(wake_r)
