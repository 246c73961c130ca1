"""Prometheus metrics of corewire's clients: every definition and the on/off switch.

Metrics are on when ``prometheus_client`` is installed (``pip install 'corewire[metrics]'``)
unless ``COREWIRE_METRICS=0`` (or ``false``, ``no``, ``off``). They live in
``prometheus_client``'s default registry, the one vLLM's API server serves at ``/metrics``
With ``--api-server-count`` > 1, vLLM serves ``prometheus_client``'s multiprocess
collector (``PROMETHEUS_MULTIPROC_DIR``), which reads what every API server wrote to its
files: counters and histograms write there as they count; the gauges, read from the
clients at scrape time in one process, are copied there once a second by a thread
(``livesum``: the live API servers' values added up).

Every client asks :func:`for_client` once, at construction: None when metrics are off,
so that the clients' hot paths hold either the plain decoder or the timed one of
:meth:`ClientMetrics.wrap_decode`, never a per-message test of the switch. Counting is
per message (``len(outputs.outputs)`` once), never per output, and in plain ints (a
:class:`_Tally` per client and engine): three Prometheus calls per message cost about 3 µs,
ten times the decode of a small message. The tallies are folded into the Prometheus series
when anything collects the default registry (a collector registered ahead of the series
does it), once a second by the gauges' thread in the multiprocess mode, and when a client
closes.

=======================================  =========  ==============  ========================
Name                                     Type       Labels          Meaning
=======================================  =========  ==============  ========================
corewire_frames_received_total           counter    client, engine  output messages decoded
corewire_outputs_received_total          counter    client, engine  request outputs in them
corewire_decode_seconds                  histogram  client, engine  decode time per message
corewire_output_backlog                  gauge      client          outputs (+1 per message)
                                                                    waiting for the consumer
corewire_pending_utility_calls           gauge      client          utility calls in flight
corewire_input_backlog_bytes             gauge      client          bytes sent toward the
                                                                    engines, not yet read
corewire_engine_deaths_total             counter    client          engines found dead
corewire_protocol_errors_total           counter    client          frames that did not decode
corewire_protocol_error_requests_total   counter    client          requests ended by a bad
                                                                    frame (vLLM adapter)
corewire_fast_path_requests_total        counter    path            streaming completions of
                                                                    ``vllm serve``: ``fast``
                                                                    or ``vllm`` (its own path)
corewire_fast_path_tokens_total          counter                    their tokens whose chunks
                                                                    were written natively
corewire_direct_route_requests_total     counter                    requests of ``vllm
                                                                    serve`` served around the
                                                                    app's router
corewire_inline_chat_renders_total       counter                    chat template renders
                                                                    of ``vllm serve`` done on
                                                                    the event loop
=======================================  =========  ==============  ========================

The fast path's counters (:func:`count_fast_path`, :func:`count_direct_route`) are counted
once per request, in the API server that served it; :func:`count_inline_render` once per
render (a chat with prompt embeddings renders twice).

``client`` is the client's index (vLLM's API-server index); clients of one process with
the same index share their series (the gauges add up). ``engine`` is the engine index
(data-parallel rank) each message names.
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from corewire._optional import import_optional, is_installed

__all__ = ["ENV_SWITCH", "ClientMetrics", "count_fast_path", "enabled", "for_client"]

#: The switch: "0" (or "false", "no", "off") turns metrics off.
ENV_SWITCH = "COREWIRE_METRICS"
_FALSE = frozenset({"0", "false", "no", "off"})
_TRUE = frozenset({"", "1", "true", "yes", "on"})

# Decode time of one message: a few µs (a small frame) to tens of ms (a large batch with
# logprobs). Few buckets: each observation walks them.
_DECODE_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)
#: The same bounds in ns (a tally compares the decode's own ns count with them).
_DECODE_BOUNDS_NS = tuple(round(b * 1e9) for b in _DECODE_BUCKETS)
#: Seconds between copies of the gauges (and folds of the tallies) to the multiprocess
#: files.
MULTIPROCESS_REFRESH_S = 1.0

logger = logging.getLogger(__name__)


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
        #: Every client's tallies not yet closed, folded under :attr:`fold_lock`.
        self.tallies: list[_Tally] = []
        self.fold_lock = threading.Lock()
        # Registered before the series, so that a collection of the registry folds the
        # tallies before it reads them (the registry collects in registration order).
        prom.REGISTRY.register(_Folder(self))
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
        self.input_backlog = prom.Gauge(
            "corewire_input_backlog_bytes",
            "Bytes sent toward the engines that ZeroMQ has not released yet (not yet read "
            "by the engines; bounded per engine by max_input_backlog).",
            ("client",),
            **mode,
        )
        self.deaths = prom.Counter(
            "corewire_engine_deaths_total",
            "Engine deaths a client saw (process exit, ENGINE_CORE_DEAD, failed health check).",
            ("client",),
        )
        self.losses = prom.Counter(
            "corewire_engine_losses_total",
            "Engines a data-parallel client lost and served on without (engine_loss "
            "isolate or replace).",
            ("client",),
        )
        self.replacements = prom.Counter(
            "corewire_engine_replacements_total",
            "Engines started to replace lost ones that became ready (engine_loss replace).",
            ("client",),
        )
        self.given_up = prom.Counter(
            "corewire_engine_ranks_given_up_total",
            "Ranks left out of routing for good after too many replacements in a window.",
            ("client",),
        )
        self.serving = prom.Gauge(
            "corewire_engines_serving",
            "Engines a data-parallel client routes to now (its group less those lost); "
            "set once an engine is lost.",
            ("client",),
            **mode,
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
        self.fast_requests = prom.Counter(
            "corewire_fast_path_requests_total",
            "Streaming completions of vllm serve by path: fast (chunks after the first "
            "written natively) or vllm (vLLM's own serving code).",
            ("path",),
        )
        self.fast_tokens = prom.Counter(
            "corewire_fast_path_tokens_total",
            "Output tokens of fast-path streams whose chunks were written natively.",
        )
        self.direct_requests = prom.Counter(
            "corewire_direct_route_requests_total",
            "Requests of vllm serve served by the fast path's direct routes, around the "
            "app's router.",
        )
        self.inline_renders = prom.Counter(
            "corewire_inline_chat_renders_total",
            "Chat template renders of vllm serve done on the event loop, not in vLLM's "
            "renderer pool.",
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
            input_backlog = functools.partial(_sum_live, self, client, "input_backlog")
            self.backlog.labels(client).set_function(backlog)
            self.pending.labels(client).set_function(pending)
            self.input_backlog.labels(client).set_function(input_backlog)
        elif self.refresher is None:
            # The multiprocess collector reads files only: copy the values there.
            self.refresher = threading.Thread(
                target=self._refresh, name="corewire-metrics", daemon=True
            )
            self.refresher.start()

    def fold(self) -> None:
        """Add what every live tally counted since its last fold to the series."""
        with self.fold_lock:
            for tally in self.tallies:
                tally.fold()

    def _refresh(self) -> None:
        while True:
            self.fold()
            with self.lock:
                clients = list(self.live)
            for client in clients:
                self.backlog.labels(client).set(_sum_live(self, client, "backlog"))
                self.pending.labels(client).set(_sum_live(self, client, "pending"))
                self.input_backlog.labels(client).set(_sum_live(self, client, "input_backlog"))
            time.sleep(MULTIPROCESS_REFRESH_S)


class _Folder:
    """A collector of the default registry that yields nothing: collecting it folds the
    tallies into the series collected after it."""

    def __init__(self, family: _Family) -> None:
        self._family = family

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        self._family.fold()
        return []


class _Tally:
    """One client's counts for one engine: plain ints that its receive path adds to, and
    what of them was already added to the Prometheus series (:meth:`fold`).

    The receive path is the only writer of the counts and :meth:`fold` (under the
    family's lock) the only writer of the rest, so neither needs a lock of its own.
    """

    __slots__ = ("_folded", "_series", "buckets", "frames", "outputs", "sum_ns")

    def __init__(self, frames: Any, outputs: Any, decode: Any) -> None:
        #: Messages, their outputs, decodes per bucket (the last one: over every bound)
        #: and the decodes' total ns.
        self.frames = 0
        self.outputs = 0
        self.buckets = [0] * (len(_DECODE_BOUNDS_NS) + 1)
        self.sum_ns = 0
        self._folded = [0, 0, 0, [0] * len(self.buckets)]
        self._series = (frames, outputs, decode)

    def count(self, outputs: int, elapsed_ns: int) -> None:
        """Count one message of ``outputs`` outputs that took ``elapsed_ns`` to decode."""
        self.frames += 1
        self.outputs += outputs
        self.buckets[bisect.bisect_left(_DECODE_BOUNDS_NS, elapsed_ns)] += 1
        self.sum_ns += elapsed_ns

    def fold(self) -> None:
        """Add the counts since the last fold to the series (the family's lock held)."""
        frames, outputs, decode = self._series
        folded = self._folded
        now = self.frames
        if now != folded[0]:
            frames.inc(now - folded[0])
            folded[0] = now
        now = self.outputs
        if now != folded[1]:
            outputs.inc(now - folded[1])
            folded[1] = now
        now = self.sum_ns
        if now != folded[2]:
            # Sum and buckets as Histogram.observe keeps them, a fold's worth at once.
            decode._sum.inc((now - folded[2]) * 1e-9)
            folded[2] = now
        done = folded[3]
        for i, now in enumerate(self.buckets):
            if now != done[i]:
                decode._buckets[i].inc(now - done[i])
                done[i] = now


class _Exact:
    """A tally that counts each message with Prometheus calls, for a
    ``prometheus_client`` whose histograms :class:`_Tally` cannot add to."""

    __slots__ = ("_series",)

    def __init__(self, frames: Any, outputs: Any, decode: Any) -> None:
        self._series = (frames, outputs, decode)

    def count(self, outputs: int, elapsed_ns: int) -> None:
        """Count one message at once."""
        frames, outputs_series, decode = self._series
        frames.inc()
        if outputs:
            outputs_series.inc(outputs)
        decode.observe(elapsed_ns * 1e-9)


def _histogram_internals(child: Any) -> bool:
    """Whether a ``corewire_decode_seconds`` series keeps ``prometheus_client``'s
    histogram internals that :meth:`_Tally.fold` adds to (one value per bucket, in
    bound order, and the sum; long-standing, and checked against 0.26.0)."""
    buckets = getattr(child, "_buckets", None)
    return (
        isinstance(buckets, list)
        and len(buckets) == len(_DECODE_BOUNDS_NS) + 1
        and all(callable(getattr(b, "inc", None)) for b in buckets)
        and callable(getattr(getattr(child, "_sum", None), "inc", None))
        and list(getattr(child, "_upper_bounds", ())) == [*_DECODE_BUCKETS, float("inf")]
    )


_family: _Family | None = None
_family_lock = threading.Lock()


def _get_family() -> _Family:
    global _family
    with _family_lock:
        if _family is None:
            _family = _Family()
        return _family


def count_fast_path(path: str, tokens: int = 0) -> None:
    """Counts one streaming completion of ``vllm serve`` that took ``path`` ("fast" or
    "vllm"), ``tokens`` of whose tokens were written natively (nothing when metrics are
    off)."""
    if not enabled():
        return
    family = _get_family()
    family.fast_requests.labels(path).inc()
    if tokens:
        family.fast_tokens.inc(tokens)


def count_direct_route() -> None:
    """Counts one request of ``vllm serve`` that a direct route of the fast path served
    (nothing when metrics are off)."""
    if enabled():
        _get_family().direct_requests.inc()


def count_inline_render() -> None:
    """Counts one chat template render of ``vllm serve`` done on the event loop (nothing
    when metrics are off)."""
    if enabled():
        _get_family().inline_renders.inc()


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
        "_given_up",
        "_losses",
        "_protocol_errors",
        "_replacements",
        "_serving",
        "_watching",
        "backlog",
        "client",
        "input_backlog",
        "pending",
    )

    def __init__(self, family: _Family, client: str) -> None:
        self._family = family
        #: The ``client`` label.
        self.client = client
        self._deaths = family.deaths.labels(client)
        self._losses = family.losses.labels(client)
        self._replacements = family.replacements.labels(client)
        self._given_up = family.given_up.labels(client)
        self._serving = family.serving.labels(client)
        self._protocol_errors = family.protocol_errors.labels(client)
        self._error_requests = family.error_requests.labels(client)
        # engine index -> that engine's tally
        self._by_engine: dict[int, _Tally | _Exact] = {}
        #: Read at scrape time: the output backlog, the pending utility calls, the
        #: bytes queued toward the engines.
        self.backlog: Callable[[], int] = _zero
        self.pending: Callable[[], int] = _zero
        self.input_backlog: Callable[[], int] = _zero
        self._watching = False

    def _engine(self, index: int) -> _Tally | _Exact:
        family, labels = self._family, (self.client, str(index))
        series = (
            family.frames.labels(*labels),
            family.outputs.labels(*labels),
            family.decode.labels(*labels),
        )
        tally: _Tally | _Exact
        if _histogram_internals(series[2]):
            tally = _Tally(*series)
            with family.fold_lock:
                family.tallies.append(tally)
        else:
            logger.warning(
                "corewire metrics: this prometheus_client's histograms lack the internals"
                " corewire adds to; counting each message with a Prometheus call instead"
            )
            tally = _Exact(*series)
        self._by_engine[index] = tally
        return tally

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
            tally = by_engine.get(index)
            if tally is None:
                tally = make(index)
            tally.count(len(outputs.outputs), elapsed)
            return outputs

        return timed_decode

    def watch(
        self,
        backlog: Callable[[], int],
        pending: Callable[[], int],
        input_backlog: Callable[[], int] | None = None,
    ) -> None:
        """Export ``backlog()``, ``pending()`` and ``input_backlog()`` (read at scrape
        time, on any thread) until :meth:`close`; they must not reference the client (it
        would never be collected)."""
        self.backlog, self.pending = backlog, pending
        self.input_backlog = input_backlog or _zero
        family = self._family
        with family.lock:
            live = family.live.get(self.client, ())
            family.live[self.client] = (*live, self)
            if not live:
                family.export_gauges(self.client)
        self._watching = True

    def close(self) -> None:
        """Stop exporting this client's gauges (the client was closed), and add what its
        tallies counted to the series; idempotent."""
        family = self._family
        tallies = [t for t in self._by_engine.values() if isinstance(t, _Tally)]
        if tallies:
            with family.fold_lock:
                for tally in tallies:
                    tally.fold()
                family.tallies = [t for t in family.tallies if t not in tallies]
        if not self._watching:
            return
        self._watching = False
        with family.lock:
            live = tuple(m for m in family.live.get(self.client, ()) if m is not self)
            family.live[self.client] = live
        self.backlog = self.pending = self.input_backlog = _zero

    def engine_died(self) -> None:
        """Count an engine death."""
        self._deaths.inc()

    def engine_lost(self, serving: int) -> None:
        """Count an engine lost while the group serves on; ``serving`` engines are left."""
        self._losses.inc()
        self._serving.set(serving)

    def engine_replaced(self, serving: int) -> None:
        """Count a lost engine's replacement, ready; ``serving`` engines now."""
        self._replacements.inc()
        self._serving.set(serving)

    def rank_given_up(self) -> None:
        """Count a rank given up (replaced too often)."""
        self._given_up.inc()

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
