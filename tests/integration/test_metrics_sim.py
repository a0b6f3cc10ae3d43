"""/metrics after real traffic through a real proxy, supervisord and the simulated engine, read with
prometheus-client's own parser; and warm-up before a replica is READY."""
from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import ProxyProcess, http, wait_for

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).resolve().parents[2] / "conf" / "grafana" / "llm-pool.json"


def sim_model(**fields: Any) -> dict[str, Any]:
    return {"backend": "sim", "target_inflight": 4, "enabled": True,
            "sim": {"max_seqs": 4, "decode_tokens_per_s": 2000, "ttft_ms": 1}, **fields}


def scrape(proxy: ProxyProcess) -> dict[str, Any]:
    """{sample name: [(labels, value)]} and the family names, as prometheus-client parses them."""
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    families: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family.type
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return {"samples": samples, "families": families}


def value(scraped: dict[str, Any], name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    return sum(v for lab, v in scraped["samples"].get(name, []) if all(lab.get(k) == w for k, w in labels.items()))


def sim_started(proxy: ProxyProcess, model: str) -> list[dict[str, Any]]:
    port = proxy.admin_model(model)["replicas"][0]["port"]
    return http("GET", f"http://127.0.0.1:{port}/v1/sim/started")[2]["started"]


def stream_usage(raw: bytes) -> dict[str, int]:
    """The usage of an OpenAI SSE answer: the last chunk that carries one."""
    usage = None
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None, raw
    return usage


def test_metrics_count_what_was_sent_and_the_dashboard_uses_only_real_names(start_proxy) -> None:
    proxy = start_proxy({"sim": sim_model(warmup=True), "idle": sim_model(enabled=False)},
                        engine={"fairness": {"weights": {"gold": 2}}})
    proxy.wait_state("sim", "loaded")
    chat = {"model": "sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}
    prompt = output = 0
    for _ in range(3):  # a named key: its own label
        status, _, body = http("POST", proxy.url + "/v1/chat/completions", {**chat, "fairness_key": "gold"})
        assert status == 200, body
        prompt += body["usage"]["prompt_tokens"]
        output += body["usage"]["completion_tokens"]
    for key in ("alice", "bob"):  # keys not in the weights: both `other`; streamed with usage asked for
        status, _, raw = http("POST", proxy.url + "/v1/chat/completions",
                              {**chat, "stream": True, "stream_options": {"include_usage": True}},
                              headers={"X-Fairness-Key": key})
        assert status == 200
        usage = stream_usage(raw)
        prompt += usage["prompt_tokens"]
        output += usage["completion_tokens"]
    status, _, body = http("POST", proxy.url + "/v1/completions", {"model": "sim", "prompt": "once", "max_tokens": 3})
    assert status == 200, body
    prompt += body["usage"]["prompt_tokens"]
    output += body["usage"]["completion_tokens"]
    status, _, body = http("POST", proxy.url + "/v1/responses", {"model": "sim", "input": "hi", "max_output_tokens": 4})
    assert status == 200, body
    prompt += body["metrics"]["engine_prompt_tokens"]
    output += body["metrics"]["engine_output_tokens"]
    status, _, raw = http("POST", proxy.url + "/v1/responses",
                          {"model": "sim", "input": "hi", "max_output_tokens": 4, "stream": True})
    assert status == 200
    (done,) = [json.loads(line[6:]) for line in raw.decode().splitlines()
               if line.startswith("data: ") and '"response.metrics"' in line]
    prompt += done["metrics"]["engine_prompt_tokens"]
    output += done["metrics"]["engine_output_tokens"]
    status, _, body = http("POST", proxy.url + "/v1/chat/completions", {**chat, "model": "idle"})
    assert status == 409 and body["error"]["code"] == "model_not_loaded"

    # The backend's own gauges arrive with the pool's scrape of the replica (every half second).
    m = wait_for(lambda: (s := scrape(proxy))["samples"].get("llm_pool_backend_kv_cache_usage") and s,
                 what="the backend's gauges re-exported")
    chat_path = "/v1/chat/completions"
    assert value(m, "llm_pool_requests_total", model="sim", endpoint=chat_path, status="200", code="", key="gold") == 3
    assert value(m, "llm_pool_requests_total", model="sim", endpoint=chat_path, status="200", key="other") == 2
    assert value(m, "llm_pool_requests_total", model="sim", endpoint="/v1/completions", status="200") == 1
    assert value(m, "llm_pool_requests_total", model="sim", endpoint="/v1/responses", status="200") == 2
    assert value(m, "llm_pool_requests_total", model="idle", status="409", code="model_not_loaded") == 1
    assert {lab["key"] for lab, _ in m["samples"]["llm_pool_requests_total"]} == {"gold", "other"}
    # Token counters equal the usage the answers reported, summed over keys and endpoints.
    assert value(m, "llm_pool_prompt_tokens_total", model="sim") == prompt
    assert value(m, "llm_pool_output_tokens_total", model="sim") == output
    assert value(m, "llm_pool_output_tokens_total", model="sim", key="gold") == 3 * 5
    assert value(m, "llm_pool_request_seconds_count", model="sim", endpoint=chat_path) == 5
    assert value(m, "llm_pool_time_to_first_token_seconds_count", model="sim", endpoint=chat_path) == 2
    assert value(m, "llm_pool_time_to_first_token_seconds_count", model="sim", endpoint="/v1/responses") == 1
    assert value(m, "llm_pool_queue_wait_seconds_count", model="sim") == 8
    # Pool state, read at scrape time: states, requests per replica, load and warm-up times.
    assert value(m, "llm_pool_replica_state", model="sim", replica="0", state="ready") == 1
    assert value(m, "llm_pool_model_state", model="idle", state="unloaded") == 1
    assert value(m, "llm_pool_replica_requests_total", model="sim", replica="0") == 8
    assert value(m, "llm_pool_replica_restarts_total", model="sim") == 0
    assert value(m, "llm_pool_model_load_seconds", model="sim") > 0
    assert value(m, "llm_pool_replica_warmup_seconds", model="sim", replica="0") > 0
    assert "llm_pool_backend_requests_running" in m["samples"]

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"\bllm_pool_[a-z0-9_]+", e)}
    exposed = set(m["samples"]) | set(m["families"]) | \
        {f"{n}{s}" for n, t in m["families"].items() if t == "histogram" for s in ("_bucket", "_sum", "_count")} | \
        {f"{n}_total" for n, t in m["families"].items() if t == "counter"}
    assert used and used <= exposed, used - exposed


