"""The data-parallel engine core: one member of a DP group run by a coordinator.

:class:`DPEngineCoreProc` extends :class:`~corewire.engine.core.EngineCoreProc` with:

- **Stats to the coordinator.** One more PUSH socket (after the client sockets) connects
  to the coordinator's stats address. Whenever the engine's ``[waiting, running]``
  counts, its wave number or its running/paused state change, it sends an
  EngineCoreOutputs with ``scheduler_stats`` ``{num_waiting_reqs, num_running_reqs,
  current_wave, step_counter}`` there (under vLLM 0.33.0 also ``kv_cache_usage``, from
  the engine's ``scheduler_stats()``, 0.0 without it: that coordinator publishes it).
- **Waves** (see :mod:`corewire.coordinator`). The input thread also subscribes to the
  coordinator's wave publisher and feeds START_DP_WAVE and WAVE_COMPLETE into the input
  queue (:mod:`corewire.dp_messages`), so the busy loop applies them in order with
  requests. State: ``current_wave`` and ``engines_running`` (paused vs running). A request
  stamped with a newer wave moves the engine forward; one stamped with a wave that already
  ended while the engine was paused makes it send ``start_wave`` so the coordinator wakes
  the others (under vLLM 0.33.0, whose front-ends send no first-request notices, any
  request that reaches a paused engine does). START_DP_WAVE (from the coordinator, or a
  front-end on the input link) sets the engine running unless it is the excluded one.
  WAVE_COMPLETE pauses it, except that an engine still holding requests (they raced the
  end of the wave) asks for the next wave at once. While running without local work, an
  engine that defines ``execute_dummy_batch()`` runs it each loop (engines whose steps
  hold collectives must step in lockstep); others just wait for input.
- **Elastic scaling** utilities, called by the front-end (they are methods of the proc,
  not of the engine): ``reconfigure_data_parallel(new_size)`` and
  ``shutdown_for_scale_down()``. Each sends a notification as a utility output with
  call_id -1 (``EEP_NOTIFICATION_CALL_ID``) and result ``[notification_type,
  engine_rank]`` (``EEPNotificationType``: ``"RECONFIGURE_FINISHED"`` /
  ``"SHUTDOWN_COMPLETE"``) to every client. A retiring
  engine first finishes each request it holds with ``FinishReason.ABORT`` (so no caller
  waits forever), sends the notification, then stops.
- ``dp_state()``: the engine's DP view, for front-ends and tests.

Without a coordinator address it behaves like the plain proc (a launcher may pass DP
options to a single engine).

Wire format: docs/protocol.md §8.2 (corewire's coordinator) and §5.6 (elastic-scaling
notifications).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import zmq

from corewire.dp_messages import CoordinatorLinks, decode_wave_message
from corewire.engine.core import EngineCoreProc
from corewire.engine.interface import Engine
from corewire.keygen import CurveClientKeys, apply_client
from corewire.logtext import bounded
from corewire.protocol import (
    EEP_NOTIFICATION_CALL_ID,
    EEPNotificationType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    UtilityOutput,
    UtilityResult,
)

__all__ = ["DPEngineCoreProc"]

logger = logging.getLogger("corewire.engine")


class DPEngineCoreProc(EngineCoreProc):
    """An engine core that is one rank of a data-parallel group (see the module doc).

    Extra keyword options (all optional): ``data_parallel_size``,
    ``coordinator_addresses`` (``CoordinatorAddresses.for_engine()``, a
    :class:`~corewire.dp_messages.CoordinatorLinks`: front, stats, wave), ``curve_keys``
    (``CurveClientKeys.to_wire()``: used on every socket that connects to a ``tcp://``
    address).
    """

    PROC_UTILITIES: ClassVar[frozenset[str]] = EngineCoreProc.PROC_UTILITIES | {
        "dp_state",
        "reconfigure_data_parallel",
        "shutdown_for_scale_down",
    }

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
        #: The coordinator's wave XPUB (None without a coordinator); its stats PULL is
        #: :attr:`coordinator_output`.
        self.coordinator_wave_address: str | None = None
        if coordinator_addresses is not None:
            links = CoordinatorLinks(*coordinator_addresses)
            self.coordinator_output = links.engine_stats
            self.coordinator_wave_address = links.engine_publish
            # The ready response names the publisher front-ends subscribe to.
            if self.dp_stats_address is None and links.front_publish:
                self.dp_stats_address = links.front_publish
        self._last_report: tuple[int, int, int, bool] | None = None
        self._dummy_batch = getattr(engine, "execute_dummy_batch", None)

    # ------------------------------------------------------------------ sockets

    def configure_socket(self, sock: zmq.Socket[Any], address: str) -> None:
        """Runs on each socket before it connects to ``address``: CURVE client keys for
        ``tcp://`` peers."""
        if self.curve_keys is not None and address.startswith("tcp://"):
            apply_client(sock, self.curve_keys)

    def _open_extra_inputs(
        self, ctx: zmq.Context[Any]
    ) -> list[tuple[zmq.Socket[Any], Callable[[list[zmq.Frame]], None]]]:
        """The coordinator's wave publisher, subscribed to everything (a late subscriber
        gets the current wave state at once)."""
        if self.coordinator_wave_address is None:
            return []
        sock = self._connect(
            zmq.SUB, self.coordinator_wave_address, options=((zmq.SUBSCRIBE, b""),)
        )
        return [(sock, self._on_wave_message)]

    def _on_wave_message(self, frames: list[zmq.Frame]) -> None:
        """Input thread: a coordinator's wave message goes to the busy loop."""
        try:
            message = decode_wave_message([f.buffer for f in frames])
        except Exception as exc:  # ProtocolError, and RecursionError of a nested payload
            # The request link shares this thread: a bad wave message must not end it.
            logger.warning("dropping a malformed coordinator message: %s", bounded(exc))
            return
        self.input_queue.put(message)

    # ------------------------------------------------------------------ busy loop hooks

    def _has_work(self) -> bool:
        if super()._has_work():
            return True
        return self.engines_running and self._dummy_batch is not None

    def _process_engine_step(self) -> bool:
        if self.engine.has_unfinished_requests():
            sent = super()._process_engine_step()
        else:
            sent = False
            if self.engines_running and self._dummy_batch is not None:
                self._dummy_batch()
        self.step_counter += 1
        return sent

    def _scheduler_stats(self) -> dict[str, Any] | None:
        stats = super()._scheduler_stats()
        if stats is not None:
            stats = {**stats, "current_wave": self.current_wave, "step_counter": self.step_counter}
        return stats

    # ------------------------------------------------------------------ requests

    def _handle_add(self, request: EngineCoreRequest) -> None:
        if self.release.engine_led_waves:
            self._handle_add_engine_led(request)
            return
        if request.current_wave != self.current_wave:
            if request.current_wave > self.current_wave:
                # The front-end knows of a newer wave than this engine has heard of.
                self.current_wave = request.current_wave
            elif not self.engines_running:
                # A request for a wave that ended while this engine was paused: the
                # others are paused too; ask the coordinator to wake them.
                self._ask_for_wave(self.current_wave)
        self.engines_running = True
        super()._handle_add(request)

    def _handle_add_engine_led(self, request: EngineCoreRequest) -> None:
        """An ADD under vLLM 0.33.0, whose front-ends send no first-request notices:
        engines alone start waves. An idle engine that took a request asks the
        coordinator to wake the others, whichever wave the request names; a refused
        request, or one queued behind a paused scheduler, starts none (as in vLLM)."""
        if request.current_wave > self.current_wave:
            self.current_wave = request.current_wave
        super()._handle_add(request)
        if (
            not self.engines_running
            and request.request_id in self._in_flight
            and not self._scheduler_paused()
        ):
            self.engines_running = True
            self._ask_for_wave(self.current_wave)

    def _scheduler_paused(self) -> bool:
        """Whether the engine's scheduler is paused (False for an engine without one)."""
        paused = getattr(self.engine, "is_scheduler_paused", None)
        return bool(paused()) if callable(paused) else False

    def _handle_start_dp_wave(self, new_wave: int, exclude_engine_index: int) -> None:
        """START_DP_WAVE: join wave ``new_wave`` unless this engine is the excluded one."""
        if exclude_engine_index != self.engine_index and new_wave >= self.current_wave:
            self.current_wave = new_wave
            self.engines_running = True
            self._report_load()

    def _handle_wave_complete(self, wave: int) -> None:
        """The coordinator ended ``wave``: pause, unless requests raced its end."""
        if wave < self.current_wave:
            return  # this engine already moved past it
        self.current_wave = wave + 1
        self.step_counter = 0
        self.engines_running = bool(self._in_flight)
        if self._in_flight:
            self._ask_for_wave(self.current_wave)
        self._report_load()

    # ------------------------------------------------------------------ coordinator

    def _ask_for_wave(self, wave: int) -> None:
        """Ask the coordinator to start ``wave`` (with this engine's counts)."""
        self._to_coordinator(self._outputs(scheduler_stats=self._counts_stats(), start_wave=wave))

    def _counts_stats(self) -> dict[str, Any]:
        stats = self.engine.scheduler_stats()
        if stats is None:  # an engine without counters: all it holds counts as running
            waiting, running = 0, len(self._in_flight)
        else:
            waiting = int(stats.get("num_waiting_reqs", 0))
            running = int(stats.get("num_running_reqs", 0))
        counts = {
            "num_waiting_reqs": waiting,
            "num_running_reqs": running,
            "current_wave": self.current_wave,
            "step_counter": self.step_counter,
        }
        if self.release.counts_carry_kv_usage:
            counts["kv_cache_usage"] = float((stats or {}).get("kv_cache_usage", 0.0))
        return counts

    def _report_load(self) -> None:
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
        self._to_coordinator(self._outputs(scheduler_stats=stats))

    # ------------------------------------------------------------------ utilities

    def _notify(self, notification_type: EEPNotificationType) -> None:
        """Send a call_id -1 notification ``[type, engine_rank]`` to every client."""
        result = UtilityResult([notification_type.value, self.engine_index])
        for client_index in range(len(self.output_addresses)):
            utility = UtilityOutput(EEP_NOTIFICATION_CALL_ID, None, result)
            self.output_queue.put((client_index, self._outputs(utility_output=utility)))

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
        self._notify(EEPNotificationType.RECONFIGURE_FINISHED)
        return new_size

    def shutdown_for_scale_down(self) -> int:
        """Leave the group: finish every held request with ABORT, notify
        SHUTDOWN_COMPLETE, then stop. Returns how many requests were aborted."""
        ids = sorted(self._in_flight)
        if ids:
            self.engine.abort_requests(ids)
            self._in_flight.clear()
            self._send_outputs(
                self._outputs(
                    outputs=[
                        EngineCoreOutput(
                            request_id=rid, new_token_ids=[], finish_reason=FinishReason.ABORT
                        )
                        for rid in ids
                    ],
                    finished_requests=set(ids),
                )
            )
        self.engines_running = False
        self._report_load()
        self._notify(EEPNotificationType.SHUTDOWN_COMPLETE)
        # The utility reply and everything above are queued before the stop sentinel.
        self.request_stop()
        return len(ids)
