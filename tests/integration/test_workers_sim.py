"""service.workers: 2 on a real `llm-pool serve` (real supervisord, sim replicas): the controller
decides, the workers accept the clients and relay the replicas' answers (docs/workers.md). What a
client, an admin and the metrics see is what one process gives; a worker that dies costs only what
it relayed, and the controller starts another."""
from __future__ import annotations

import http.client as httpc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from helpers import REPO, ProxyProcess, free_port, http, pid_alive, sim_model, wait_for

pytestmark = pytest.mark.integration
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}


def workers_of(proxy: ProxyProcess) -> list[dict[str, Any]]:
    return [p for p in proxy.processes() if p["role"] == "worker"]


def metric(proxy: ProxyProcess, name: str, **labels: str) -> float:
    status, _, raw = http("GET", proxy.url + "/metrics")
    assert status == 200
    total = 0.0
    for line in raw.decode().splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def active(proxy: ProxyProcess, key: str = "") -> float:
    return proxy.admin_model("sim")["keys"].get(key, {"active": 0})["active"]


def stream_events(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]


def test_two_workers_answer_as_one_process_and_the_admin_sees_each(start_proxy) -> None:
    proxy = start_proxy({"sim": sim_model()}, workers=2)
    proxy.wait_state("sim", "loaded")
    rows = proxy.processes()
    assert [(r["role"], r["index"]) for r in rows] == [("controller", None), ("worker", 0), ("worker", 1)]
    pids = {r["pid"] for r in rows}
    assert len(pids) == 3 and proxy.serving_pid in pids and all(pid_alive(p) for p in pids)

    status, headers, body = http("POST", proxy.url + "/v1/chat/completions", CHAT)
    assert status == 200 and body["usage"]["completion_tokens"] == 5 and headers["X-Replica"] == "0"
    status, headers, raw = http("POST", proxy.url + "/v1/chat/completions", {**CHAT, "stream": True})
    events = stream_events(raw)
    assert status == 200 and headers["Content-Type"] == "text/event-stream" and events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["delta"].get("content") is not None for e in events[:-1]] == [True] * 5 + [False]
    status, _, raw = http("POST", proxy.url + "/v1/chat/completions",
                          {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and json.loads(stream_events(raw)[-2])["usage"]["completion_tokens"] == 5
    # A translated route, an error, and the admin API: all through a worker, answered as before.
    status, _, body = http("POST", proxy.url + "/v1/responses", {"model": "sim", "input": "hi",
                                                                 "decoding": {"max_tokens": 4}})
    assert status == 200 and body["metrics"]["engine_output_tokens"] == 4, body
    status, _, body = http("POST", proxy.url + "/v1/chat/completions", {**CHAT, "model": "nope"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, _, body = http("POST", proxy.url + "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json"

    # One /metrics across the processes: every request counted once, with its tokens (a stream's
    # once its worker's report reached the controller, a moment after the client had its end).
    wait_for(lambda: metric(proxy, "llm_pool_requests_total", model="sim", status="200") == 4,
             what="4 requests counted")
    assert metric(proxy, "llm_pool_requests_total", model="sim", endpoint="/v1/chat/completions", status="200") == 3
    assert metric(proxy, "llm_pool_output_tokens_total", model="sim") == 5 * 3 + 4
    # The admin's actions name the client's address, as one process does (the worker passes it on).
    status, _, body = http("POST", proxy.url + "/v1/admin/models/sim/load", {})
    assert status == 200, body
    status, _, events = http("GET", proxy.url + "/v1/admin/events?kind=admin")
    assert status == 200 and [e["actor"] for e in events["data"]] == ["127.0.0.1 (no token needed)"], events
    ctl = subprocess.run([sys.executable, "-m", "proxy.cli", "ctl", "--url", proxy.url, "processes"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert ctl.returncode == 0, ctl.stderr
    lines = ctl.stdout.splitlines()
    assert lines[0].split()[:3] == ["ROLE", "PID", "STATE"] and len(lines) == 4
    assert lines[2].split()[:4] == ["worker", "0", str(rows[1]["pid"]), "running"]


def test_a_stream_is_relayed_by_its_worker_and_a_client_that_leaves_is_charged_what_it_got(start_proxy) -> None:
    proxy = start_proxy({"sim": sim_model(sim={"max_seqs": 2, "decode_tokens_per_s": 50, "ttft_ms": 1})}, workers=2)
    proxy.wait_state("sim", "loaded")
    before = metric(proxy, "llm_pool_output_tokens_total", model="sim")
    conn = httpc.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**CHAT, "max_tokens": 10_000, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    got = 0
    while got < 5:
        line = resp.readline()
        got += line.startswith(b"data: ")
    # The worker holds the send to the replica: the controller leased it and relays nothing itself.
    leased = [w for w in workers_of(proxy) if w["leases"] == 1]
    assert len(leased) == 1 and leased[0]["requests"] >= 1   # its stream (and perhaps this very look)
    assert proxy.processes()[0]["requests"] >= 1
    conn.close()   # the client leaves mid-stream
    wait_for(lambda: active(proxy) == 0, what="the slot freed once the client left")
    charged = wait_for(lambda: (m := metric(proxy, "llm_pool_output_tokens_total", model="sim")) > before and m)
    assert charged - before >= got   # at least every token that went out, counted from the worker's report
    assert all(w["leases"] == 0 for w in workers_of(proxy))

    # A translated stream is relayed by the controller through the worker: leaving it frees the slot too.
    conn = httpc.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    conn.request("POST", "/v1/responses", body=json.dumps({"model": "sim", "input": "hi", "stream": True,
                                                           "decoding": {"max_tokens": 10_000}}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"event: ")
    wait_for(lambda: active(proxy) == 1, what="the translated stream running")
    conn.close()
    wait_for(lambda: active(proxy) == 0, what="the slot freed once the client left the translated stream")


def test_weights_2_to_1_hold_across_two_workers(start_proxy) -> None:
    """One slot, two keys that always have requests waiting, weights 2:1: each worker passes its
    clients' requests on, and the controller's one fair queue serves them 2:1."""
    proxy = start_proxy({"sim": sim_model(target_inflight=1, sim={"max_seqs": 1, "decode_tokens_per_s": 1000,
                                                                    "ttft_ms": 1})},
                        engine={"fairness": {"weights": {"gold": 2}}}, workers=2)
    proxy.wait_state("sim", "loaded")
    done: list[tuple[float, str]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(key: str) -> None:
        conn = httpc.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
        body = json.dumps({**CHAT, "max_tokens": 3, "fairness_key": key})
        while not stop.is_set():
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
            with lock:
                done.append((time.monotonic(), key))
        conn.close()

    # Four connections a key: with the kernel's spread of connections over the workers' accepts,
    # each key sends through both workers.
    threads = [threading.Thread(target=client, args=(key,), daemon=True) for key in ("gold", "silver") for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(done) >= 40, what="both keys backlogged")
    start = len(done)
    wait_for(lambda: len(done) >= start + 300, what="300 requests under contention")
    window = done[start:start + 300]
    stop.set()
    for thread in threads:
        thread.join(60)
    gold = sum(key == "gold" for _t, key in window) / len(window)
    print(f"\ngold's share with weights 2:1 through 2 workers: {gold:.3f} (goal 0.667 +- 0.03)")
    assert abs(gold - 2 / 3) <= 0.03
    served = {w["index"]: w["requests"] for w in workers_of(proxy)}
    assert set(served) == {0, 1}


def test_a_worker_killed_under_load_costs_only_its_requests_and_another_starts(start_proxy) -> None:
    proxy = start_proxy({"sim": sim_model(sim={"max_seqs": 8, "decode_tokens_per_s": 200, "ttft_ms": 1})},
                        workers=2)
    proxy.wait_state("sim", "loaded")
    victim = workers_of(proxy)[0]
    outcomes: list[int | str] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            # A new connection each time: the kernel gives it to a worker that is alive.
            conn = httpc.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
            try:
                conn.request("POST", "/v1/chat/completions", body=json.dumps({**CHAT, "max_tokens": 20}),
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                outcomes.append(resp.status)
            except (OSError, httpc.HTTPException) as exc:
                outcomes.append(type(exc).__name__)
            finally:
                conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(outcomes) >= 40, what="load before the kill")
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = len(outcomes)
    replaced = wait_for(lambda: (w := workers_of(proxy)[0])["pid"] != victim["pid"] and w["state"] == "running" and w,
                        what="another worker in its place")
    wait_for(lambda: len(outcomes) >= killed_at + 100, what="100 requests after the kill")
    stop.set()
    for thread in threads:
        thread.join(60)
    failed = [o for o in outcomes if o != 200]
    print(f"\nworker killed under 4 clients: {len(outcomes)} requests, {len(failed)} failed: {failed}")
    assert len(failed) <= 4   # at most the requests the dead worker had in flight, one a client
    assert outcomes[-50:] == [200] * 50
    assert replaced["restarts"] == 1 and pid_alive(replaced["pid"]) and not pid_alive(victim["pid"])
    proxy.seen_pids.add(replaced["pid"])
    wait_for(lambda: active(proxy) == 0, what="the dead worker's slots released")
    status, _, events = http("GET", proxy.url + "/v1/admin/events?kind=worker")
    assert status == 200 and [e["reason"] for e in events["data"]] == ["exited"]
    assert f"pid {victim['pid']}" in events["data"][0]["message"] and "signal 9" in events["data"][0]["message"]


def test_a_stop_ends_the_workers_by_pid_after_their_requests(start_proxy) -> None:
    proxy = start_proxy({"sim": sim_model(sim={"max_seqs": 2, "decode_tokens_per_s": 100, "ttft_ms": 1})},
                        workers=2)
    proxy.wait_state("sim", "loaded")
    pids = [w["pid"] for w in workers_of(proxy)]
    answer: list[Any] = []
    thread = threading.Thread(target=lambda: answer.append(
        http("POST", proxy.url + "/v1/chat/completions", {**CHAT, "max_tokens": 100, "stream": True})), daemon=True)
    thread.start()
    wait_for(lambda: active(proxy) == 1, what="a stream in flight")
    proxy.stop()
    thread.join(60)
    status, _, raw = answer[0]
    assert status == 200 and stream_events(raw)[-1] == "[DONE]"   # the drain let it finish
    assert not any(pid_alive(pid) for pid in pids)


def test_a_controller_that_dies_leaves_its_workers_to_finish_their_streams_and_exit(start_proxy) -> None:
    """The controller's death is a reload's case (docs/workers.md): what the workers relay goes on
    to its end, and then they exit; a new `serve` adopts the replicas, as after any restart."""
    proxy = start_proxy({"sim": sim_model(sim={"max_seqs": 2, "decode_tokens_per_s": 100, "ttft_ms": 1})},
                        workers=2)
    model = proxy.wait_state("sim", "loaded")
    proxy.seen_pids.update(r["pid"] for r in model["replicas"])   # for the cleanup: no controller stops them now
    pids = [w["pid"] for w in workers_of(proxy)]
    conn = httpc.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    # 500 tokens at 100 a second: still running when the controller dies.
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**CHAT, "max_tokens": 500, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    wait_for(lambda: any(w["leases"] == 1 for w in workers_of(proxy)), what="the stream leased to a worker")
    assert proxy.proc is not None
    proxy.proc.kill()
    proxy.proc.wait(30)
    events = stream_events(resp.read())
    conn.close()
    assert events[-1] == "[DONE]" and len(events) >= 450   # the rest of it, relayed by the worker alone
    wait_for(lambda: not any(pid_alive(pid) for pid in pids), what="the workers to exit")
    # supervisord and the replicas ran on without it; a new serve adopts them (and the cleanup stops them).
    proxy.start()
    adopted = proxy.wait_state("sim", "loaded")
    assert [r["pid"] for r in adopted["replicas"]] == [r["pid"] for r in model["replicas"]]


def test_with_an_admin_listener_the_controller_serves_it_and_the_workers_the_public_port(start_proxy) -> None:
    admin_port = free_port()
    proxy = start_proxy({"sim": sim_model()}, workers=2, admin_host="127.0.0.1", admin_port=admin_port)
    proxy.wait_state("sim", "loaded")
    admin = proxy.admin_url
    assert admin == f"http://127.0.0.1:{admin_port}"
    assert [r["role"] for r in proxy.processes()] == ["controller", "worker", "worker"]
    assert http("GET", proxy.url + "/v1/admin/models")[0] == 404   # through a worker: still not the admin's port
    status, _, body = http("POST", proxy.url + "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200
    assert http("POST", admin + "/v1/chat/completions", CHAT)[0] == 404   # and the data plane is not the admin's