def test_warm_up_runs_before_ready_and_a_failed_one_keeps_the_replica_out(start_proxy) -> None:
    proxy = start_proxy({"sim": sim_model(warmup=True),
                         "broken": sim_model(warmup=True, sim={"error_rate": 1.0, "ttft_ms": 1})})
    proxy.wait_state("sim", "loaded")
    # Loaded means READY, and READY came after the warm-up: it is the first request the engine saw.
    started = sim_started(proxy, "sim")
    assert len(started) == 1 and started[0]["id"].startswith("llm-pool-warmup-")
    status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                           {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                           headers={"X-Request-Id": "first-real"})
    assert status == 200, body
    assert [s["id"] for s in sim_started(proxy, "sim")][1:] == ["first-real"]
    # A replica whose process crashed is warmed again before it is back in rotation.
    old_pid = proxy.admin_model("sim")["replicas"][0]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: (r := proxy.admin_model("sim")["replicas"][0])["state"] == "ready" and r["pid"] != old_pid,
             what="the restarted replica back in rotation")
    started = sim_started(proxy, "sim")
    assert len(started) == 1 and started[0]["id"].startswith("llm-pool-warmup-")
    # The engine answers its health check but every generation fails: never READY, the reason shown,
    # and each retry counted as a failed check.
    replica = wait_for(lambda: (r := proxy.admin_model("broken")["replicas"][0])["last_error"] and
                       "warm-up" in r["last_error"] and r, what="the warm-up failure to show")
    assert replica["state"] == "starting" and "HTTP 500" in replica["last_error"]
    assert proxy.admin_model("broken")["state"] == "loading"
    wait_for(lambda: value(scrape(proxy), "llm_pool_replica_health_check_failures_total", model="broken") >= 2,
             what="the warm-up to be retried")
