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

from prometheus_client import Histogram

from corewire._native import fold_observations

__all__ = ["foldable", "install", "observe_all"]

#: The attribute that marks a ``record`` already wrapped (vLLM loads plugins more than
#: once per process).
_WRAPPED = "__corewire_folds_latencies__"


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


def install(logger_cls: type) -> None:
    """Wraps ``logger_cls.record`` (vLLM's ``PrometheusStatLogger``) so that each step's
    inter-token latencies go into its histogram in one :func:`observe_all`; idempotent."""
    original = logger_cls.record  # type: ignore[attr-defined]
    if getattr(original, _WRAPPED, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def record(self: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(self, *args, **kwargs)
        arguments.apply_defaults()
        stats = arguments.arguments.get("iteration_stats")
        latencies = getattr(stats, "inter_token_latencies_iter", None)
        histograms = getattr(self, "histogram_inter_token_latency", None)
        if not latencies or histograms is None:
            return original(self, *args, **kwargs)
        histogram = histograms[arguments.arguments.get("engine_idx", 0)]
        if not foldable(histogram):
            return original(self, *args, **kwargs)
        # vLLM's record runs with no latencies to loop over; they are put back before any
        # other logger (or anything after) reads the stats.
        stats.inter_token_latencies_iter = []
        try:
            result = original(self, *args, **kwargs)
        finally:
            stats.inter_token_latencies_iter = latencies
        observe_all(histogram, latencies)
        return result

    setattr(record, _WRAPPED, True)
    logger_cls.record = record  # type: ignore[attr-defined]
