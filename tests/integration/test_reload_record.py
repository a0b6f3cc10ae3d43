"""A reload keeps the record (issue 40, item 1): after SIGUSR1 under traffic `ctl events` shows the
events from before with their ids, and no counter of /metrics scraped before, during and after
goes down, what the old process counted while it drained included; a restart after SIGKILL keeps
the events that were written. Real `llm-pool serve` processes under a real supervisord with sim
replicas, a tenant's key on every request."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from helpers import REPO, ProxyProcess, http, sim_model, wait_for

pytestmark = pytest.mark.integration
KEY = "sk-tenant-SECRET-40"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ADDED = ("_total", "_bucket", "_count", "_sum")   # the samples of counters, histograms and summaries
Series = tuple[str, tuple[tuple[str, str], ...]]


def record_proxy(models: dict[str, dict[str, Any]]) -> ProxyProcess:
    proxy = ProxyProcess(models)
    proxy.config["tenants"] = {"t": {"key_env": ["TENANT_KEY"], "fairness_key": "t"}}
    proxy.env = {"TENANT_KEY": KEY}
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    return proxy


def chat(proxy: ProxyProcess, model: str, max_tokens: int = 4) -> int:
    try:
        return http("POST", proxy.url + "/v1/chat/completions",
                    {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens},
                    headers=HEADERS, timeout=120)[0]
    except OSError:
        return 0


def counters(text: str) -> dict[Series, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text)
            if family.type in ("counter", "histogram", "summary") for s in family.samples if s.name.endswith(ADDED)}


def events(proxy: ProxyProcess) -> list[dict[str, Any]]:
    """What `llm-pool ctl events` shows an admin, as JSON."""
    env = {**os.environ, "LLM_POOL_LOCAL_SETTINGS_PATH": str(proxy.state_dir / "no-local.yaml")}
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "--config", str(proxy.config_path), "ctl", "--json",
                           "events", "--limit", "1000"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout)["data"])


def admin_cycle(proxy: ProxyProcess, model: str) -> None:
    """An admin unloads and loads `model`: events (admin, unload, load) and counts (loads, unloads)."""
    for action in ("unload", "load"):
        status, _, body = http("POST", proxy.url + f"/v1/admin/models/{model}/{action}")
        assert status == 200, body


class Traffic:
    """Client threads sending chat requests without pause, and one scraping /metrics without pause
    that keeps every counter it saw go down. A scrape answered otherwise than 200 (a reload's new
    process before it took over, or the old one after it handed over) is only a gap."""

    def __init__(self, proxy: ProxyProcess, clients: int = 3) -> None:
        self.proxy = proxy
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.statuses: list[int] = []
        self.last: dict[Series, float] = {}
        self.went_down: list[tuple[Series, float, float]] = []
        self.vanished: set[Series] = set()
        self.scrapes = 0
        self.threads = [threading.Thread(target=self._client) for _ in range(clients)]
        self.threads.append(threading.Thread(target=self._scraper))

    def _client(self) -> None:
        while not self.stopping.is_set():
            status = chat(self.proxy, "sim")
            with self.lock:
                self.statuses.append(status)

    def _scraper(self) -> None:
        while not self.stopping.is_set():
            self.scrape()

    def scrape(self) -> dict[Series, float]:
        try:
            status, _, text = http("GET", self.proxy.url + "/metrics", timeout=60)
        except OSError:
            return {}
        if status != 200:
            return {}
        seen = counters(text.decode() if isinstance(text, bytes) else str(text))
        with self.lock:
            for series, before in self.last.items():
                now = seen.get(series)
                if now is None:
                    self.vanished.add(series)
                elif now < before:
                    self.went_down.append((series, before, now))
            self.last = seen
            self.scrapes += 1
        return seen

    def count(self) -> int:
        with self.lock:
            return len(self.statuses)

    def __enter__(self) -> "Traffic":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(120)


def test_a_reload_under_traffic_keeps_the_events_with_their_ids_and_no_counter_goes_down(proxies) -> None:
    proxy = record_proxy({"sim": sim_model(replicas=2, replica_max=2), "spare": sim_model(),
                          # 20 tokens a second: a long request is still running when the successor takes over.
                          "slow": sim_model(sim={"ttft_ms": 1, "decode_tokens_per_s": 20})})
    proxies.append(proxy)
    proxy.start()
    for name in ("sim", "spare", "slow"):
        proxy.wait_state(name, "loaded")
    admin_cycle(proxy, "spare")
    spare = proxy.wait_state("spare", "loaded")
    before = events(proxy)
    assert {"admin", "unload", "load"} <= {e["kind"] for e in before}
    old = proxy.serving_pid
    long: list[int] = []
    with Traffic(proxy) as traffic:
        wait_for(lambda: traffic.count() >= 50 and traffic.scrapes >= 3, what="traffic and scrapes before the reload")
        scraped_before = dict(traffic.last)
        drained = threading.Thread(target=lambda: long.append(chat(proxy, "slow", max_tokens=200)))   # 10 s
        drained.start()
        wait_for(lambda: proxy.admin_model("slow")["active"] == 1, what="the long request to run")
        assert proxy.reload() == 0   # returns once the old process, having finished the long request, has exited
        drained.join(120)
        served_by_then = traffic.count()
        scrapes_by_then = traffic.scrapes
        wait_for(lambda: traffic.count() >= served_by_then + 50 and traffic.scrapes >= scrapes_by_then + 3,
                 what="traffic and scrapes after the reload")
    assert proxy.serving_pid != old and long == [200]
    assert set(traffic.statuses) == {200}, sorted(set(traffic.statuses))
    assert traffic.went_down == [] and traffic.vanished == set()
    after = traffic.scrape()
    assert after and all(after.get(series, -1) >= value for series, value in scraped_before.items())
    # Each request counted once, in one process or the other: the long one in the old process as it drained.
    requests = ("llm_pool_tenant_requests_total", (("status", "200"), ("tenant", "t")))
    wait_for(lambda: traffic.scrape().get(requests) == len(traffic.statuses) + 1,
             what=f"{len(traffic.statuses) + 1} requests of tenant t in /metrics")
    slow = [v for (name, labels), v in traffic.scrape().items()
            if name == "llm_pool_requests_total" and {("model", "slow"), ("status", "200")} <= set(labels)]
    assert sum(slow) == 1
    # The events from before, with their ids; the new process's numbered after them.
    shown = events(proxy)
    assert shown[:len(before)] == before
    took_over = [e for e in shown[len(before):] if e["kind"] == "reload"]
    assert [e["reason"] for e in took_over] == ["took_over"]
    assert [e["id"] for e in shown] == sorted({e["id"] for e in shown}) and shown[len(before)]["id"] > before[-1]["id"]
    # The admin view's counts go on as well (the new process's adoption is a load of its own).
    model = proxy.admin_model("spare")
    assert model["unloads"] == spare["unloads"] == {"admin": 1}
    assert all(model["loads"].get(reason, 0) >= n for reason, n in spare["loads"].items()) and spare["loads"]["admin"]


def test_a_restart_after_sigkill_keeps_the_events_that_were_written(proxies) -> None:
    proxy = record_proxy({"sim": sim_model(), "spare": sim_model()})
    proxies.append(proxy)
    proxy.start()
    proxy.wait_state("spare", "loaded")
    admin_cycle(proxy, "spare")
    proxy.wait_state("spare", "loaded")
    before = events(proxy)
    assert proxy.proc is not None
    proxy.proc.kill()   # no goodbye: only what was written survives
    proxy.proc.wait(60)
    proxy.start()       # adopts the replicas that kept running under supervisord
    proxy.wait_state("spare", "loaded")
    shown = events(proxy)
    assert shown[:len(before)] == before
    adopted = [e for e in shown[len(before):] if e["kind"] == "load"]
    assert {e["reason"] for e in adopted} == {"adopted"} and adopted[0]["id"] > before[-1]["id"]
