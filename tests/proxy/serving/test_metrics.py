"""The proxy's metric helpers: reading `usage` cheaply from answers and stream tails, counting it
per model and bounded fairness-key label."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fakes import FakeSupervisor
from launchers.spec import ProgramSpec
from proxy.config.loading import load_settings
from proxy.serving.metrics import OTHER_KEY, ProxyMetrics
from proxy.edge.response_metrics import usage_in
from proxy.lifecycle.pool import Pool
from proxy.upstream.reach import ProgramReach
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState

USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17, "prompt_tokens_details": {"cached_tokens": 8}}


def sample(metrics: ProxyMetrics, name: str, **labels: str) -> float:
    text = generate_latest(metrics.registry).decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_usage_of_a_json_answer_with_fields_after_it() -> None:
    answer = {"id": "x", "choices": [{"message": {"content": 'he said "usage": {"prompt_tokens": 99}'}}],
              "usage": USAGE, "timings": {"prompt_ms": 1.5}}
    assert usage_in(json.dumps(answer).encode()) == USAGE


def test_usage_of_a_stream_tail_is_the_last_chunk_that_carries_one() -> None:
    tail = (b'data: {"choices": [{"delta": {"content": "x"}}], "usage": null}\n\n'
            b'data: {"choices": [], "usage": ' + json.dumps(USAGE).encode() + b'}\n\ndata: [DONE]\n\n')
    assert usage_in(tail) == USAGE


def test_no_usage_a_null_one_or_one_cut_off_is_none() -> None:
    assert usage_in(b'{"choices": []}') is None
    assert usage_in(b'data: {"usage": null}\n\n') is None
    assert usage_in(b'data: {"usage": {"prompt_tokens": 1') is None
    assert usage_in(b'"usage"') is None


def test_only_keys_named_in_the_weights_are_labels() -> None:
    metrics = ProxyMetrics()
    metrics.named_keys = frozenset({"gold"})
    assert metrics.key_label("gold") == "gold"
    assert [metrics.key_label(k) for k in ("silver", "", None)] == [OTHER_KEY] * 3


def test_usage_counts_prompt_cached_and_output_tokens() -> None:
    metrics = ProxyMetrics()
    metrics.count_usage("m", "gold", USAGE)
    metrics.count_usage("m", "gold", USAGE)
    metrics.count_usage("m", "gold", None)
    metrics.count_usage("m", "other", {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 2})  # Moonshot
    assert sample(metrics, "llm_pool_prompt_tokens_total", model="m", key="gold") == 24
    assert sample(metrics, "llm_pool_cached_prompt_tokens_total", model="m", key="gold") == 16
    assert sample(metrics, "llm_pool_output_tokens_total", model="m", key="gold") == 10
    assert sample(metrics, "llm_pool_cached_prompt_tokens_total", model="m", key="other") == 2


def test_a_responses_answer_counts_its_measured_metrics() -> None:
    metrics = ProxyMetrics()
    measured = {"engine_prompt_tokens": 7, "engine_cached_prompt_tokens": None, "engine_output_tokens": 3,
                "engine_queue_wait_ms": 250.0, "backend_time_to_first_token_ms": 40.0}
    metrics.count_response("m", "other", measured, first_text_s=0.04)
    metrics.count_response("m", "other", measured, first_text_s=None)
    assert sample(metrics, "llm_pool_prompt_tokens_total", model="m") == 14
    assert sample(metrics, "llm_pool_queue_wait_seconds_count", model="m") == 2
    assert sample(metrics, "llm_pool_queue_wait_seconds_sum", model="m") == 0.5
    assert sample(metrics, "llm_pool_time_to_first_token_seconds_count", model="m", endpoint="/v1/responses") == 1


DASHBOARD = Path(__file__).resolve().parents[3] / "conf" / "grafana" / "llm-pool.json"


@pytest.fixture
def pool(tmp_path: Path) -> Pool:
    (tmp_path / "pool.yaml").write_text(f"service: {{state_dir: {tmp_path}}}\n"
                                        "engine: {models: {s: {backend: sim}}}\n")
    settings = load_settings(tmp_path / "pool.yaml")
    return Pool(settings, FakeSupervisor(), http=None, environ={})  # type: ignore[arg-type]


def families(metrics: ProxyMetrics) -> dict[str, Any]:
    text = generate_latest(metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_pool_state_is_read_at_scrape_time(pool: Pool) -> None:
    metrics = ProxyMetrics()
    metrics.watch(pool)
    runtime = pool.models["s"]
    runtime.state, runtime.load_s = ModelState.LOADED, 2.5
    spec = ProgramSpec(program="s-0", argv=(), env=(), host="127.0.0.1", port=1, health_path="/health",
                       models_path=None, served_model="s", start_timeout_s=5, stopwaitsecs=5)
    replica = Replica(model="s", index=0, spec=spec, reach=ProgramReach(spec), restarts=2, ejected_total=1, probe_failures=3, warmup_s=0.25)
    runtime.replicas = [replica]
    runtime.set_replica_state(replica, ReplicaState.STARTING)
    runtime.set_replica_state(replica, ReplicaState.READY)
    replica.reported = {"running": 3.0, "waiting": 1.0, "kv_cache": 0.5}
    found = {s.name: s.value for f in families(metrics).values() for s in f.samples
             if s.labels.get("model") == "s" and s.labels.get("replica") in ("0", None)}
    assert found["llm_pool_replica_restarts_total"] == 2 and found["llm_pool_replica_ejections_total"] == 1
    assert found["llm_pool_replica_health_check_failures_total"] == 3
    assert found["llm_pool_replica_warmup_seconds"] == 0.25 and found["llm_pool_model_load_seconds"] == 2.5
    assert found["llm_pool_backend_requests_running"] == 3 and found["llm_pool_backend_kv_cache_usage"] == 0.5
    assert found["llm_pool_replicas_ready"] == 1 and found["llm_pool_replica_ready"] == 1
    # Changed in the pool, changed in the next scrape: no copy to keep in step.
    runtime.set_replica_state(replica, ReplicaState.UNHEALTHY)
    states = {s.labels["state"]: s.value for s in families(metrics)["llm_pool_replica_state"].samples}
    assert states == {"unhealthy": 1}
    assert "llm_pool_backend_kv_cache_usage" not in {s.name for f in families(metrics).values() for s in f.samples}


def test_every_per_replica_family_names_the_replicas_host(pool: Pool) -> None:
    metrics = ProxyMetrics()
    metrics.watch(pool)
    runtime = pool.models["s"]
    runtime.state = ModelState.LOADED
    for index, host in enumerate(("local", "b")):
        spec = ProgramSpec(program=f"s-{index}", argv=(), env=(), host="127.0.0.1", port=1 + index,
                           health_path="/health", models_path=None, served_model="s", start_timeout_s=5,
                           stopwaitsecs=5)
        replica = Replica(model="s", index=index, spec=spec, reach=ProgramReach(spec), host=host)
        runtime.replicas.append(replica)
        runtime.set_replica_state(replica, ReplicaState.STARTING)
        runtime.set_replica_state(replica, ReplicaState.READY)
        replica.reported = {"running": 1.0, "waiting": 0.0, "kv_cache": 0.1}
    per_replica = {name: f for name, f in families(metrics).items()
                   if any("replica" in s.labels for s in f.samples)}
    assert {"llm_pool_replica_ready", "llm_pool_backend_kv_cache_usage"} <= set(per_replica), sorted(per_replica)
    for name, family in per_replica.items():
        hosts = {(s.labels["replica"], s.labels.get("host")) for s in family.samples}
        assert hosts == {("0", "local"), ("1", "b")}, name


def test_every_name_the_dashboard_uses_is_exposed(pool: Pool) -> None:
    metrics = ProxyMetrics()
    metrics.watch(pool)
    exposed = set()
    for name, family in families(metrics).items():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        exposed.update(name + s for s in suffixes)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"\bllm_pool_[a-z0-9_]+", e)}
    assert len(used) >= 20 and used <= exposed, used - exposed


def test_bound_children_count_into_the_registry_and_are_bound_once() -> None:
    from prometheus_client import generate_latest

    from proxy.serving.metrics import ProxyMetrics
    metrics = ProxyMetrics()
    child = metrics.child(metrics.prompt_tokens, "m", "other")
    assert metrics.child(metrics.prompt_tokens, "m", "other") is child
    assert metrics.child(metrics.prompt_tokens, "n", "other") is not child
    metrics.count_usage("m", "other", {"prompt_tokens": 7})
    metrics.count_usage("m", "other", {"prompt_tokens": 5})
    text = generate_latest(metrics.registry).decode()
    assert 'llm_pool_prompt_tokens_total{key="other",model="m"} 12.0' in text


async def test_the_event_loops_tasks_are_a_gauge(tmp_path: Path) -> None:
    """What the soak follows for leaks: one more task alive, one more on the gauge."""
    import asyncio

    from proxy.serving.metrics import PoolCollector

    def tasks() -> float:
        (family,) = [f for f in PoolCollector._tasks(None) if f.name == "llm_pool_event_loop_tasks"]  # type: ignore[arg-type]
        return family.samples[0].value

    before = tasks()
    blocker = asyncio.Event()
    waiting = asyncio.create_task(blocker.wait())
    assert tasks() == before + 1
    blocker.set()
    await waiting
    assert tasks() == before
