"""A pool bigger than its memory: load on demand, idle unload, eviction and the swap-aware order,
on real `llm-pool serve` with real llama-server replicas of the tiny GGUF under a CPU budget.

llama-server allocates (and clears, so touches) its KV cache at start: `llama_server_n_ctx` sets
what a replica holds. BIG's KV cache is 128 MiB (262144 tokens x 512 bytes) and its compute buffer
257 MiB (the attention mask over that context, reserved, touched as the context fills): with the
server process, an estimate of 401.5 MiB, above what it is measured to hold after a short request
(about 150 MiB resident). So it is charged 401.5 MiB, and under a 900 MiB budget exactly two BIG
models fit. Every wait here is for an event (a state, a count), never for time.
"""
from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

from helpers import ProxyProcess, http, wait_for

pytestmark = pytest.mark.integration

BIG_CTX = 262144
BUDGET_MIB = 900
ROOM_FOR_ONE_MIB = 600
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def big(llama_model: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """A tiny GGUF with a big KV cache on the CPU that loads on demand (not at startup)."""
    def make(**fields: Any) -> dict[str, Any]:
        # --context-shift: without it llama-server ends a generation at the model's training context
        # (2048 tokens), and a "long" stream meant to keep a model busy ends within a second.
        return llama_model(**{"llama_server_n_ctx": BIG_CTX, "llama_server_n_gpu_layers": 0, "enabled": False,
                              "load_on_demand": True, "target_inflight": 1,
                              "llama_server_extra_args": ["--context-shift"], **fields})
    return make


def pool(start_proxy: Callable[..., ProxyProcess], models: dict[str, dict[str, Any]], budget_mib: float = BUDGET_MIB,
         **lifecycle: Any) -> ProxyProcess:
    return start_proxy(models, engine={"lifecycle": {"memory": {"cpu_budget_mib": budget_mib}, **lifecycle}})


def ask(proxy: ProxyProcess, model: str, key: str | None = None, max_tokens: int = 4) -> tuple[int, dict, Any]:
    headers = {"X-Fairness-Key": key} if key else None
    return http("POST", proxy.url + "/v1/chat/completions", headers=headers,
                body={"model": model, "messages": CHAT, "max_tokens": max_tokens})


def in_threads(calls: list[Callable[[], Any]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=call, daemon=True) for call in calls]
    for t in threads:
        t.start()
    return threads


def open_stream(proxy: ProxyProcess, model: str, max_tokens: int = 100000) -> Any:
    """A long stream, read up to its first chunk: the request is running at its replica."""
    body = {"model": model, "messages": CHAT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=300)
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    return resp


def state(proxy: ProxyProcess, name: str) -> str:
    return str(proxy.admin_model(name)["state"])


def memory(proxy: ProxyProcess) -> dict[str, Any]:
    status, _, body = http("GET", proxy.url + "/v1/admin/memory")
    assert status == 200, body
    return body


def test_a_burst_of_first_requests_loads_the_model_once_and_all_are_answered(start_proxy, big) -> None:
    proxy = pool(start_proxy, {"a": big(target_inflight=2)})
    assert state(proxy, "a") == "unloaded"
    results: list[int] = []

    def stream() -> None:
        # Headers come once a replica is ready: a client sees 200 and the answer, or the error's status.
        with open_stream(proxy, "a", max_tokens=4) as resp:
            results.append(resp.status if resp.read().rstrip().endswith(b"data: [DONE]") else -1)

    def responses() -> None:
        # decoding.max_tokens bounds it: the model runs with --context-shift, so only its end token would.
        status, _, body = http("POST", proxy.url + "/v1/responses", body={"model": "a", "input": "hi",
                                                                           "decoding": {"max_tokens": 4}})
        results.append(status if body.get("object") == "response" and body.get("output") else -2)

    threads = in_threads([lambda: results.append(ask(proxy, "a")[0]) for _ in range(4)] + [stream, responses])
    for t in threads:
        t.join(300)
    assert results == [200] * 6
    model = proxy.admin_model("a")
    assert model["state"] == "loaded" and model["loads"] == {"on_demand": 1}
    text = urllib.request.urlopen(proxy.url + "/metrics", timeout=30).read().decode()
    assert 'llm_pool_model_loads_total{model="a",reason="on_demand"} 1.0' in text
    assert 'llm_pool_model_load_wait_seconds_count{model="a"} 6.0' in text


def test_an_admin_load_makes_room_by_evicting_an_idle_model_or_is_refused_at_once(start_proxy, big) -> None:
    proxy = pool(start_proxy, {"a": big(), "b": big(), "c": big(load_on_demand=False)})
    status, _, body = ask(proxy, "c")         # not on demand: as before, an admin loads it
    assert (status, body["error"]["code"]) == (409, "model_not_loaded")
    assert ask(proxy, "a")[0] == 200
    assert ask(proxy, "b")[0] == 200
    status, _, body = http("POST", proxy.url + "/v1/admin/models/c/load")
    assert status == 200 and body["state"] == "loaded" and body["loads"] == {"admin": 1}
    assert [state(proxy, n) for n in "ab"] == ["unloaded", "loaded"]
    with open_stream(proxy, "b"), open_stream(proxy, "c"):
        status, headers, body = http("POST", proxy.url + "/v1/admin/models/a/load")
        assert (status, body["error"]["code"]) == (503, "insufficient_memory")
        assert int(headers["Retry-After"]) >= 1 and state(proxy, "a") == "unloaded"


class HeldStream(threading.Thread):
    """One client's endless stream, from its own thread: it waits in the queue, runs once its first
    event came (`running`), and is closed when the test says (`close`): while it runs it holds the
    model's one slot, so what runs next is the scheduler's choice alone, seen in the admin view."""

    def __init__(self, proxy: ProxyProcess, model: str, key: str) -> None:
        super().__init__(daemon=True)
        self.proxy, self.model, self.key = proxy, model, key
        self.running, self.close = threading.Event(), threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": self.model, "messages": CHAT, "max_tokens": 100000, "stream": True, "ignore_eos": True}
        req = urllib.request.Request(self.proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Fairness-Key": self.key})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                assert resp.status == 200 and resp.readline().startswith(b"data: ")
                self.running.set()
                self.close.wait(300)
        except BaseException as exc:   # noqa: BLE001 - told to the test, which asserts on it
            self.error = exc
            self.running.set()


def running_keys(proxy: ProxyProcess, model: str) -> dict[str, int]:
    return {name: k["active"] for name, k in proxy.admin_model(model)["keys"].items() if k["active"]}


def test_fairness_holds_while_the_model_is_cold(start_proxy, big, llama_server_bin: Path, tmp_path: Path) -> None:
    gate = tmp_path / "gate"   # the model's load waits for this file: the requests queue meanwhile
    held = tmp_path / "held-llama-server"
    # --context-shift: the streams run until they are closed, past the model's training context. The
    # wrapper adds it, not the extra args: checking those would run the held binary's --help, which
    # waits for the gate too.
    held.write_text(f"#!/bin/sh\nwhile [ ! -e {gate} ]; do sleep 0.05; done\n"
                    f"exec {llama_server_bin} \"$@\" --context-shift\n")
    held.chmod(0o755)
    proxy = pool(start_proxy, {"a": big(llama_server_binary=str(held), llama_server_extra_args=[])})
    batch = [HeldStream(proxy, "a", "batch") for _ in range(4)]
    ui = HeldStream(proxy, "a", "ui")
    started: list[HeldStream] = []
    try:
        for stream in batch:
            stream.start()
            started.append(stream)
        wait_for(lambda: proxy.admin_model("a")["waiting"] == 4, what="the batch requests to queue")
        ui.start()
        started.append(ui)
        wait_for(lambda: proxy.admin_model("a")["waiting"] == 5, what="the ui request to queue")
        assert state(proxy, "a") == "loading"
        gate.touch()
        # One slot: the first batch request runs, then the ui key (it has used nothing), not fifth in line.
        wait_for(lambda: any(s.running.is_set() for s in batch + [ui]), what="the first request to run")
        first = [s for s in batch + [ui] if s.running.is_set()]
        assert [(s.key, s.error) for s in first] == [("batch", None)]
        first[0].close.set()
        wait_for(lambda: sum(s.running.is_set() for s in batch + [ui]) == 2, what="the second request to run")
        assert ui.running.is_set() and ui.error is None
        assert running_keys(proxy, "a") == {"ui": 1}
    finally:
        for stream in started:
            stream.close.set()   # each runs in turn, and is closed as it starts
        for stream in started:
            stream.join(300)
    assert all(s.error is None for s in started), [s.error for s in started]


def test_a_failed_load_fails_every_waiter_and_backs_off(start_proxy, big, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 64)   # the magic, then nothing llama-server can load
    proxy = start_proxy({"a": big(model_path=str(broken))}, load_retry_base_s=3600, load_retry_max_s=7200)
    results: list[tuple[int, Any]] = []
    threads = in_threads([lambda: results.append(ask(proxy, "a")[::2]) for _ in range(3)])
    for t in threads:
        t.join(300)
    assert [s for s, _ in results] == [502] * 3
    assert all(body["error"]["code"] == "model_load_failed" for _, body in results)
    # No load storm: the next request is refused at once, with when the next load is tried.
    status, headers, body = ask(proxy, "a")
    assert (status, body["error"]["code"]) == (502, "model_load_failed")
    assert "next load is tried in" in body["error"]["message"] and int(headers["Retry-After"]) > 3000
    model = proxy.admin_model("a")
    assert model["backoff"]["attempts"] == 1 and model["backoff"]["next_attempt_in_s"] > 3000
    assert model["loads"] == {}


def test_the_least_recently_used_idle_model_is_evicted_to_make_room(start_proxy, big) -> None:
    # min_residence_s 0: with it c waits for b to have been loaded that long, and by then a and b
    # have been idle about as long, when the cheaper reload goes first (a rule of its own).
    proxy = pool(start_proxy, {"a": big(), "b": big(), "c": big()}, min_residence_s=0)
    assert ask(proxy, "a")[0] == 200
    assert ask(proxy, "b")[0] == 200
    assert ask(proxy, "a")[0] == 200          # b is now the least recently used
    assert ask(proxy, "c")[0] == 200
    assert [state(proxy, n) for n in "abc"] == ["loaded", "unloaded", "loaded"]
    assert proxy.admin_model("b")["unloads"] == {"evicted": 1}
    # What a replica took was measured after its load; its charge stays the estimate, which counts
    # the buffers it reserved and has not yet touched.
    footprint = proxy.admin_model("a")["footprint"]
    assert footprint["measured_samples"] >= 1 and footprint["admitted_by"] == "estimated"
    assert footprint["measured_mib_per_replica"]["cpu"] < footprint["estimated_mib_per_replica"]
    assert footprint["devices"] == ["cpu"] and "llama_server_n_gpu_layers: 0" in footprint["why"]
    mem = memory(proxy)
    (cpu,) = [d for d in mem["devices"] if d["device"] == "cpu"]
    assert cpu["budget_bytes"] == BUDGET_MIB * 1024 * 1024 and sorted(cpu["models"]) == ["a", "c"]


def test_a_busy_model_is_not_evicted_while_an_idle_one_would_do(start_proxy, big) -> None:
    proxy = pool(start_proxy, {"a": big(), "b": big(), "c": big()})
    assert ask(proxy, "a")[0] == 200
    assert ask(proxy, "b")[0] == 200
    with open_stream(proxy, "a"):              # a is the least recently used, but busy
        assert ask(proxy, "c")[0] == 200
        assert [state(proxy, n) for n in "abc"] == ["loaded", "unloaded", "loaded"]


def test_pinned_models_are_never_evicted_and_a_model_that_cannot_fit_is_refused_at_once(start_proxy, big) -> None:
    proxy = pool(start_proxy, {"p": big(pinned=True), "q": big(pinned=True), "a": big(), "b": big(),
                               "huge": big(llama_server_n_ctx=4 * BIG_CTX)})
    status, _, body = ask(proxy, "huge")      # 512 MiB of KV cache and 1 GiB of buffers: never fits in 900
    assert (status, body["error"]["code"]) == (409, "model_too_large")
    assert "needs" in body["error"]["message"] and "budget of 900.0 MiB" in body["error"]["message"]
    assert state(proxy, "huge") == "unloaded"
    assert ask(proxy, "p")[0] == 200          # pinned, and the least recently used from here on
    assert ask(proxy, "a")[0] == 200
    assert ask(proxy, "b")[0] == 200          # evicts a, not p
    assert [state(proxy, n) for n in "pab"] == ["loaded", "unloaded", "loaded"]
    assert ask(proxy, "q")[0] == 200          # evicts b
    status, _, body = ask(proxy, "a")         # p and q are pinned: a can never fit beside them
    assert (status, body["error"]["code"]) == (409, "model_too_large")
    assert [state(proxy, n) for n in "pq"] == ["loaded", "loaded"]


def test_an_idle_model_is_unloaded_after_idle_unload_s_and_a_pinned_one_is_not(start_proxy, big) -> None:
    proxy = pool(start_proxy, {"pinned": big(pinned=True, idle_unload_s=0.5), "a": big(idle_unload_s=0.5),
                               "boot": big(enabled=True, idle_unload_s=3600, llama_server_n_ctx=4096)},
                 budget_mib=BUDGET_MIB)
    boot = proxy.wait_state("boot", "loaded")
    assert boot["last_used"] is not None       # its idle time counts from its load at startup, not from 1970
    assert ask(proxy, "pinned")[0] == 200
    assert ask(proxy, "a")[0] == 200
    proxy.wait_state("a", "unloaded")
    # The pinned model was idle longer than `a` when `a` was unloaded.
    assert proxy.admin_model("pinned")["state"] == "loaded"
    assert proxy.admin_model("a")["unloads"] == {"idle": 1}
    assert ask(proxy, "a")[0] == 200          # and loads again on the next request
    assert proxy.admin_model("a")["loads"] == {"on_demand": 2}
    assert proxy.admin_model("boot")["state"] == "loaded"


def test_insufficient_memory_when_only_busy_models_hold_the_room(start_proxy, big) -> None:
    proxy = start_proxy({"a": big(), "b": big(), "c": big()},
                        engine={"lifecycle": {"memory": {"cpu_budget_mib": BUDGET_MIB}, "swap_max_wait_s": 3600},
                                "fairness": {"max_queue_wait_s": 2}})
    for name in "ab":    # loaded first: their own loads are not what the short queue wait is for
        assert http("POST", proxy.url + f"/v1/admin/models/{name}/load")[0] == 200
    with open_stream(proxy, "a") as a, open_stream(proxy, "b") as b:
        status, headers, body = ask(proxy, "c")
        assert (status, body["error"]["code"]) == (503, "insufficient_memory")
        message = body["error"]["message"]
        assert "cpu: needs" in message and "MiB free of a budget of 900.0 MiB" in message and "could be freed" in message
        assert int(headers["Retry-After"]) >= 1
        assert state(proxy, "c") == "unloaded"
        # Past the swap bound (here the busy models' own reload time) one of them is being swapped
        # out for c, and its running request still runs to its end: nothing was cut short.
        for resp in (a, b):
            lines = [resp.readline() for _ in range(20)]
            assert all(line.startswith(b"data: {") or line == b"\n" for line in lines), lines


def test_footprints_and_usage_times_survive_a_restart(big, proxies) -> None:
    proxy = ProxyProcess({"a": big()}, engine={"lifecycle": {"memory": {"cpu_budget_mib": BUDGET_MIB}}})
    proxies.append(proxy)
    proxy.start(keep_models=True)
    assert ask(proxy, "a")[0] == 200
    wait_for(lambda: proxy.admin_model("a")["footprint"]["measured_samples"] > 0, what="a's measurement")
    before = proxy.admin_model("a")
    proxy.stop()                               # --keep-models: a keeps running
    proxy.start()
    after = proxy.wait_state("a", "loaded")    # adopted, not loaded again
    assert after["loads"].get("on_demand") is None
    assert after["last_used"] == before["last_used"]
    assert after["footprint"]["measured_mib_per_replica"] is not None
    assert after["footprint"]["measured_samples"] >= before["footprint"]["measured_samples"]
    proxy.stop()
    proxy.start()                              # and after a restart that unloaded it
    cold = proxy.admin_model("a")
    assert cold["state"] == "unloaded" and cold["footprint"]["measured_samples"] >= before["footprint"]["measured_samples"]


def test_swap_aware_order_a_b_a_a_c_costs_three_loads(start_proxy, big, llama_server_bin: Path,
                                                      tmp_path: Path) -> None:
    # Room for one model: every other load is a swap. Each load takes 3 s more, as a real model's
    # does: the swap bound is never longer than reloading the busy model, and it must not be the
    # tiny model's fraction of a second here.
    slow = tmp_path / "slow-llama-server"
    slow.write_text(f"#!/bin/sh\nsleep 3\nexec {llama_server_bin} \"$@\"\n")
    slow.chmod(0o755)
    proxy = pool(start_proxy, {n: big(llama_server_binary=str(slow)) for n in "abc"}, budget_mib=ROOM_FOR_ONE_MIB,
                 swap_max_wait_s=3600)
    statuses: list[tuple[str, int]] = []

    def send(name: str) -> Callable[[], None]:
        return lambda: statuses.append((name, ask(proxy, name)[0]))

    threads = []
    with open_stream(proxy, "a"):              # a loads and is busy until the stream is closed
        for name, count in (("b", 1), ("a", 1), ("a", 2), ("c", 1)):
            threads += in_threads([send(name)])
            wait_for(lambda n=name, c=count: proxy.admin_model(n)["waiting"] == c, what=f"{name} to queue")
    for t in threads:
        t.join(300)
    assert sorted(statuses) == [("a", 200), ("a", 200), ("b", 200), ("c", 200)]
    # a served both of its queued requests before it was swapped out for b: three loads, not four.
    loads = {n: proxy.admin_model(n)["loads"].get("on_demand", 0) for n in "abc"}
    assert loads == {"a": 1, "b": 1, "c": 1}


def test_the_swap_bound_stops_a_resident_model_from_holding_a_cold_one_for_longer(start_proxy, big) -> None:
    proxy = pool(start_proxy, {"a": big(), "b": big()}, budget_mib=ROOM_FOR_ONE_MIB, swap_max_wait_s=0.5)
    done: list[tuple[str, int]] = []

    def send(name: str) -> Callable[[], None]:
        return lambda: done.append((name, ask(proxy, name)[0]))

    with open_stream(proxy, "a") as running:   # a is busy, and has a queue behind it
        a_queue = in_threads([send("a") for _ in range(3)])
        wait_for(lambda: proxy.admin_model("a")["waiting"] == 3, what="a's queue")
        b = in_threads([send("b")])
        # Past the bound a is drained: its queue waits, and its running request is not cut short.
        wait_for(lambda: proxy.admin_model("a")["state"] == "unloading", what="a to be swapped out")
        lines = [running.readline() for _ in range(40)]
        assert all(line.startswith(b"data: {") or line == b"\n" for line in lines), lines
        # A request for a while it is swapped out joins its queue: it takes no slot, or a popular
        # model would never drain.
        # (Placer.demand's rule, tested without timing in tests/proxy/lifecycle/test_placer.py.)
        late = in_threads([send("a")])
        queued = wait_for(lambda: (lambda m: m if m["waiting"] == 4 or len(done) > 1 else None)(
            proxy.admin_model("a")), what="the late request to queue")
        if queued["state"] == "unloading":
            assert (queued["active"], queued["capacity"]) == (1, 0), queued
    for t in a_queue + b + late:
        t.join(300)
    # b went first: without the bound it would have waited for all of a's queue.
    assert done[0] == ("b", 200) and sorted(done[1:]) == [("a", 200)] * 4, done
    assert proxy.admin_model("a")["unloads"] == {"evicted": 1}
    assert proxy.admin_model("a")["loads"] == {"on_demand": 2}
