"""vLLM's inter-token latency histogram fed once per engine step, not once per token.

vLLM's ``PrometheusStatLogger.record`` observes each token's inter-token latency with its
own ``Histogram.observe`` call: once per stream per step, the last Python that runs per
token once native output processing and the fast path have taken the rest. With native
output processing installed, :func:`install` wraps ``record`` so that the step's
latencies are set aside while vLLM's ``record`` does everything else, and then go into
the same histogram in one :func:`observe_all`: the sum gets the same additions in the
same order (``corewire._native.fold_observations``), so ``/metrics`` reads as it would
have, bit for bit; every other stat logger still sees the step's latencies.

A histogram that is not ``prometheus_client``'s own (a subclass with its own
``observe``, or a wrapper such as Ray's) keeps vLLM's per-token loop.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from corewire._native import fold_observations

__all__ = [
    "FOLDED_LOG_LINE",
    "MIN_TO_FOLD",
    "foldable",
    "folds_as_observe_does",
    "install",
    "installed",
    "observe_all",
]

#: The attribute that marks a ``record`` already wrapped (vLLM loads plugins more than
#: once per process).
_WRAPPED = "__corewire_folds_latencies__"

#: Said in the log where vLLM's inter-token latency histogram is fed once per step.
FOLDED_LOG_LINE = "inter-token latencies folded into vLLM's histogram once per step"


def installed(logger_cls: type) -> bool:
    """Whether :func:`install` wrapped ``logger_cls.record``."""
    return bool(getattr(logger_cls.record, _WRAPPED, False))  # type: ignore[attr-defined]


def foldable(histogram: Any) -> bool:
    """Whether ``histogram`` (one labelled child) is ``prometheus_client``'s own, whose
    state :func:`observe_all` can update as its ``observe`` would."""
    if getattr(type(histogram), "observe", None) is not Histogram.observe:
        return False
    names = ("_sum", "_buckets", "_upper_bounds", "_raise_if_not_observable")
    return all(hasattr(histogram, name) for name in names)


def observe_all(histogram: Any, values: list[float]) -> None:
    """Observes ``values`` in order into ``histogram`` (:func:`foldable`), leaving what
    one ``observe`` call per value would: the sum's additions in order, one count per
    value in its bucket. A value that is not a number is observed the plain way, which
    raises as ``observe`` does."""
    if not values:
        return
    histogram._raise_if_not_observable()
    try:
        total, counts = fold_observations(values, histogram._sum.get(), histogram._upper_bounds)
    except TypeError:
        for value in values:
            histogram.observe(value)
        return
    histogram._sum.set(total)
    for bucket, count in zip(histogram._buckets, counts, strict=True):
        if count:
            bucket.inc(count)


#: Fewer latencies than this in a step go through vLLM's own loop. Measured with vLLM
#: 0.34.0's buckets (prometheus_client 0.26, CPython 3.11): one ``observe`` per value
#: 0.65 us each; a fold 2.3 us plus 0.01 us per value (even at about 4 values; 256 values:
#: 166 us one by one, 4.4 us folded).
MIN_TO_FOLD = 4


def folds_as_observe_does() -> bool:
    """Whether :func:`observe_all` leaves, in a scratch histogram of the installed
    ``prometheus_client``, what ``observe`` does value by value (checked once, at
    :func:`install`: a later ``prometheus_client`` that keeps its state otherwise keeps
    vLLM's loop instead of being folded wrongly)."""
    registry = CollectorRegistry()
    buckets = (0.01, 0.1, 1.0)
    each = Histogram("each", "", ["e"], buckets=buckets, registry=registry).labels("0")
    folded = Histogram("folded", "", ["e"], buckets=buckets, registry=registry).labels("0")
    values = [0.1, 0.3, 0.01, 2.0, 0.07, 0.1 + 0.2, 1e-9, 0.0]
    for value in values:
        each.observe(value)
    if not foldable(folded):
        return False
    observe_all(folded, values)
    return _samples(registry, "each") == _samples(registry, "folded")


def _samples(registry: CollectorRegistry, name: str) -> list[tuple[str, Any, float]]:
    # Histogram ``name``'s samples in ``registry``, named without ``name`` (their creation
    # times left out: the two histograms were made apart).
    return [
        (sample.name.removeprefix(name), sorted(sample.labels.items()), sample.value)
        for metric in registry.collect()
        if metric.name == name
        for sample in metric.samples
        if not sample.name.endswith("_created")
    ]


def install(logger_cls: type) -> bool:
    """Wraps ``logger_cls.record`` (vLLM's ``PrometheusStatLogger``) so that each step's
    inter-token latencies go into its histogram in one :func:`observe_all`; idempotent.
    False (nothing wrapped) where ``record`` does not take the arguments it reads or the
    installed ``prometheus_client`` does not fold as it observes."""
    original = logger_cls.record  # type: ignore[attr-defined]
    if getattr(original, _WRAPPED, False):
        return True
    # Where each argument is passed positionally (after self), for reading it cheaply
    # once per step: vLLM's StatLoggerManager passes the stats by position and the
    # engine index by name.
    signature = inspect.signature(original).parameters
    parameters = list(signature)[1:]
    if "iteration_stats" not in parameters or "engine_idx" not in parameters:
        return False  # a renamed argument: wrapping could feed the wrong engine's series
    if not folds_as_observe_does():
        return False
    stats_at = parameters.index("iteration_stats")
    engine_at = parameters.index("engine_idx")
    default_engine = signature["engine_idx"].default

    def argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, at: int) -> Any:
        if name in kwargs:
            return kwargs[name]
        return args[at] if at < len(args) else None

    @functools.wraps(original)
    def record(self: Any, *args: Any, **kwargs: Any) -> Any:
        stats = argument(args, kwargs, "iteration_stats", stats_at)
        latencies = getattr(stats, "inter_token_latencies_iter", None)
        histograms = getattr(self, "histogram_inter_token_latency", None)
        if latencies is None or len(latencies) < MIN_TO_FOLD or histograms is None:
            return original(self, *args, **kwargs)
        engine_idx = argument(args, kwargs, "engine_idx", engine_at)
        histogram = histograms[default_engine if engine_idx is None else engine_idx]
        if not foldable(histogram):
            return original(self, *args, **kwargs)
        # vLLM's record runs with no latencies to loop over; they are put back before any
        # other logger (or anything after) reads the stats. vLLM's output handler is this
        # histogram's one writer, so reading its sum and setting it again loses nothing;
        # a /metrics scrape in between may see the step's sum before its bucket counts,
        # for an instant (one observe at a time, it may see one value's).
        stats.inter_token_latencies_iter = []
        try:
            result = original(self, *args, **kwargs)
        finally:
            stats.inter_token_latencies_iter = latencies
        observe_all(histogram, latencies)
        return result

    setattr(record, _WRAPPED, True)
    logger_cls.record = record  # type: ignore[attr-defined]
    return True
