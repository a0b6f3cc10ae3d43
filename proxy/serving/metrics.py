"""Prometheus metrics: request counters kept by the proxy, pool state read at scrape time.

What only the data path sees (requests, latencies, token usage) is counted here as it happens;
everything the pool already knows (states, restarts, ejections, health-check failures, load and
warm-up times, the backends' own gauges) is read from the pool on each scrape by PoolCollector,
so there is no second copy of it to drift. Fairness keys are labels only for the keys named in
`engine.fairness.weights`; every other key counts as `other`, so label cardinality stays bounded.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.lifecycle.kvcache.keeper import CHECKS, RESULTS
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import Replica, ReplicaState
from proxy.serving.carried import CarriedCounters, snapshot
from proxy.edge.response_metrics import checked_usage

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
OTHER_KEY = "other"
log = logging.getLogger(__name__)


class PoolCollector(Collector):
    """Gauges and counters derived from the pool on each scrape."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        # Every per-replica family names the replica's host: a configured name (supervisor.hosts, or
        # `local`), so the label set stays as bounded as the replicas themselves.
        m, mr = ["model"], ["model", "replica", "host"]
        ready = GaugeMetricFamily("llm_pool_replicas_ready", "READY replicas per model", labels=m)
        capacity = GaugeMetricFamily("llm_pool_capacity", "Request slots per model", labels=m)
        active = GaugeMetricFamily("llm_pool_requests_active", "Requests running per model", labels=m)
        waiting = GaugeMetricFamily("llm_pool_requests_waiting", "Requests queued per model", labels=m)
        model_state = GaugeMetricFamily("llm_pool_model_state", "1 for the model's current state",
                                        labels=["model", "state"])
        load_s = GaugeMetricFamily("llm_pool_model_load_seconds", "Duration of the model's last load", labels=m)
        unload_s = GaugeMetricFamily("llm_pool_model_unload_seconds", "Duration of the model's last unload",
                                     labels=m)
        state = GaugeMetricFamily("llm_pool_replica_state", "1 for the replica's current state",
                                  labels=[*mr, "state"])
        in_rotation = GaugeMetricFamily("llm_pool_replica_ready", "1 when the replica is READY (in rotation)",
                                        labels=mr)
        inflight = GaugeMetricFamily("llm_pool_replica_inflight", "Requests the proxy has at the replica",
                                     labels=mr)
        sent = CounterMetricFamily("llm_pool_replica_requests", "Requests sent to the replica", labels=mr)
        restarts = CounterMetricFamily("llm_pool_replica_restarts", "Process restarts seen per replica", labels=mr)
        ejections = CounterMetricFamily("llm_pool_replica_ejections", "Outlier ejections per replica", labels=mr)
        probe_failures = CounterMetricFamily(
            "llm_pool_replica_health_check_failures",
            "Failed health checks of a replica in rotation or ejected, and failed warm-ups", labels=mr)
        warmup = GaugeMetricFamily("llm_pool_replica_warmup_seconds", "Duration of the replica's last warm-up",
                                   labels=mr)
        running = GaugeMetricFamily("llm_pool_backend_requests_running",
                                    "Requests running, as the backend reports on its own /metrics", labels=mr)
        queued = GaugeMetricFamily("llm_pool_backend_requests_waiting",
                                   "Requests waiting, as the backend reports on its own /metrics", labels=mr)
        kv_cache = GaugeMetricFamily("llm_pool_backend_kv_cache_usage",
                                     "KV-cache use 0..1, as the backend reports on its own /metrics", labels=mr)
        loads = CounterMetricFamily("llm_pool_model_loads", "Finished loads by reason (startup, admin, on_demand)",
                                    labels=["model", "reason"])
        unloads = CounterMetricFamily("llm_pool_model_unloads",
                                      "Finished unloads by reason (admin, idle, evicted, shutdown)",
                                      labels=["model", "reason"])
        affine = CounterMetricFamily("llm_pool_replica_affinity_requests",
                                     "Requests sent to the replica as their affinity key's own replica", labels=mr)
        spills = CounterMetricFamily("llm_pool_replica_affinity_spills",
                                     "Requests of the replica's affinity keys sent elsewhere: it was full or "
                                     "busier than affinity_max_imbalance allows", labels=mr)
        waits = CounterMetricFamily("llm_pool_replica_affinity_waits",
                                    "Requests of the replica's affinity keys that waited for it while it was full "
                                    "(affinity_max_wait_s)", labels=mr)
        held = GaugeMetricFamily("llm_pool_replica_affinity_keys",
                                 "Affinity keys whose latest request went to the replica (recent keys only)",
                                 labels=mr)
        cached = CounterMetricFamily("llm_pool_replica_cached_prompt_tokens",
                                     "Prompt tokens the replica's engine served from its prefix cache (usage)",
                                     labels=mr)
        hits = CounterMetricFamily("llm_pool_replica_prefix_cache_answers",
                                   "Answers whose usage says how many prompt tokens came from the prefix cache: "
                                   "hit (some) or miss (none)", labels=[*mr, "result"])
        holds = GaugeMetricFamily("llm_pool_replica_adapter", "1 for each LoRA adapter the replica serves now",
                                  labels=[*mr, "adapter"])
        for name, runtime in self.pool.models.items():
            keys = runtime.keys.counts()
            for reason, count in runtime.loads.items():
                loads.add_metric([name, reason], count)
            for reason, count in runtime.unloads.items():
                unloads.add_metric([name, reason], count)
            ready.add_metric([name], len(runtime.ready()))
            capacity.add_metric([name], runtime.admission.capacity)
            active.add_metric([name], runtime.admission.active)
            waiting.add_metric([name], runtime.admission.waiting)
            model_state.add_metric([name, runtime.state.value], 1)
            if runtime.load_s is not None:
                load_s.add_metric([name], runtime.load_s)
            if runtime.unload_s is not None:
                unload_s.add_metric([name], runtime.unload_s)
            for replica in runtime.replicas:
                labels = [name, str(replica.index), replica.host]
                state.add_metric([*labels, replica.state.value], 1)
                in_rotation.add_metric(labels, 1 if replica.state == ReplicaState.READY else 0)
                inflight.add_metric(labels, replica.inflight)
                sent.add_metric(labels, replica.sent)
                restarts.add_metric(labels, replica.restarts)
                ejections.add_metric(labels, replica.ejected_total)
                probe_failures.add_metric(labels, replica.probe_failures)
                if replica.warmup_s is not None:
                    warmup.add_metric(labels, replica.warmup_s)
                affine.add_metric(labels, replica.affinity_picks)
                spills.add_metric(labels, replica.affinity_spills)
                waits.add_metric(labels, replica.affinity_waits)
                held.add_metric(labels, keys.get(replica.index, 0))
                cached.add_metric(labels, replica.cached_tokens)
                hits.add_metric([*labels, "hit"], replica.cache_hits)
                hits.add_metric([*labels, "miss"], replica.cache_misses)
                for adapter in replica.adapters():
                    holds.add_metric([*labels, adapter], 1)
                for family, field in ((running, "running"), (queued, "waiting"), (kv_cache, "kv_cache")):
                    value = replica.reported.get(field)
                    if value is not None:
                        family.add_metric(labels, value)
        yield from (ready, capacity, active, waiting, model_state, load_s, unload_s, state, in_rotation, inflight,
                    sent, restarts, ejections, probe_failures, warmup, running, queued, kv_cache, affine, spills,
                    waits, held, cached, hits, loads, unloads, holds)
        yield from self._classes()
        yield from self._sleep()
        yield from self._memory()
        yield from self._kv_store()
        yield from self._hosts()
        yield from self._tasks()

    def _kv_store(self) -> Iterator[Metric]:
        # The slots kept across swaps (proxy/lifecycle/kvcache/), for the models that keep them.
        kv = self.pool.kv
        saved = CounterMetricFamily("llm_pool_kv_saved", "llama-server slots saved before the pool unloaded the "
                                    "model (idle or evicted)", labels=["model"])
        not_saved = CounterMetricFamily("llm_pool_kv_not_saved", "Slots holding a conversation that were not saved: "
                                        "cut_short (the swap bound ran out) or over_budget (kv_store_mib)",
                                        labels=["model", "reason"])
        restored = CounterMetricFamily("llm_pool_kv_restored", "Saved slots given to a new replica: hit (restored), "
                                       "miss (the engine refused it, or it no longer fit), stale (other settings, "
                                       "model file or engine)", labels=["model", "result"])
        stored = GaugeMetricFamily("llm_pool_kv_store_bytes", "Bytes of saved slots on disk", labels=["model"])
        checks = CounterMetricFamily("llm_pool_kv_restore_checks", "Restored slots whose conversation's next answer "
                                     "showed cached tokens (verified) or none (unverified)", labels=["model", "result"])
        unverified = GaugeMetricFamily("llm_pool_kv_restore_unverified", "1 when the model's first checked restore "
                                       "showed no reuse: its slots are no longer saved", labels=["model"])
        budget = GaugeMetricFamily("llm_pool_kv_store_budget_bytes", "The slot store's disk budget "
                                   "(engine.lifecycle.kv_store_mib)")
        budget.add_metric([], kv.store.budget)
        for name, runtime in self.pool.models.items():
            if not kv.applies(runtime.config):
                continue
            counts = kv.of(name)
            saved.add_metric([name], counts.saved)
            not_saved.add_metric([name, "cut_short"], counts.cut_short)
            not_saved.add_metric([name, "over_budget"], counts.over_budget)
            for result in RESULTS:
                restored.add_metric([name, result], counts.restored.get(result, 0))
            stored.add_metric([name], kv.store.bytes_of(name))
            for check in CHECKS:
                checks.add_metric([name, check], counts.checks.get(check, 0))
            unverified.add_metric([name], 1 if counts.restore_unverified else 0)
        yield from (saved, not_saved, restored, stored, budget, checks, unverified)

    # -- sleep instead of stop (vllm_sleep_on_evict, proxy/lifecycle/sleeping.py) --------------------
    def _sleep(self) -> Iterator[Metric]:
        sleeps = CounterMetricFamily("llm_pool_model_sleeps", "Evictions that put the model to sleep instead of "
                                     "stopping it", labels=["model"])
        wakes = CounterMetricFamily("llm_pool_model_wakes", "Wakes from sleep that made the model ready",
                                    labels=["model"])
        for name, runtime in self.pool.models.items():
            sleeps.add_metric([name], runtime.sleeps)
            wakes.add_metric([name], runtime.wakes)
        yield from (sleeps, wakes)

    def _hosts(self) -> Iterator[Metric]:
        # Every host the pool knows (`local` included): an alert on `llm_pool_host_up == 0` names
        # the host whose replicas are out of rotation.
        up = GaugeMetricFamily("llm_pool_host_up", "1 while the host's supervisord answers, else 0", labels=["host"])
        contact = GaugeMetricFamily("llm_pool_host_last_contact_seconds",
                                    "Seconds since the host's supervisord last answered", labels=["host"])
        for name, status in self.pool.host_status().items():
            up.add_metric([name], 1 if status["answering"] else 0)
            seconds = status["last_contact_s"]
            if isinstance(seconds, (int, float)):
                contact.add_metric([name], seconds)
        yield from (up, contact)

    def _classes(self) -> Iterator[Metric]:
        # Per priority class (engine.fairness.classes): a bounded label set, as configured.
        mc = ["model", "class"]
        running = GaugeMetricFamily("llm_pool_class_requests_active", "Requests running per model and priority "
                                    "class", labels=mc)
        waiting = GaugeMetricFamily("llm_pool_class_requests_waiting", "Requests queued per model and priority "
                                    "class", labels=mc)
        oldest = GaugeMetricFamily("llm_pool_class_oldest_wait_seconds", "How long the oldest queued request of "
                                   "the class has waited (0: none waits); max_wait_s bounds it", labels=mc)
        for name, runtime in self.pool.models.items():
            for cls, figures in runtime.admission.describe_classes().items():
                running.add_metric([name, cls], figures["running"] or 0)
                waiting.add_metric([name, cls], figures["waiting"] or 0)
                oldest.add_metric([name, cls], figures["oldest_wait_s"] or 0)
        yield from (running, waiting, oldest)

    def _tasks(self) -> Iterator[Metric]:
        # A task that never ends (a relay left behind by a client that went away) is a leak that
        # shows here long before it shows in memory (tests/bench/soak.py follows it).
        try:
            count = len(asyncio.all_tasks())
        except RuntimeError:   # collected off the event loop: nothing to count
            return
        tasks = GaugeMetricFamily("llm_pool_event_loop_tasks", "asyncio tasks alive in the proxy")
        tasks.add_metric([], count)
        yield tasks

    def _memory(self) -> Iterator[Metric]:
        d = ["device"]
        budget = GaugeMetricFamily("llm_pool_memory_budget_bytes", "Memory budget per device (engine.lifecycle.memory)",
                                   labels=d)
        used = GaugeMetricFamily("llm_pool_memory_used_bytes", "Memory admitted to loaded models per device", labels=d)
        reserved = GaugeMetricFamily("llm_pool_memory_reserved_bytes", "Memory reserved by loads in flight per device",
                                     labels=d)
        thrash = CounterMetricFamily("llm_pool_thrash", "Loads of a model evicted within "
                                     "engine.lifecycle.thrash_window_s that evict another while the models in use "
                                     "need more than the budget holds (the `thrash` event says it once per window)",
                                     labels=["model"])
        report = self.pool.memory_report()
        for row in report["devices"]:
            if row["budget_bytes"] is not None:
                budget.add_metric([row["device"]], row["budget_bytes"])
            used.add_metric([row["device"]], row["used_bytes"])
            reserved.add_metric([row["device"]], row["reserved_bytes"])
        for model, count in report["thrash"]["counts"].items():
            thrash.add_metric([model], count)
        yield from (budget, used, reserved, thrash)


