"""More models in use than the memory budget holds, said (issue 40, item 2): a `thrash` event, a
counter and the memory report's warning when models take each other's room in turn; an
`over_budget` event and log line when a reload leaves loaded models over a smaller budget. Real
`llm-pool serve` and supervisord with sim replicas, each charged its estimate: a sparse weights
file of WEIGHTS_MIB (the sim process itself holds far less)."""
from __future__ import annotations

import threading
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from helpers import ProxyProcess, http, sim_model, wait_for

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
WEIGHTS_MIB = 200
ROOM_FOR_TWO_MIB = 450
THIRD_EVERY_S = 8.0     # the pace of requests to the third model
GUARD_S = 180.0         # a guard against a hang, not a threshold: the issue saw thrash within a minute


def weights(tmp_path: Path) -> str:
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:
        f.truncate(WEIGHTS_MIB * MIB)   # sparse: its size is the estimate, and no disk is written
    return str(path)


def ask(proxy: ProxyProcess, model: str) -> int:
    return http("POST", proxy.url + "/v1/chat/completions",
                body={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})[0]


def events(proxy: ProxyProcess, kinds: str) -> list[dict[str, Any]]:
    status, _, body = http("GET", f"{proxy.url}/v1/admin/events?kind={kinds}")
    assert status == 200, body
    return list(body["data"])


def thrash_counts(proxy: ProxyProcess) -> dict[str, float]:
    text = urllib.request.urlopen(proxy.url + "/metrics", timeout=30).read().decode()
    return {s.labels["model"]: s.value for f in text_string_to_metric_families(text) if f.name == "llm_pool_thrash"
            for s in f.samples if s.name == "llm_pool_thrash_total"}


def in_loop(stop: threading.Event, call: Callable[[], Any], pause_s: float = 0.0) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            call()
            stop.wait(pause_s)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_two_busy_models_and_a_third_every_8s_in_room_for_two_are_a_thrash_event_a_counter_and_a_warning(
        proxies: list[ProxyProcess], tmp_path: Path) -> None:
    path = weights(tmp_path)
    models = {n: sim_model(model_path=path, load_on_demand=True, enabled=n != "c", target_inflight=1,
                           sim={"ttft_ms": 1, "decode_tokens_per_s": 200}) for n in "abc"}
    # The settings, but a long window: every swap of the three falls in it, so the event is
    # said once however long this runs on a busy machine.
    proxy = ProxyProcess(models,
                         engine={"lifecycle": {"memory": {"cpu_budget_mib": ROOM_FOR_TWO_MIB},
                                               "thrash_window_s": 3600}})
    proxies.append(proxy)
    proxy.start()
    proxy.wait_state("a", "loaded")
    proxy.wait_state("b", "loaded")
    statuses: list[int] = []
    stop = threading.Event()
    traffic = [in_loop(stop, lambda: statuses.append(ask(proxy, "a"))),
               in_loop(stop, lambda: statuses.append(ask(proxy, "b"))),
               in_loop(stop, lambda: statuses.append(ask(proxy, "c")), pause_s=THIRD_EVERY_S)]
    try:
        said = wait_for(lambda: events(proxy, "thrash"), GUARD_S, what="a thrash event")
        # Swaps go on: each is counted, and the same three models are not said again.
        wait_for(lambda: sum(thrash_counts(proxy).values()) >= 2, GUARD_S, what="a second thrash counted")
    finally:
        stop.set()
        for thread in traffic:
            thread.join(120)
    (event,) = events(proxy, "thrash")
    assert event == said[0] and event["model"] in ("a", "b", "c")
    assert f"the models in use (a, b, c) need {3 * WEIGHTS_MIB:.1f} MiB together on cpu, more than its budget " \
           f"of {ROOM_FOR_TWO_MIB:.1f} MiB" in event["message"], event
    status, _, memory = http("GET", proxy.url + "/v1/admin/memory")
    assert status == 200
    recent = memory["thrash"]["recent"]
    assert (recent["models"], recent["device"], recent["needed_mib"], recent["budget_mib"]) == \
        (["a", "b", "c"], "cpu", 3 * WEIGHTS_MIB, ROOM_FOR_TWO_MIB), recent
    assert memory["thrash"]["counts"] == thrash_counts(proxy)
    assert set(statuses) == {200}, statuses   # every request was answered, however often its model swapped
    assert event["message"] in proxy.log_path.read_text()


def test_a_reload_to_a_budget_smaller_than_the_loaded_models_is_an_over_budget_event_and_log_line(
        proxies: list[ProxyProcess], tmp_path: Path) -> None:
    path = weights(tmp_path)
    proxy = ProxyProcess({n: sim_model(model_path=path) for n in "ab"}, engine={"lifecycle": {"memory": {"cpu_budget_mib": 500}}})
    proxies.append(proxy)
    proxy.start()
    proxy.wait_state("a", "loaded")
    proxy.wait_state("b", "loaded")
    assert events(proxy, "over_budget") == []
    proxy.config["engine"]["lifecycle"]["memory"]["cpu_budget_mib"] = 300
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.reload()
    (event,) = wait_for(lambda: events(proxy, "over_budget"), what="an over_budget event after the reload")
    sentence = (f"device cpu holds {2 * WEIGHTS_MIB:.1f} MiB of loaded models (a, b), {2 * WEIGHTS_MIB - 300:.1f} "
                "MiB more than its budget of 300.0 MiB")
    assert event["message"].startswith(sentence), event
    assert [proxy.admin_model(n)["state"] for n in "ab"] == ["loaded", "loaded"]   # adopted, nothing evicted
    assert sentence in proxy.log_path.read_text()
