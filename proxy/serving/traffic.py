"""`GET /v1/admin/traffic`: the proxy's own request counters per model, read from its metrics
registry, for a client that has no Prometheus (the status page, `/ui`).

The numbers are the ones `/metrics` exports (`llm_pool_requests_total`, `llm_pool_request_seconds`,
`llm_pool_time_to_first_token_seconds`, `llm_pool_queue_wait_seconds`), totals since the proxy
started, summed over endpoints and fairness keys. A rate or a quantile is a difference between two
readings, as Prometheus' `rate()` and `histogram_quantile()` take it, so `time` comes with them: the
reader computes it over whatever window it keeps, and this route holds no state of its own. It reads
the registry only when asked; the data path counts exactly as it did before.
"""
from __future__ import annotations

import math
import time
from typing import Any, Iterable

from prometheus_client import Counter, Histogram

from proxy.serving.metrics import LATENCY_BUCKETS, QUEUE_BUCKETS, ProxyMetrics


def traffic(metrics: ProxyMetrics, models: Iterable[str]) -> dict[str, Any]:
    """Per configured model: requests by final status, and the latency, time-to-first-token and
    queue-wait histograms (cumulative counts per bucket upper bound, as Prometheus keeps them)."""
    names = list(models)
    rows: dict[str, dict[str, Any]] = {name: {"requests": 0, "by_status": {}} for name in names}
    for labels, value in _samples(metrics.requests, "_total"):
        row = rows.get(labels["model"])
        if row is None:
            continue
        row["requests"] += int(value)
        status = labels["status"]
        row["by_status"][status] = row["by_status"].get(status, 0) + int(value)
    for field, histogram, bounds in (("latency_s", metrics.latency, LATENCY_BUCKETS),
                                     ("ttft_s", metrics.ttft, LATENCY_BUCKETS),
                                     ("queue_wait_s", metrics.queue_wait, QUEUE_BUCKETS)):
        summed = _histograms(histogram, bounds, names)
        for name in names:
            rows[name][field] = summed[name]
    return {"object": "traffic", "time": round(time.time(), 3), "models": rows}


def _samples(metric: Counter | Histogram, suffix: str) -> Iterable[tuple[dict[str, str], float]]:
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(suffix):
                yield sample.labels, sample.value


def _histograms(histogram: Histogram, upper: tuple[float, ...], names: list[str]) -> dict[str, dict[str, Any]]:
    """Each model's histogram summed over its other labels: {"le": [finite bounds], "counts":
    [cumulative count per bound, then +Inf], "count", "sum"}. JSON has no infinity: the last count
    is the +Inf bucket's."""
    bounds = [*upper, math.inf]
    buckets: dict[str, dict[float, float]] = {name: {} for name in names}
    totals = {name: {"count": 0.0, "sum": 0.0} for name in names}
    for family in histogram.collect():
        for sample in family.samples:
            model = sample.labels.get("model")
            if model not in buckets:
                continue
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                buckets[model][le] = buckets[model].get(le, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                totals[model]["count"] += sample.value
            elif sample.name.endswith("_sum"):
                totals[model]["sum"] += sample.value
    return {name: {"le": list(upper),
                   "counts": [int(buckets[name].get(b, 0)) for b in bounds],
                   "count": int(totals[name]["count"]), "sum": round(totals[name]["sum"], 6)}
            for name in names}
