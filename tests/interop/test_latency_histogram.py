"""vLLM's inter-token latency histogram fed once per step
(``corewire.vllm.output.latency_histogram``): it must leave exactly what vLLM's one
``observe`` per token leaves, bit for bit, in ``prometheus_client``'s histograms and in
vLLM's own ``PrometheusStatLogger``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from corewire._native import fold_observations  # noqa: E402
from corewire.vllm.output import latency_histogram  # noqa: E402

# vLLM's inter-token latency buckets (seconds).
BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


def _child(name: str) -> Any:
    histogram = prometheus_client.Histogram(
        name, "doc", ["engine"], buckets=BUCKETS, registry=prometheus_client.CollectorRegistry()
    )
    return histogram.labels("0")


def _state(child: Any) -> tuple[float, list[float]]:
    # The sum as stored (compared exactly), and each bucket's own count.
    return child._sum.get(), [bucket.get() for bucket in child._buckets]


def _latencies(rng: random.Random, n: int) -> list[float]:
    # Mostly a step's latency, with the bounds themselves, zero, negatives, large values.
    pool = [*BUCKETS, 0.0, -0.001, 7.5, 1e-9]
    return [rng.choice(pool) if rng.random() < 0.2 else rng.uniform(0, 0.3) for _ in range(n)]


def test_observe_all_leaves_what_one_observe_per_value_leaves() -> None:
    rng = random.Random(26)
    one_by_one, folded = _child("each"), _child("folded")
    # Folded, not observed one by one (which would leave the same state).
    folded.observe = _must_not_observe
    for step in range(50):
        values = _latencies(rng, rng.randrange(0, 300))
        for value in values:
            one_by_one.observe(value)
        latency_histogram.observe_all(folded, values)
        assert _state(folded) == _state(one_by_one), f"step {step}"
    total, counts = _state(folded)
    assert sum(counts) > 5000 and total > 0


def _must_not_observe(*_: Any) -> None:
    raise AssertionError("observed one by one")


def test_fold_observations_is_the_histograms_arithmetic() -> None:
    total, counts = fold_observations([0.01, 0.02, 3, float("inf")], 1.0, [0.01, 0.05, 5.0])
    assert (total, counts) == (1.0 + 0.01 + 0.02 + 3 + float("inf"), [1, 1, 1])
    nan_total, nan_counts = fold_observations([float("nan")], 0.0, [1.0, float("inf")])
    assert nan_total != nan_total and nan_counts == [0, 0]
    with pytest.raises(TypeError, match="must be a number, not str"):
        fold_observations([0.1, "x"], 0.0, [1.0])  # type: ignore[list-item]


def test_a_value_that_is_not_a_number_fails_as_observe_does() -> None:
    """The plain path takes over: the values before it are observed, then observe's own
    TypeError."""
    one_by_one, folded = _child("each"), _child("folded")
    one_by_one.observe(0.02)
    with pytest.raises(TypeError):
        one_by_one.observe("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        latency_histogram.observe_all(folded, [0.02, "x"])  # type: ignore[list-item]
    assert _state(folded) == _state(one_by_one)


def test_only_prometheus_clients_own_histogram_is_folded() -> None:
    class Custom(prometheus_client.Histogram):
        def observe(self, amount: float, exemplar: Any = None) -> None:
            super().observe(2 * amount, exemplar)

    custom = Custom(
        "custom", "doc", ["engine"], buckets=BUCKETS, registry=prometheus_client.CollectorRegistry()
    )
    assert latency_histogram.foldable(_child("plain"))
    assert not latency_histogram.foldable(custom.labels("0"))
    assert not latency_histogram.foldable(object())
    # The installed prometheus_client folds as it observes (checked before wrapping).
    assert latency_histogram.folds_as_observe_does()


def test_a_record_without_the_arguments_it_reads_is_not_wrapped() -> None:
    """A ``record`` whose engine index is named otherwise (a later vLLM) keeps vLLM's loop:
    wrapping it could put every engine's latencies in engine 0's series."""

    class Renamed:
        def record(self, scheduler_stats: Any, iteration_stats: Any, engine: int = 0) -> None:
            pass

    before = Renamed.record
    assert latency_histogram.install(Renamed) is False
    assert Renamed.record is before


def _stats(rng: random.Random, stats_cls: type) -> Any:
    stats = stats_cls()
    low = latency_histogram.MIN_TO_FOLD
    stats.num_generation_tokens = rng.choice([rng.randrange(1, low), rng.randrange(low, 300)])
    stats.inter_token_latencies_iter = _latencies(rng, stats.num_generation_tokens)
    stats.time_to_first_tokens_iter = [rng.uniform(0, 1) for _ in range(rng.randrange(3))]
    return stats


def _histograms(logger: Any) -> dict[str, tuple[float, list[float]]]:
    # Every histogram child of engine 0 the logger fed, by attribute name.
    found = {}
    for name, value in vars(logger).items():
        if name.startswith("histogram_") and isinstance(value, dict) and 0 in value:
            found[name] = _state(value[0])
    return found


def test_vllms_prometheus_logger_records_the_same_with_latencies_folded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own ``PrometheusStatLogger``: the wrapped ``record`` leaves every histogram
    as vLLM's ``record`` does, step after step, and the stats keep their latencies for
    the loggers after it."""
    pytest.importorskip("vllm")
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import IterationStats

    from vllm_support import vllm_config, write_model_dir

    config = vllm_config(write_model_dir(tmp_path / "model"))
    # vLLM's own record, even where this process's plugin wrapped the class.
    original = getattr(PrometheusStatLogger.record, "__wrapped__", PrometheusStatLogger.record)

    class Vllms(PrometheusStatLogger):  # type: ignore[misc]
        record = original

    class Folding(PrometheusStatLogger):  # type: ignore[misc]
        record = original

    assert latency_histogram.install(Folding)
    assert latency_histogram.install(Folding)  # a second load of the plugin: no more
    folds = []

    def counted(*args: Any) -> Any:
        folds.append(len(args[0]))
        return fold_observations(*args)

    monkeypatch.setattr(latency_histogram, "fold_observations", counted)
    assert Folding.record.__wrapped__ is original  # type: ignore[attr-defined]
    # Each logger unregisters vLLM's metrics from the default registry before registering
    # its own: the first one's objects still count, outside the registry.
    vllms = Vllms(config, engine_indexes=[0])
    folding = Folding(config, engine_indexes=[0])
    assert latency_histogram.foldable(folding.histogram_inter_token_latency[0])
    rng = random.Random(34)
    for step in range(40):
        seed = rng.random()
        theirs, ours = (_stats(random.Random(seed), IterationStats) for _ in range(2))
        kept = list(ours.inter_token_latencies_iter)
        vllms.record(scheduler_stats=None, iteration_stats=theirs, engine_idx=0)
        folding.record(None, ours)  # positional, engine_idx by default
        assert ours.inter_token_latencies_iter == kept
        assert _histograms(folding) == _histograms(vllms), f"step {step}"
    count = sum(_state(folding.histogram_inter_token_latency[0])[1])
    assert count > 1000
    # Steps with fewer than MIN_TO_FOLD latencies took vLLM's loop, the others were folded.
    assert folds and min(folds) >= latency_histogram.MIN_TO_FOLD
    # Without iteration stats (a scheduler-stats-only record), nothing is folded.
    folding.record(scheduler_stats=None, iteration_stats=None, engine_idx=0)
    assert sum(_state(folding.histogram_inter_token_latency[0])[1]) == count
