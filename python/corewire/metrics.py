"""Prometheus metrics of corewire's clients: every definition and the on/off switch.

Metrics are on when ``prometheus_client`` is installed (``pip install 'corewire[metrics]'``)
unless ``COREWIRE_METRICS=0`` (or ``false``, ``no``, ``off``). They live in
``prometheus_client``'s default registry, the one vLLM's API server serves at ``/metrics``
With ``--api-server-count`` > 1, vLLM serves ``prometheus_client``'s multiprocess
collector (``PROMETHEUS_MULTIPROC_DIR``), which reads what every API server wrote to its
files: counters and histograms write there as they count; the two gauges, read from the
clients at scrape time in one process, are copied there once a second by a thread
(``livesum``: the live API servers' values added up).

Every client asks :func:`for_client` once, at construction: None when metrics are off,
so that the clients' hot paths hold either the plain decoder or the timed one of
:meth:`ClientMetrics.wrap_decode`, never a per-message test of the switch. Counting is
per message (``len(outputs.outputs)`` once), never per output.

=======================================  =========  ==============  ========================
Name                                     Type       Labels          Meaning
=======================================  =========  ==============  ========================
corewire_frames_received_total           counter    client, engine  output messages decoded
corewire_outputs_received_total          counter    client, engine  request outputs in them
corewire_decode_seconds                  histogram  client, engine  decode time per message
corewire_output_backlog                  gauge      client          outputs (+1 per message)
                                                                    waiting for the consumer
corewire_pending_utility_calls           gauge      client          utility calls in flight
corewire_engine_deaths_total             counter    client          engines found dead
corewire_protocol_errors_total           counter    client          frames that did not decode
corewire_protocol_error_requests_total   counter    client          requests ended by a bad
                                                                    frame (vLLM adapter)
=======================================  =========  ==============  ========================

``client`` is the client's index (vLLM's API-server index); clients of one process with
the same index share their series (the gauges add up). ``engine`` is the engine index
(data-parallel rank) each message names.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from corewire._optional import import_optional, is_installed

__all__ = ["ENV_SWITCH", "ClientMetrics", "enabled", "for_client"]

#: The switch: "0" (or "false", "no", "off") turns metrics off.
ENV_SWITCH = "COREWIRE_METRICS"
_FALSE = frozenset({"0", "false", "no", "off"})
_TRUE = frozenset({"", "1", "true", "yes", "on"})

# Decode time of one message: a few µs (a small frame) to tens of ms (a large batch with
# logprobs). Few buckets: each observation walks them.
_DECODE_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)
#: Seconds between copies of the gauges to the multiprocess files.
MULTIPROCESS_REFRESH_S = 1.0


def enabled() -> bool:
    """Whether metrics are on: ``prometheus_client`` is installed and
    ``COREWIRE_METRICS`` does not turn them off (``ValueError`` for another value)."""
    raw = os.environ.get(ENV_SWITCH, "").strip().lower()
    if raw in _FALSE:
        return False
    if raw not in _TRUE:
        raise ValueError(f"{ENV_SWITCH} must be 1 or 0, got {os.environ[ENV_SWITCH]!r}")
    return is_installed("prometheus_client")


class _Family:
    """The metric objects, made once per process in the default registry."""

    def __init__(self) -> None:
        prom = import_optional("prometheus_client", "corewire's metrics")
        both = ("client", "engine")
        self.frames = prom.Counter(
            "corewire_frames_received_total",
            "Output messages received and decoded from engines (one EngineCoreOutputs each).",
            both,
        )
        self.outputs = prom.Counter(
            "corewire_outputs_received_total",
            "Request outputs (EngineCoreOutput) in the received messages.",
            both,
        )
        self.decode = prom.Histogram(
            "corewire_decode_seconds",
            "Time to decode one output message.",
            both,
            buckets=_DECODE_BUCKETS,
        )
        # The environment variable vLLM sets, and reads, for its multiprocess registry.
        self.multiprocess = os.environ.get("PROMETHEUS_MULTIPROC_DIR") is not None
        mode = {"multiprocess_mode": "livesum"} if self.multiprocess else {}
        self.backlog = prom.Gauge(
            "corewire_output_backlog",
            "Outputs (plus one per message) received and not yet taken by the consumer.",
            ("client",),
            **mode,
        )
        self.pending = prom.Gauge(
            "corewire_pending_utility_calls",
            "Utility calls sent and not yet answered.",
            ("client",),
            **mode,
        )
        self.deaths = prom.Counter(
            "corewire_engine_deaths_total",
            "Engine deaths a client saw (process exit, ENGINE_CORE_DEAD, failed health check).",
            ("client",),
        )
        self.protocol_errors = prom.Counter(
            "corewire_protocol_errors_total",
            "Output frames that broke the protocol (did not decode).",
            ("client",),
        )
        self.error_requests = prom.Counter(
            "corewire_protocol_error_requests_total",
            "Requests finished with an error because a frame carrying their outputs broke "
            "the protocol (vLLM adapter).",
            ("client",),
        )
        # Clients alive per client label, read by the gauges at scrape time: a tuple
        # replaced under the lock, so a scrape reads one without it.
        self.live: dict[str, tuple[ClientMetrics, ...]] = {}
        self.lock = threading.Lock()
        self.refresher: threading.Thread | None = None

    def export_gauges(self, client: str) -> None:
        """Export the gauges of the clients labelled ``client`` (under :attr:`lock`)."""
        if not self.multiprocess:
            # Read at scrape time: nothing runs between scrapes.
            backlog = functools.partial(_sum_live, self, client, "backlog")
            pending = functools.partial(_sum_live, self, client, "pending")
            self.backlog.labels(client).set_function(backlog)
            self.pending.labels(client).set_function(pending)
        elif self.refresher is None:
            # The multiprocess collector reads files only: copy the values there.
            self.refresher = threading.Thread(
                target=self._refresh, name="corewire-metrics", daemon=True
            )
            self.refresher.start()

    def _refresh(self) -> None:
        while True:
            with self.lock:
                clients = list(self.live)
            for client in clients:
                self.backlog.labels(client).set(_sum_live(self, client, "backlog"))
                self.pending.labels(client).set(_sum_live(self, client, "pending"))
            time.sleep(MULTIPROCESS_REFRESH_S)


_family: _Family | None = None
_family_lock = threading.Lock()


def _get_family() -> _Family:
    global _family
    with _family_lock:
        if _family is None:
            _family = _Family()
        return _family


def for_client(client_index: int) -> ClientMetrics | None:
    """The metrics of a new client, or None when metrics are off (see :func:`enabled`)."""
    if not enabled():
        return None
    return ClientMetrics(_get_family(), str(client_index))


class ClientMetrics:
    """One client's view of the metrics: label children bound once, cheap hooks."""

    __slots__ = (
        "_by_engine",
        "_deaths",
        "_error_requests",
        "_family",
        "_protocol_errors",
        "_watching",
        "backlog",
        "client",
        "pending",
    )

    def __init__(self, family: _Family, client: str) -> None:
        self._family = family
        #: The ``client`` label.
        self.client = client
        self._deaths = family.deaths.labels(client)
        self._protocol_errors = family.protocol_errors.labels(client)
        self._error_requests = family.error_requests.labels(client)
        # engine index -> (frames.inc, outputs.inc, decode.observe)
        self._by_engine: dict[int, tuple[Any, Any, Any]] = {}
        #: Read at scrape time: the output backlog and the pending utility calls.
        self.backlog: Callable[[], int] = _zero
        self.pending: Callable[[], int] = _zero
        self._watching = False

    def _engine(self, index: int) -> tuple[Any, Any, Any]:
        family, labels = self._family, (self.client, str(index))
        hooks = (
            family.frames.labels(*labels).inc,
            family.outputs.labels(*labels).inc,
            family.decode.labels(*labels).observe,
        )
        self._by_engine[index] = hooks
        return hooks

    def wrap_decode(self, decode: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``decode`` timed and counted: one message, its outputs, its decode time.

        A message that fails to decode raises as before and counts nothing here (the
        output path counts it with :meth:`protocol_error`)."""
        clock = time.perf_counter_ns
        by_engine = self._by_engine
        make = self._engine

        def timed_decode(frames: Any) -> Any:
            start = clock()
            outputs = decode(frames)
            elapsed = clock() - start
            index = outputs.engine_index
            hooks = by_engine.get(index)
            if hooks is None:
                hooks = make(index)
            hooks[0]()
            count = len(outputs.outputs)
            if count:
                hooks[1](count)
            hooks[2](elapsed * 1e-9)
            return outputs

        return timed_decode

    def watch(self, backlog: Callable[[], int], pending: Callable[[], int]) -> None:
        """Export ``backlog()`` and ``pending()`` (read at scrape time) until
        :meth:`close`; they must not reference the client (it would never be collected)."""
        self.backlog, self.pending = backlog, pending
        family = self._family
        with family.lock:
            live = family.live.get(self.client, ())
            family.live[self.client] = (*live, self)
            if not live:
                family.export_gauges(self.client)
        self._watching = True

    def close(self) -> None:
        """Stop exporting this client's gauges (the client was closed); idempotent."""
        if not self._watching:
            return
        self._watching = False
        family = self._family
        with family.lock:
            live = tuple(m for m in family.live.get(self.client, ()) if m is not self)
            family.live[self.client] = live
        self.backlog = self.pending = _zero

    def engine_died(self) -> None:
        """Count an engine death."""
        self._deaths.inc()

    def protocol_error(self) -> None:
        """Count an output frame that did not decode."""
        self._protocol_errors.inc()

    def protocol_error_requests(self, count: int) -> None:
        """Count requests ended with an error by a frame that did not decode."""
        if count:
            self._error_requests.inc(count)


def _zero() -> int:
    return 0


def _sum_live(family: _Family, client: str, which: str) -> float:
    total = 0
    for metrics in family.live.get(client, ()):
        try:
            total += getattr(metrics, which)()
        except Exception:  # a client closing under the scrape: its value is gone
            continue
    return float(total)
