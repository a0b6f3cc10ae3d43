"""GET /v1/admin/traffic's numbers: the proxy's own counters per model, summed over endpoints and
keys, read from the same registry /metrics exports."""
from __future__ import annotations

from proxy.serving.metrics import LATENCY_BUCKETS, QUEUE_BUCKETS, ProxyMetrics
from proxy.serving.traffic import traffic


def test_requests_by_status_and_histograms_are_summed_per_configured_model() -> None:
    metrics = ProxyMetrics()
    for endpoint, status, code, key in (("/v1/chat/completions", "200", "", "other"),
                                        ("/v1/chat/completions", "200", "", "batch"),
                                        ("/v1/responses", "200", "", "other"),
                                        ("/v1/chat/completions", "429", "fairness_key_queue_full", "other")):
        metrics.child(metrics.requests, "a", endpoint, status, code, key).inc()
    metrics.child(metrics.requests, "unconfigured", "/v1/completions", "200", "", "other").inc(5)
    metrics.child(metrics.latency, "a", "/v1/chat/completions").observe(0.02)
    metrics.child(metrics.latency, "a", "/v1/responses").observe(0.3)
    metrics.child(metrics.latency, "a", "/v1/responses").observe(500)   # past the last bound: +Inf only
    metrics.observe_wait("a", 0.002, cold=False)

    got = traffic(metrics, ["a", "b"])

    assert got["object"] == "traffic" and got["time"] > 0
    assert set(got["models"]) == {"a", "b"}   # what is not configured is not shown
    a, b = got["models"]["a"], got["models"]["b"]
    assert (a["requests"], a["by_status"]) == (4, {"200": 3, "429": 1})
    latency = a["latency_s"]
    assert latency["le"] == list(LATENCY_BUCKETS) and len(latency["counts"]) == len(LATENCY_BUCKETS) + 1
    at = {le: count for le, count in zip([*latency["le"], "+Inf"], latency["counts"])}
    assert (at[0.01], at[0.025], at[0.25], at[0.5], at[120], at["+Inf"]) == (0, 1, 1, 2, 2, 3)
    assert (latency["count"], latency["sum"]) == (3, 500.32)
    assert a["queue_wait_s"]["le"] == list(QUEUE_BUCKETS) and a["queue_wait_s"]["count"] == 1
    assert a["ttft_s"]["count"] == 0
    # A model nobody asked for yet: zeros, with the same bounds, so a reader needs no special case.
    assert (b["requests"], b["by_status"], b["latency_s"]["counts"]) == (0, {}, [0] * (len(LATENCY_BUCKETS) + 1))
