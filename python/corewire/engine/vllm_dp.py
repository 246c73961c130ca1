"""An engine core that is one rank of a DP group run by vLLM 0.25.1's own DP coordinator.

A vLLM front-end with ``--data-parallel-size N`` (N > 1) starts vLLM's ``DPCoordinator``
and hands its two engine-side addresses to every engine in the start-up handshake
(:mod:`corewire.engine.handshake`). :class:`VllmDPEngineCoreProc` speaks what that
coordinator expects of an engine:

- ``coordinator_input`` is the coordinator's XPUB: the engine connects an XSUB (identity
  = its index), sends ``b"\\x01"`` to subscribe, and waits for ``b"READY"``, which the
  coordinator sends once every engine of the group subscribed. Later it may publish
  START_DP_WAVE (``[b"\\x02", msgpack [wave, exclude_index or nil]]``) and more
  ``b"READY"`` frames (when an engine re-subscribes); the input thread polls this socket
  with the request links.
- ``coordinator_output`` is the coordinator's PULL: the engine pushes EngineCoreOutputs
  carrying only ``scheduler_stats`` ``{num_running_reqs, num_waiting_reqs, step_counter,
  current_wave}`` whenever its ``[waiting, running]`` counts change (before and after each
  step, as vLLM's ``DPEngineCoreProc`` does). The coordinator publishes the counts to the
  front-ends, whose load balancer routes by them.
- Finished and aborted request ids go out in ``finished_requests`` (vLLM's load-balancing
  client forgets its routing entry for a request by them).

Under vLLM 0.33.0 (``release="0.33.0"``) the reports are what 0.33.0's own engines for
non-MoE models send: ``SchedulerStats(num_running_reqs, num_waiting_reqs,
kv_cache_usage)`` whenever ``(running, waiting)`` changed (``kv_cache_usage`` from the
engine's ``scheduler_stats()``, 0.0 without it), no wave or step; the coordinator
publishes ``[waiting, running, kv_cache_usage]`` per engine. 0.33.0's coordinator runs no
waves for such a group (and its front-ends send no first-request notices), so the engine
sends no ``start_wave`` either.

Waves: vLLM coordinates waves only for MoE models, whose ranks step in lockstep with a
collective all-reduce; for other models its coordinator ignores ``wave_complete`` /
``start_wave`` and its engines run independently. corewire engines have no collective
to join, so they run independently too: ``current_wave`` follows START_DP_WAVE and the
waves stamped on requests, and is reported with the counts. ``step_counter`` is reported
as 0: the coordinator orders stats by (wave, step) across the whole group, which only
means something for lockstep ranks; a constant keeps independent ranks' reports from
looking out of order. The handshake refuses a coordinated (MoE) group.

Wire format: docs/protocol.md §3.3 (the coordinator subscription) and §8.1 (vLLM's
coordinator).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec
import zmq

from corewire.dp_messages import COORDINATOR_READY, XPUB_SUBSCRIBE, StartWave
from corewire.engine.core import EngineCoreProc
from corewire.engine.interface import Engine
from corewire.logtext import bounded
from corewire.protocol import REQUEST_START_DP_WAVE, EngineCoreRequest

__all__ = ["VllmDPEngineCoreProc"]

logger = logging.getLogger("corewire.engine")


class VllmDPEngineCoreProc(EngineCoreProc):
    """A DP rank behind vLLM's DP coordinator (see the module docstring).

    Keyword options beyond the base class: ``coordinator_input`` (the coordinator's
    XPUB), ``coordinator_output`` (its PULL), ``data_parallel_size`` (reported in the
    ready response). ``include_finished_set`` defaults to True here.
    """

    PROC_UTILITIES: ClassVar[frozenset[str]] = EngineCoreProc.PROC_UTILITIES | {"dp_state"}

    def __init__(
        self,
        engine: Engine,
        *,
        coordinator_input: str,
        coordinator_output: str,
        data_parallel_size: int = 1,
        **options: Any,
    ) -> None:
        options.setdefault("include_finished_set", True)
        super().__init__(engine, **options)
        self.coordinator_input = coordinator_input
        self.coordinator_output = coordinator_output
        self.data_parallel_size = data_parallel_size
        self.current_wave = 0
        self._last_counts: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ sockets

    def _open_extra_inputs(
        self, ctx: zmq.Context[Any]
    ) -> list[tuple[zmq.Socket[Any], Callable[[list[zmq.Frame]], None]]]:
        """Subscribe to the coordinator and wait for its go-ahead (the whole group
        subscribed) before this engine counts as ready."""
        sock = self._connect(zmq.XSUB, self.coordinator_input, identity=self.identity)
        try:
            sock.send(XPUB_SUBSCRIBE)
            logged = time.monotonic()
            while not sock.poll(200):
                if self.input_stopping():
                    raise RuntimeError("stopped while waiting for the DP coordinator")
                if time.monotonic() - logged > 10.0:
                    logged = time.monotonic()
                    logger.info("waiting for READY from the DP coordinator")
            first = sock.recv()
            if first != COORDINATOR_READY:
                raise RuntimeError(f"DP coordinator sent {first[:40]!r} instead of READY")
        except BaseException:
            sock.close(linger=0)
            raise
        return [(sock, self._on_coordinator_message)]

    def _on_coordinator_message(self, frames: list[zmq.Frame]) -> None:
        """Input thread: START_DP_WAVE goes to the busy loop; READY (sent again when an
        engine re-subscribes) is ignored; anything else is logged and dropped."""
        kind = frames[0].bytes
        if kind == COORDINATOR_READY:
            return
        try:
            if kind != REQUEST_START_DP_WAVE or len(frames) < 2:
                raise ValueError(f"unknown message type {kind[:8]!r}")
            payload = msgspec.msgpack.decode(frames[1].buffer)
            wave = StartWave.from_payload(payload, nil_excludes_none=True)
        except (ValueError, msgspec.DecodeError) as exc:  # ProtocolError is a ValueError
            logger.warning("dropping a malformed DP coordinator message: %s", bounded(exc))
            return
        self.input_queue.put(wave)

    # ------------------------------------------------------------------ busy loop hooks

    def _handle_add(self, request: EngineCoreRequest) -> None:
        # A front-end that saw a newer wave than this engine did.
        if request.current_wave > self.current_wave:
            self.current_wave = request.current_wave
        super()._handle_add(request)

    def _handle_start_dp_wave(self, new_wave: int, exclude_engine_index: int) -> None:
        """START_DP_WAVE: move to ``new_wave`` unless this is the excluded engine."""
        if exclude_engine_index != self.engine_index and new_wave >= self.current_wave:
            self.current_wave = new_wave

    # ------------------------------------------------------------------ coordinator

    def _report_load(self) -> None:
        """Send ``[waiting, running]`` to the coordinator when they (or the wave)
        changed; an engine without ``scheduler_stats()`` reports nothing."""
        stats = self.engine.scheduler_stats()
        if stats is None:
            return
        waiting = int(stats.get("num_waiting_reqs", 0))
        running = int(stats.get("num_running_reqs", 0))
        if not self.release.counts_carry_kv_usage:
            counts: tuple[int, ...] = (waiting, running, self.current_wave)
            report = {
                "num_running_reqs": running,
                "num_waiting_reqs": waiting,
                "step_counter": 0,
                "current_wave": self.current_wave,
            }
        else:
            # 0.33.0: the counts alone decide, and the KV cache's use goes along.
            counts = (waiting, running)
            report = {
                "num_running_reqs": running,
                "num_waiting_reqs": waiting,
                "kv_cache_usage": float(stats.get("kv_cache_usage", 0.0)),
            }
        if counts == self._last_counts:
            return
        self._last_counts = counts
        self._to_coordinator(self._outputs(scheduler_stats=report))

    def dp_state(self) -> dict[str, Any]:
        """This engine's DP view (for tests and operators)."""
        return {
            "engine_index": self.engine_index,
            "current_wave": self.current_wave,
            "data_parallel_size": self.data_parallel_size,
            "last_counts": list(self._last_counts) if self._last_counts else None,
        }
