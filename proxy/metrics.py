"""Prometheus metrics: request counters kept by the proxy, pool state read at scrape time."""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.pool import Pool


class PoolCollector(Collector):
    """Gauges derived from the pool on each scrape, so there is no second copy of its state to drift."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily("llm_pool_replicas_ready", "READY replicas per model", labels=["model"])
        capacity = GaugeMetricFamily("llm_pool_capacity", "Request slots per model", labels=["model"])
        active = GaugeMetricFamily("llm_pool_requests_active", "Requests running per model", labels=["model"])
        waiting = GaugeMetricFamily("llm_pool_requests_waiting", "Requests queued per model", labels=["model"])
        restarts = GaugeMetricFamily("llm_pool_replica_restarts", "Restarts seen per replica",
                                     labels=["model", "replica"])
        healthy = GaugeMetricFamily("llm_pool_replica_ready", "1 when the replica is READY (in rotation)",
                                    labels=["model", "replica", "state"])
        ejections = GaugeMetricFamily("llm_pool_replica_ejections", "Outlier ejections per replica",
                                      labels=["model", "replica"])
        for name, runtime in self.pool.models.items():
            ready.add_metric([name], len(runtime.ready()))
            capacity.add_metric([name], runtime.admission.capacity)
            active.add_metric([name], runtime.admission.active)
            waiting.add_metric([name], runtime.admission.waiting)
            for replica in runtime.replicas:
                restarts.add_metric([name, str(replica.index)], replica.restarts)
                healthy.add_metric([name, str(replica.index), replica.state.value],
                                   1 if replica.state.value == "ready" else 0)
                ejections.add_metric([name, str(replica.index)], replica.ejected_total)
        yield from (ready, capacity, active, waiting, restarts, healthy, ejections)


class ProxyMetrics:
    """One registry per app: no process-wide default registry, so two apps never share counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("llm_pool_requests", "Requests answered", ["model", "endpoint", "status"],
                                registry=self.registry)
        self.latency = Histogram("llm_pool_request_seconds", "Time to the end of the response",
                                 ["model", "endpoint"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))

    def watch(self, pool: Pool) -> None:
        self.registry.register(PoolCollector(pool))
