"""Metric families keep their meaning through every level of aggregation: a `*_min` is the
smallest value of the step (micro-batches, data-parallel ranks, mini-batches), a `*_max` the
largest, everything else a mean; micro-batches without cross rows do not drag a min to 0."""

from __future__ import annotations

import math

from verl.utils.metric import AggregationType, Metric

from recipe_hacpo.training.agent_runtime import _step_metrics
from recipe_hacpo.methods.objective import aggregation_of


def test_each_loss_metric_family_has_its_aggregation():
    assert aggregation_of("hacpo/cross_ratio_min") is AggregationType.MIN
    assert aggregation_of("hacpo/cross_ratio_max") is AggregationType.MAX
    for key in ("hacpo/cross_ratio_mean", "hacpo/cross_clipfrac_low", "hacpo/lower_bound", "actor/pg_clipfrac"):
        assert aggregation_of(key) is AggregationType.MEAN


def _per_rank(key: str, values: list[float]) -> Metric:
    m = Metric(aggregation=aggregation_of(key))
    for v in values:
        m.append(v)
    return m


def test_min_and_max_over_micro_batches_ranks_and_mini_batches():
    # two mini-batches; in each, 2 ranks x 2 micro-batches (inf / -inf: a micro-batch without cross rows)
    minibatches = [
        {"hacpo/cross_ratio_min": ([0.91, math.inf], [0.85, 0.97]),
         "hacpo/cross_ratio_max": ([1.02, -math.inf], [1.20, 0.99]),
         "hacpo/cross_ratio_mean": ([0.95, 0.97], [0.90, 0.98])},
        {"hacpo/cross_ratio_min": ([0.88, 0.93], [0.90, 0.95]),
         "hacpo/cross_ratio_max": ([1.05, 1.01], [1.10, 1.00]),
         "hacpo/cross_ratio_mean": ([0.93, 0.99], [0.91, 0.97])},
    ]
    per_step: dict[str, list[float]] = {}
    for mb in minibatches:
        for key, ranks in mb.items():
            value = Metric.aggregate_dp([_per_rank(key, r) for r in ranks])  # verl's rank reduction
            per_step.setdefault(key, []).append(float(value))
    out = _step_metrics(per_step)
    assert out["hacpo/cross_ratio_min"] == 0.85  # a mean of minima would be 0.865
    assert out["hacpo/cross_ratio_max"] == 1.20  # a mean of maxima would be 1.15
    assert math.isclose(out["hacpo/cross_ratio_mean"], (0.95 + 0.97 + 0.90 + 0.98 + 0.93 + 0.99 + 0.91 + 0.97) / 8)


def test_a_step_without_cross_rows_reports_no_cross_ratio_extremes():
    out = _step_metrics({"hacpo/cross_ratio_min": [math.inf, math.inf], "hacpo/cross_ratio_max": [-math.inf],
                         "actor/pg_loss": [0.5, 0.25]})
    assert out == {"actor/pg_loss": 0.375}
