"""Cumulative Prometheus histograms as plain dicts, and the p95 of their increase over a window.

A histogram here maps each bucket's upper bound (`le`, with +Inf) to its cumulative count,
exactly as the `_bucket` series expose them. Quantiles interpolate linearly inside a bucket,
as PromQL's histogram_quantile() does, so both metrics sources give the same answer.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

Histogram = dict[float, float]


class HistogramError(ValueError):
    """The text holds no usable histogram of the requested name."""


def parse_histograms(text: str, metric: str) -> dict[tuple, Histogram]:
    """Every series of histogram `metric` in a Prometheus text exposition, keyed by its labels."""
    series: dict[tuple, Histogram] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise HistogramError(f"not a Prometheus text exposition: {e}") from None
    for family in families:
        if family.name != metric:
            continue
        for sample in family.samples:
            if sample.name != f"{metric}_bucket" or "le" not in sample.labels:
                continue
            if not math.isfinite(sample.value) or sample.value < 0:
                # A count is never NaN, infinite or negative: a broken exporter, whose p95 would be
                # NaN or inf. The pod is left out as unreadable rather than scaled from.
                raise HistogramError(f"{sample.name}{{le={sample.labels['le']!r}}} is {sample.value}, not a count")
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            series.setdefault(labels, {})[float(sample.labels["le"])] = float(sample.value)
    if not series:
        raise HistogramError(f"no {metric} histogram in the exposition")
    return series


def merge(histograms: Iterable[Mapping[float, float]]) -> Histogram:
    """The bucket-wise sum: one histogram for several series (pods) with the same buckets."""
    total: Histogram = {}
    for histogram in histograms:
        for bound, count in histogram.items():
            total[bound] = total.get(bound, 0.0) + count
    return dict(sorted(total.items()))


def increase(new: Mapping[float, float], old: Mapping[float, float] | None) -> Histogram:
    """What was observed between two scrapes of one series.

    A bucket that went down means the process restarted and its counters began again from zero:
    then everything in `new` is new, as Prometheus's increase() assumes.
    """
    if old is None or any(new.get(bound, 0.0) < count for bound, count in old.items()):
        return dict(sorted(new.items()))
    return {bound: count - old.get(bound, 0.0) for bound, count in sorted(new.items())}


def count(histogram: Mapping[float, float]) -> float:
    """Observations in the histogram: the +Inf bucket (or the largest, if +Inf is missing)."""
    if not histogram:
        return 0.0
    return histogram.get(math.inf, max(histogram.values()))


def quantile(q: float, histogram: Mapping[float, float]) -> float | None:
    """The q-quantile (0 < q < 1) in the histogram's unit; None when it holds no observations."""
    if not 0 < q < 1:
        raise ValueError(f"quantile must be in (0, 1), got {q}")
    buckets = sorted(histogram.items())
    total = count(histogram)
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                # Above the largest finite bucket nothing is known: report that bucket's bound.
                return lower_bound
            width = cumulative - lower_count
            fraction = (rank - lower_count) / width if width > 0 else 1.0
            return lower_bound + (bound - lower_bound) * fraction
        lower_bound, lower_count = bound, cumulative
    return lower_bound
