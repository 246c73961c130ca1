"""The data-parallel engine core: one member of a DP group run by a coordinator.

:class:`DPEngineCoreProc` extends :class:`~corewire.engine.core.EngineCoreProc` with:

- **Stats to the coordinator.** One more PUSH socket (after the client sockets) connects
  to the coordinator's stats address. Whenever the engine's ``[waiting, running]``
  counts, its wave number or its running/paused state change, it sends an
  EngineCoreOutputs with ``scheduler_stats`` ``{num_waiting_reqs, num_running_reqs,
  current_wave, step_counter}`` there.
- **Waves** (see :mod:`corewire.coordinator`). A thread of its own (``...-dp-wave``)
  subscribes to the coordinator's wave publisher and feeds START_DP_WAVE and
  WAVE_COMPLETE into the input queue, so the busy loop applies them in order with
  requests. State: ``current_wave`` and ``engines_running`` (paused vs running). A
  request stamped with a newer wave moves the engine forward; one stamped with a wave
  that already ended while the engine was paused makes it send ``start_wave`` so the
  coordinator wakes the others. START_DP_WAVE (from the coordinator, or a front-end on
  the input link) sets the engine running unless it is the excluded one. WAVE_COMPLETE
  pauses it, except that an engine still holding requests (they raced the end of the
  wave) asks for the next wave at once. While running without local work, an engine
  that defines ``execute_dummy_batch()`` runs it each loop (engines whose steps hold
  collectives must step in lockstep); others just wait for input.
- **Elastic scaling** utilities, called by the front-end (they are methods of the proc,
  not of the engine): ``reconfigure_data_parallel(new_size)`` and
  ``shutdown_for_scale_down()``. Each sends a notification as a utility output with
  call_id -1 and result ``[notification_type, engine_rank]``
  (``"RECONFIGURE_FINISHED"`` / ``"SHUTDOWN_COMPLETE"``) to every client. A retiring
  engine first finishes each request it holds with ``FinishReason.ABORT`` (so no caller
  waits forever), sends the notification, then stops.
- ``dp_state()``: the engine's DP view, for front-ends and tests.

Without a coordinator address it behaves like the plain proc (a launcher may pass DP
options to a single engine).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from corewire.engine.core import EngineCoreProc
from corewire.engine.interface import Engine
from corewire.keygen import CurveClientKeys, apply_client
from corewire.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    UtilityOutput,
    UtilityResult,
)

__all__ = [
    "NOTIFICATION_CALL_ID",
    "NOTIFY_RECONFIGURE_FINISHED",
    "NOTIFY_SHUTDOWN_COMPLETE",
    "DPEngineCoreProc",
]

logger = logging.getLogger("corewire.engine")

#: call_id of an elastic-scaling notification (never a registered call).
NOTIFICATION_CALL_ID = -1
#: An engine applied a new DP size.
NOTIFY_RECONFIGURE_FINISHED = "RECONFIGURE_FINISHED"
#: An engine removed by a scale-down aborted its requests and is stopping.
NOTIFY_SHUTDOWN_COMPLETE = "SHUTDOWN_COMPLETE"

# Input-queue kinds of this subclass (the base class uses small integers).
_IN_DP_START = 100
_IN_DP_COMPLETE = 101

_START_DP_WAVE = b"\x02"
_WAVE_COMPLETE = b"\x10"

#: Proc-level utility methods (resolved before the engine's own).
_DP_UTILITIES = frozenset({"dp_state", "reconfigure_data_parallel", "shutdown_for_scale_down"})


class DPEngineCoreProc(EngineCoreProc):
    """An engine core that is one rank of a data-parallel group (see the module doc).

    Extra keyword options (all optional): ``data_parallel_size``,
    ``coordinator_addresses`` (``CoordinatorAddresses.to_wire()``: front, stats, wave),
    ``curve_keys`` (``CurveClientKeys.to_wire()``: used on every socket that connects to
    a ``tcp://`` address).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        data_parallel_size: int = 1,
        coordinator_addresses: Sequence[str] | None = None,
        curve_keys: Sequence[str] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(engine, **options)
        self.data_parallel_size = data_parallel_size
        self.current_wave = 0
        self.engines_running = False
        self.step_counter = 0
        self.curve_keys = CurveClientKeys.from_wire(list(curve_keys)) if curve_keys else None
        #: The coordinator's stats PULL and wave XPUB (None without a coordinator).
        self.coordinator_stats_address: str | None = None
        self.coordinator_wave_address: str | None = None
        #: Index of the coordinator's PUSH socket among the output sockets.
        self.coordinator_index: int | None = None
        if coordinator_addresses is not None:
            front, self.coordinator_stats_address, self.coordinator_wave_address = (
                coordinator_addresses
            )
            # The ready response names the publisher front-ends subscribe to.
            if self.dp_stats_address is None and front:
                self.dp_stats_address = front
            self.coordinator_index = len(self.output_addresses)
        self._last_report: tuple[int, int, int, bool] | None = None
        self._dummy_batch = getattr(engine, "execute_dummy_batch", None)
        self._wave_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ sockets, threads

    def configure_socket(self, sock: zmq.Socket[Any], address: str) -> None:
        """Runs on each socket before it connects to ``address``: CURVE client keys for
        ``tcp://`` peers; no linger towards the coordinator (stats are disposable, and a
        coordinator that is gone must not hold this process at exit)."""
        if address == self.coordinator_stats_address:
            sock.setsockopt(zmq.LINGER, 0)
        if self.curve_keys is not None and address.startswith("tcp://"):
            apply_client(sock, self.curve_keys)

    def _all_output_addresses(self) -> list[str]:
        addresses = super()._all_output_addresses()
        if self.coordinator_stats_address is not None:
            addresses.append(self.coordinator_stats_address)
        return addresses

    def _start_io_threads(self) -> None:
        super()._start_io_threads()
        if self.coordinator_wave_address is not None:
            self._wave_thread = threading.Thread(
                target=self._wave_thread_main,
                name=f"corewire-engine-{self.engine_index}-dp-wave",
                daemon=True,
            )
            self._wave_thread.start()

    def _close(self) -> None:
        # The wave thread's socket must be closed before the base class ends the context.
        self._input_stop.set()
        if self._wave_thread is not None:
            self._wave_thread.join(timeout=5.0)
        super()._close()

    def _wave_thread_main(self) -> None:
        assert self.coordinator_wave_address is not None  # only started with an address
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            self.configure_socket(sock, self.coordinator_wave_address)
            sock.connect(self.coordinator_wave_address)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            decode = msgspec.msgpack.decode
            put = self.input_queue.put
            while not self._input_stop.is_set():
                if not poller.poll(200):
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        kind, payload = frames[0], decode(frames[1])
                        if kind == _START_DP_WAVE:
                            put((_IN_DP_START, int(payload[0]), int(payload[1])))
                        elif kind == _WAVE_COMPLETE:
                            put((_IN_DP_COMPLETE, int(payload[0])))
                        else:
                            raise ValueError(f"unknown type {kind!r}")
                    except (IndexError, ValueError, TypeError, msgspec.DecodeError) as exc:
                        logger.warning("dropping a malformed coordinator message: %s", exc)
        except Exception:
            if not self._input_stop.is_set():
                logger.exception("engine DP wave thread failed")
        finally:
            sock.close(linger=0)

    # ------------------------------------------------------------------ busy loop hooks

    def _has_work(self) -> bool:
        if super()._has_work():
            return True
        return self.engines_running and self._dummy_batch is not None

    def _process_input_queue(self) -> None:
        super()._process_input_queue()
        self._report_counts()

    def _process_engine_step(self) -> bool:
        if self.engine.has_unfinished_requests():
            sent = super()._process_engine_step()
        else:
            sent = False
            if self.engines_running and self._dummy_batch is not None:
                self._dummy_batch()
        self.step_counter += 1
        self._report_counts()
        return sent

    def _scheduler_stats(self) -> dict[str, Any] | None:
        stats = super()._scheduler_stats()
        if stats is not None:
            stats = {**stats, "current_wave": self.current_wave, "step_counter": self.step_counter}
        return stats

    def _data_parallel_size(self) -> int:
        return self.data_parallel_size

    # ------------------------------------------------------------------ requests

    def _handle_input(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == _IN_DP_START:
            self._handle_start_dp_wave(item[1], item[2])
        elif kind == _IN_DP_COMPLETE:
            self._handle_wave_complete(item[1])
        else:
            super()._handle_input(item)

    def _handle_add(self, request: EngineCoreRequest) -> None:
        if request.current_wave != self.current_wave:
            if request.current_wave > self.current_wave:
                # The front-end knows of a newer wave than this engine has heard of.
                self.current_wave = request.current_wave
            elif not self.engines_running:
                # A request for a wave that ended while this engine was paused: the
                # others are paused too; ask the coordinator to wake them.
                self._to_coordinator(start_wave=self.current_wave)
        self.engines_running = True
        super()._handle_add(request)

    def _handle_abort(self, request_ids: list[str]) -> None:
        super()._handle_abort(request_ids)
        # Aborts may arrive while the loop waits for input (a paused scheduler holding
        # requests): report now, not at the next step.
        self._report_counts()

    def _handle_start_dp_wave(self, new_wave: int, exclude_engine_index: int) -> None:
        """START_DP_WAVE: join wave ``new_wave`` unless this engine is the excluded one."""
        if exclude_engine_index != self.engine_index and new_wave >= self.current_wave:
            self.current_wave = new_wave
            self.engines_running = True
            self._report_counts()

    def _handle_wave_complete(self, wave: int) -> None:
        """The coordinator ended ``wave``: pause, unless requests raced its end."""
        if wave < self.current_wave:
            return  # this engine already moved past it
        self.current_wave = wave + 1
        self.step_counter = 0
        self.engines_running = bool(self._in_flight)
        if self._in_flight:
            self._to_coordinator(start_wave=self.current_wave)
        self._report_counts()

    # ------------------------------------------------------------------ coordinator

    def _to_coordinator(self, *, start_wave: int | None = None) -> None:
        if self.coordinator_index is None:
            return
        self._send_outputs(
            EngineCoreOutputs(
                engine_index=self.engine_index,
                scheduler_stats=self._counts_stats(),
                timestamp=time.monotonic(),
                start_wave=start_wave,
            ),
            self.coordinator_index,
        )

    def _counts_stats(self) -> dict[str, Any]:
        stats = self.engine.scheduler_stats()
        if stats is None:  # an engine without counters: all it holds counts as running
            waiting, running = 0, len(self._in_flight)
        else:
            waiting = int(stats.get("num_waiting_reqs", 0))
            running = int(stats.get("num_running_reqs", 0))
        return {
            "num_waiting_reqs": waiting,
            "num_running_reqs": running,
            "current_wave": self.current_wave,
            "step_counter": self.step_counter,
        }

    def _report_counts(self) -> None:
        """Send the counts to the coordinator if they (or the wave state) changed."""
        if self.coordinator_index is None:
            return
        stats = self._counts_stats()
        key = (
            stats["num_waiting_reqs"],
            stats["num_running_reqs"],
            self.current_wave,
            self.engines_running,
        )
        if key == self._last_report:
            return
        self._last_report = key
        self._send_outputs(
            EngineCoreOutputs(
                engine_index=self.engine_index,
                scheduler_stats=stats,
                timestamp=time.monotonic(),
            ),
            self.coordinator_index,
        )

    # ------------------------------------------------------------------ utilities

    def _resolve_utility(self, method: str) -> Any:
        if method in _DP_UTILITIES:
            return getattr(self, method)
        return super()._resolve_utility(method)

    def _notify(self, notification_type: str) -> None:
        """Send a call_id -1 notification ``[type, engine_rank]`` to every client."""
        for client_index in range(len(self.output_addresses)):
            self.output_queue.put(
                (
                    client_index,
                    EngineCoreOutputs(
                        engine_index=self.engine_index,
                        timestamp=time.monotonic(),
                        utility_output=UtilityOutput(
                            NOTIFICATION_CALL_ID,
                            None,
                            UtilityResult([notification_type, self.engine_index]),
                        ),
                    ),
                )
            )

    def dp_state(self) -> dict[str, Any]:
        """This engine's DP view: wave, running state, group size and requests held."""
        return {
            "engine_index": self.engine_index,
            "current_wave": self.current_wave,
            "engines_running": self.engines_running,
            "data_parallel_size": self.data_parallel_size,
            "num_requests": len(self._in_flight),
        }

    def reconfigure_data_parallel(self, new_size: int) -> int:
        """Adopt a new DP group size (elastic scaling); notifies RECONFIGURE_FINISHED."""
        if type(new_size) is not int or new_size < 1:
            raise ValueError(f"new_size must be a positive int, got {new_size!r}")
        if self.engine_index >= new_size:
            raise ValueError(
                f"engine {self.engine_index} cannot stay in a group of {new_size}; "
                "call shutdown_for_scale_down()"
            )
        self.data_parallel_size = new_size
        self._notify(NOTIFY_RECONFIGURE_FINISHED)
        return new_size

    def shutdown_for_scale_down(self) -> int:
        """Leave the group: finish every held request with ABORT, notify
        SHUTDOWN_COMPLETE, then stop. Returns how many requests were aborted."""
        ids = sorted(self._in_flight)
        if ids:
            self.engine.abort_requests(ids)
            self._in_flight.clear()
            self._send_outputs(
                EngineCoreOutputs(
                    engine_index=self.engine_index,
                    outputs=[
                        EngineCoreOutput(
                            request_id=rid, new_token_ids=[], finish_reason=FinishReason.ABORT
                        )
                        for rid in ids
                    ],
                    timestamp=time.monotonic(),
                    finished_requests=set(ids),
                )
            )
        self.engines_running = False
        self._report_counts()
        self._notify(NOTIFY_SHUTDOWN_COMPLETE)
        # The utility reply and everything above are queued before the stop sentinel.
        self.request_stop()
        return len(ids)
