"""Priority classes through the real proxy, supervisord and the simulated engine (issue 44): a
tenant's class, a request's downgrade, the refusals, the aging bound under a flood, the admin view
and /metrics; with one process and with two workers (the class is the controller's to decide)."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest

from helpers import ProxyProcess, wait_for

pytestmark = pytest.mark.integration

UI_KEY, JOBS_KEY, ADMIN_TOKEN = "sk-ui-SECRET-77a1", "sk-jobs-SECRET-9b2c", "admin-SECRET-5d5d"
TENANTS = {
    "ui": {"key_env": ["UI_KEY"], "fairness_key": "ui", "priority": "interactive"},
    "jobs": {"key_env": ["JOBS_KEY"], "fairness_key": "jobs"},   # no priority: default
}
# One slot; each request's 2 tokens take about 0.1 s, a holder's 40 about 2 s.
SIM = {"backend": "sim", "enabled": True, "target_inflight": 1,
       "sim": {"max_seqs": 1, "decode_tokens_per_s": 20, "ttft_ms": 1}}
MAX_WAIT_S = 1.0


def start(workers: int, batch_max_wait_s: float) -> ProxyProcess:
    started = ProxyProcess({"sim": SIM}, service={"workers": workers},
                           engine={"fairness": {"max_queue_wait_s": 120, "classes": [
                               {"name": "interactive"}, {"name": "default"},
                               {"name": "batch", "max_wait_s": batch_max_wait_s}]}})
    return started.with_tenants(TENANTS, {"UI_KEY": UI_KEY, "JOBS_KEY": JOBS_KEY}, ADMIN_TOKEN).start_loaded("sim")


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def proxy(request: pytest.FixtureRequest) -> Iterator[ProxyProcess]:
    """The batch class ages at 600 s: nothing in these tests waits that long."""
    started = start(request.param, 600.0)
    yield started
    assert not started.cleanup()


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def aging_proxy(request: pytest.FixtureRequest) -> Iterator[ProxyProcess]:
    started = start(request.param, MAX_WAIT_S)
    yield started
    assert not started.cleanup()


def chat(proxy: ProxyProcess, key: str, max_tokens: int = 2, priority: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    if priority is not None:
        headers["X-Priority-Class"] = priority
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})
    req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=body.encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def classes(proxy: ProxyProcess) -> dict[str, dict[str, float]]:
    return proxy.admin_model("sim")["classes"]


def test_a_free_slot_goes_to_the_highest_class_waiting(proxy: ProxyProcess) -> None:
    finished: list[str] = []
    lock = threading.Lock()

    def send(name: str, key: str, max_tokens: int = 2, priority: str | None = None) -> threading.Thread:
        def run() -> None:
            status, _ = chat(proxy, key, max_tokens, priority)
            assert status == 200
            with lock:
                finished.append(name)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    threads = [send("holder", JOBS_KEY, max_tokens=40)]
    wait_for(lambda: classes(proxy)["default"]["running"] == 1, what="the holder running")
    # Queued one after another, in the order that would be served first without classes.
    for name, key, priority, cls in (("b0", JOBS_KEY, "batch", "batch"), ("b1", JOBS_KEY, "batch", "batch"),
                                     ("d0", JOBS_KEY, None, "default"), ("i0", UI_KEY, None, "interactive")):
        before = classes(proxy)[cls]["waiting"]
        threads.append(send(name, key, priority=priority))
        wait_for(lambda cls=cls, before=before: classes(proxy)[cls]["waiting"] == before + 1, what=f"{name} queued")
    waiting = classes(proxy)
    assert (waiting["interactive"]["waiting"], waiting["default"]["waiting"], waiting["batch"]["waiting"]) == (1, 1, 2)
    keys = proxy.admin_model("sim")["keys"]
    assert keys["jobs [batch]"] == {**keys["jobs [batch]"], "class": "batch", "waiting": 2}
    with urllib.request.urlopen(proxy.admin_url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'llm_pool_class_requests_waiting{class="batch",model="sim"} 2.0' in metrics
    for thread in threads:
        thread.join(120)
    assert finished == ["holder", "i0", "d0", "b0", "b1"]


def test_a_request_may_lower_its_class_never_raise_it(proxy: ProxyProcess) -> None:
    status, body = chat(proxy, JOBS_KEY, priority="interactive")
    assert status == 403 and body["error"]["code"] == "priority_not_allowed", body
    assert "'interactive' is above this request's 'default'" in body["error"]["message"]
    status, body = chat(proxy, JOBS_KEY, priority="gold")
    assert status == 400 and body["error"]["code"] == "invalid_priority_class", body
    assert "one of interactive, default, batch" in body["error"]["message"]
    assert chat(proxy, UI_KEY, priority="interactive")[0] == 200   # its own class
    assert chat(proxy, UI_KEY, priority="batch")[0] == 200


def test_a_batch_request_is_served_within_its_bound_under_an_interactive_flood(aging_proxy: ProxyProcess) -> None:
    """Four interactive clients keep the one slot busy and three of them always waiting: the batch
    request still runs, once it has waited max_wait_s, while the flood goes on."""
    proxy = aging_proxy
    stop = threading.Event()
    served: list[float] = []

    def flood() -> None:
        while not stop.is_set():
            assert chat(proxy, UI_KEY)[0] == 200
            served.append(time.monotonic())

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: classes(proxy)["interactive"]["waiting"] >= 2, what="a flood with requests waiting")
        sent = time.monotonic()
        status, _ = chat(proxy, JOBS_KEY, priority="batch")
        done = time.monotonic()
        assert status == 200
        assert classes(proxy)["interactive"]["waiting"] >= 1   # the flood goes on
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert sum(sent < t < done for t in served) >= 1   # the flood ran ahead of it meanwhile
    print(f"\nbatch request under a flood: waited and ran {done - sent:.2f}s (max_wait_s {MAX_WAIT_S:g}, plus one "
          f"request's service time, about 0.1 s, plus its own run)")
