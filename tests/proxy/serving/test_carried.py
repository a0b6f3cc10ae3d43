"""Counters that go on across a reload (proxy/serving/carried.py): a successor's /metrics shows each
counter, histogram and the tenants' sums as its own count plus its predecessor's, never less than
the predecessor showed; gauges are its own; a snapshot is checked before it is used; and during a
reload only the process that holds the service answers /metrics."""
from __future__ import annotations

import json
from typing import Iterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from proxy.config.model import ModelConfig
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.serving import routes_public
from proxy.serving.carried import CarriedCounters, parse, seed, snapshot
from proxy.serving.errors_http import error_middleware
from proxy.serving.keys import METRICS
from proxy.serving.metrics import ProxyMetrics
from proxy.serving.shutdown import SHUTDOWN, Shutdown
from proxy.serving.tenancy import TenantMetrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Loads:
    """A collector of the pool's kind: counts kept elsewhere, read at scrape time."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("llm_pool_model_loads", "loads", labels=["model", "reason"])
        for (model, reason), n in self.counts.items():
            family.add_metric([model, reason], n)
        yield family


class Process:
    """One proxy process's metrics: a counter, a histogram, a gauge, the tenants' sums, the loads."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("llm_pool_requests", "requests", ["model", "status"], registry=self.registry)
        self.latency = Histogram("llm_pool_request_seconds", "latency", ["model"], registry=self.registry,
                                 buckets=(0.1, 1))
        self.active = Gauge("llm_pool_requests_active", "active", ["model"], registry=self.registry)
        self.tenants = TenantMetrics(self.registry)
        self.loads = Loads()
        self.registry.register(self.loads)
        self.carried = CarriedCounters(self.registry)
        self.exposed = CollectorRegistry()
        self.exposed.register(self.carried)

    def scrape(self) -> Samples:
        text = generate_latest(self.exposed).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def handed_over(self) -> object:
        return json.loads(json.dumps(snapshot(self.carried.collect())))   # as it crosses the control socket


def counters(samples: Samples) -> Samples:
    return {k: v for k, v in samples.items() if k[0].endswith(("_total", "_bucket", "_count", "_sum"))}


def test_a_successor_shows_its_own_counts_plus_its_predecessors_and_never_less() -> None:
    old = Process()
    old.requests.labels("a", "200").inc(5)
    old.requests.labels("gone", "200").inc(2)    # a model the successor never serves
    old.latency.labels("a").observe(0.05)
    old.latency.labels("a").observe(3)
    old.active.labels("a").set(4)
    old.tenants.count("t", 200, 10, 2, 7, 0.5)
    before = old.scrape()
    new = Process()
    new.carried.carry(parse(old.handed_over()))
    assert counters(new.scrape()) == counters(before)   # nothing counted yet: exactly the predecessor's
    new.requests.labels("a", "200").inc()
    new.requests.labels("a", "500").inc()
    new.latency.labels("a").observe(0.5)
    new.tenants.count("t", 200, 1, 0, 1, 0.25)
    new.active.labels("a").set(1)
    after = new.scrape()
    assert all(after[k] >= v for k, v in counters(before).items())
    assert after[("llm_pool_requests_total", (("model", "a"), ("status", "200")))] == 6
    assert after[("llm_pool_requests_total", (("model", "a"), ("status", "500")))] == 1
    assert after[("llm_pool_requests_total", (("model", "gone"), ("status", "200")))] == 2
    assert [after[("llm_pool_request_seconds_bucket", (("le", le), ("model", "a")))] for le in ("0.1", "1.0", "+Inf")] \
        == [1, 2, 3]
    assert after[("llm_pool_request_seconds_sum", (("model", "a"),))] == pytest.approx(3.55)
    assert after[("llm_pool_tenant_requests_total", (("status", "200"), ("tenant", "t")))] == 2
    assert after[("llm_pool_tenant_tokens_total", (("kind", "output"), ("tenant", "t")))] == 8
    assert after[("llm_pool_tenant_cost_total", (("tenant", "t"),))] == 0.75
    assert after[("llm_pool_requests_active", (("model", "a"),))] == 1       # a gauge is the process's own
    # The series keeps its first creation time: a new one would read as a reset too.
    created = ("llm_pool_requests_created", (("model", "a"), ("status", "200")))
    assert after[created] == before[created]