class ProxyMetrics:
    """One registry per app: no process-wide default registry, so two apps never share counters.
    `registry` holds what this process counts; `exposed` (GET /metrics) adds what a reload's
    predecessor had counted (proxy/serving/carried.py)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.carried = CarriedCounters(self.registry)
        self.exposed = CollectorRegistry()
        self.exposed.register(self.carried)
        r = self.registry
        self.requests = Counter("llm_pool_requests", "Requests answered, by final status and error code",
                                ["model", "endpoint", "status", "code", "key"], registry=r)
        self.latency = Histogram("llm_pool_request_seconds", "Time to the end of the response",
                                 ["model", "endpoint"], registry=r, buckets=LATENCY_BUCKETS)
        self.ttft = Histogram("llm_pool_time_to_first_token_seconds",
                              "Streams: from the request's arrival to the answer's first bytes "
                              "(/v1/responses: first text)",
                              ["model", "endpoint"], registry=r, buckets=LATENCY_BUCKETS)
        self.queue_wait = Histogram("llm_pool_queue_wait_seconds", "Time waiting for a slot (fairness queue)",
                                    ["model"], registry=r, buckets=QUEUE_BUCKETS)
        self.load_wait = Histogram("llm_pool_model_load_wait_seconds",
                                   "Time a request waited for its model to load (it arrived while not loaded)",
                                   ["model"], registry=r, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter("llm_pool_prompt_tokens", "Prompt tokens, as the backend's usage reports",
                                     ["model", "key"], registry=r)
        self.cached_tokens = Counter("llm_pool_cached_prompt_tokens",
                                     "Prompt tokens served from the backend's prefix cache (usage)",
                                     ["model", "key"], registry=r)
        self.output_tokens = Counter("llm_pool_output_tokens", "Output tokens, as the backend's usage reports",
                                     ["model", "key"], registry=r)
        self.adapter_requests = Counter("llm_pool_adapter_requests", "Requests for a model's LoRA adapter "
                                        "(docs/adapters.md), by final status", ["model", "adapter", "status"],
                                        registry=r)
        self.fallbacks = Counter("llm_pool_fallbacks", "Requests a model's fallback answered, by the model, "
                                 "the fallback and why", ["model", "to", "reason"], registry=r)
        self.named_keys: frozenset[str] = frozenset()
        # Models whose answers had a usage that was no count (10**30, NaN, a string): logged once each.
        self._bad_usage_logged: set[str] = set()
        # Each metric's children, bound once per label values: prometheus-client's labels() checks
        # and locks on every call, which was a measurable share of a request's CPU. Bounded as the
        # labels are (configured models, endpoints, statuses, known codes, named keys).
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}

    def snapshot(self) -> list[dict[str, Any]]:
        """Every counter as /metrics shows it, for a reload's successor to go on from."""
        return snapshot(self.carried.collect())

    def watch(self, pool: Pool) -> None:
        self.named_keys = frozenset(str(k) for k in (pool.settings.fairness.get("weights") or {}))
        self.registry.register(PoolCollector(pool))

    def observe_wait(self, model: str, waited_s: float, cold: bool) -> None:
        """A request's wait for its slot; `cold`: it arrived while its model was not loaded."""
        self.child(self.queue_wait, model).observe(waited_s)
        if cold:
            self.child(self.load_wait, model).observe(waited_s)

    def child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """`metric.labels(*labels)`, bound once (see _children)."""
        found = self._children.get((metric, labels))
        if found is None:
            found = self._children[(metric, labels)] = metric.labels(*labels)
        return found

    def key_label(self, key: str | None) -> str:
        return key if key is not None and key in self.named_keys else OTHER_KEY

    def count_usage(self, model: str, key: str, usage: Mapping[str, Any] | None,
                    replica: Replica | None = None) -> tuple[int, int, int]:
        """Add an answer's token usage (OpenAI `usage`) to the model's counters, and what it says of
        the prefix cache to the `replica` that answered. Returns the prompt, cached and output
        tokens it counted (0 for what the answer did not say, or said with a figure that is no count:
        logged once per model), for the usage ledger."""
        (prompt, cached, output), bad = checked_usage(usage)
        if bad and model not in self._bad_usage_logged:
            self._bad_usage_logged.add(model)
            log.warning("model %r: an answer's usage is not a count of tokens (%s); counted as 0 (logged once per "
                        "model)", model, ", ".join(bad))
        if replica is not None:
            replica.note_cache(prompt, cached)
        counted = []
        for counter, value in ((self.prompt_tokens, prompt), (self.cached_tokens, cached),
                               (self.output_tokens, output)):
            if value:
                self.child(counter, model, key).inc(value)
                counted.append(value)
            else:
                counted.append(0)
        return counted[0], counted[1], counted[2]

    def count_response(self, model: str, key: str, metrics: Mapping[str, Any], first_text_s: float | None,
                       replica: Replica | None = None) -> tuple[int, int, int]:
        """What a /v1/responses answer measured (its `metrics`), into the counters and histograms;
        `first_text_s`: a stream's time from the request's arrival to its first text. Returns the
        tokens, as count_usage does."""
        usage = {"prompt_tokens": metrics.get("engine_prompt_tokens"),
                 "cached_tokens": metrics.get("engine_cached_prompt_tokens"),
                 "completion_tokens": metrics.get("engine_output_tokens")}
        counted = self.count_usage(model, key, usage, replica)
        wait = metrics.get("engine_queue_wait_ms")
        if wait is not None:
            self.child(self.queue_wait, model).observe(wait / 1000)
        if first_text_s is not None:
            self.child(self.ttft, model, "/v1/responses").observe(first_text_s)
        return counted