def test_the_predecessors_last_snapshot_raises_its_first_and_a_chain_of_reloads_adds_up() -> None:
    old = Process()
    old.requests.labels("a", "200").inc(5)
    new = Process()
    new.carried.carry(parse(old.handed_over()))
    old.requests.labels("a", "200").inc(3)         # finished while it drained
    old.requests.remove("a", "200")                # a series it no longer shows as it exits...
    old.requests.labels("b", "200").inc(3)
    new.carried.carry(parse(old.handed_over()))    # as it exits
    assert new.scrape()[("llm_pool_requests_total", (("model", "a"), ("status", "200")))] == 5   # ...keeps its value
    new.carried.carry(parse([{"name": "llm_pool_requests", "type": "counter", "help": "h",
                              "samples": [["llm_pool_requests_total", {"model": "a", "status": "200"}, 8.0]]}]))
    new.requests.labels("a", "200").inc()
    third = Process()
    third.carried.carry(parse(new.handed_over()))
    third.requests.labels("a", "200").inc()
    shown = third.scrape()
    assert shown[("llm_pool_requests_total", (("model", "a"), ("status", "200")))] == 10
    assert shown[("llm_pool_requests_total", (("model", "b"), ("status", "200")))] == 3


def test_loads_and_unloads_go_on_in_the_runtimes_not_on_top_of_them() -> None:
    old = Process()
    old.loads.counts[("a", "admin")] = 2
    old.loads.counts[("nobody", "admin")] = 1
    new = Process()
    handed = parse(old.handed_over())
    new.carried.carry(handed)
    runtime = ModelRuntime(config=ModelConfig(name="a", backend="sim", enabled=True, replicas=1, replica_max=1,
                                              target_inflight=1, modalities=("text",), gpus=()))
    runtime.loads["adopted"] = 1
    seed({"a": runtime}, handed)
    assert runtime.loads == {"adopted": 1, "admin": 2}
    new.loads.counts = {("a", r): n for r, n in runtime.loads.items()}
    assert new.scrape()[("llm_pool_model_loads_total", (("model", "a"), ("reason", "admin")))] == 2   # not 4


def test_a_snapshot_is_checked_before_it_is_used() -> None:
    good = ["llm_pool_requests_total", {"model": "a"}, 1.0]
    families = parse([
        {"name": "llm_pool_requests", "type": "counter", "help": "h",
         "samples": [good, ["other_total", {}, 1], ["llm_pool_requests_total", {"model": 1}, 1],
                     ["llm_pool_requests_total", {"bad label": "x"}, 1], ["llm_pool_requests_total", {}, "1"],
                     ["llm_pool_requests_total", {}, float("nan")], ["llm_pool_requests_total", {}], 7]},
        {"name": "llm_pool_requests_active", "type": "gauge", "help": "h", "samples": [["x", {}, 1]]},
        {"name": "bad name", "type": "counter", "help": "h", "samples": []},
        "junk"])
    assert list(families) == ["llm_pool_requests"]
    assert families["llm_pool_requests"].samples == {("llm_pool_requests_total", (("model", "a"),)): 1.0}
    assert parse({"not": "a list"}) == {} and parse(None) == {}


async def test_only_the_process_that_holds_the_service_answers_metrics() -> None:
    """Before a reload's successor has its predecessor's counters, or after the predecessor handed
    them over, a scrape would see a counter go down: 503, a gap instead."""
    app = web.Application(middlewares=[error_middleware])
    app[METRICS] = metrics = ProxyMetrics()
    app[SHUTDOWN] = shutdown = Shutdown(keep_models=False, successor=True)
    app.add_routes(routes_public.routes)
    metrics.carried.carry(parse([{"name": "llm_pool_requests", "type": "counter", "help": "h", "samples": [
        ["llm_pool_requests_total", {"model": "a", "endpoint": "/v1/chat/completions", "status": "200", "code": "",
                                     "key": "other"}, 7.0]]}]))
    server = TestServer(app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(server.make_url("/metrics")) as resp:
                body = await resp.json()
                assert (resp.status, body["error"]["code"], resp.headers["Retry-After"]) == (503, "reloading", "1")
            shutdown.took_over()
            async with session.get(server.make_url("/metrics")) as resp:
                assert resp.status == 200
                assert 'llm_pool_requests_total{code="",endpoint="/v1/chat/completions",key="other",model="a",' \
                       'status="200"} 7.0' in await resp.text()
            shutdown.hand_over()
            async with session.get(server.make_url("/metrics")) as resp:
                assert (resp.status, (await resp.json())["error"]["code"]) == (503, "shutting_down")
    finally:
        await server.close()
