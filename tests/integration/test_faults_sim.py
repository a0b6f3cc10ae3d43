"""Reliability under faults, through real supervisord and simulated engines that misbehave on purpose
(shims/sim.py fault modes): timeouts, garbage streams, backend errors, drops, queue bound, health
checks and ejection, image URLs and poison bodies."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import urllib.request
from typing import Any, Iterator

import aiohttp
import pytest
import yaml

from helpers import ProxyProcess, free_port_range, http, wait_for

pytestmark = pytest.mark.integration

FAST = {"first_byte_timeout_s": 1, "stream_idle_timeout_s": 1}


def sim(replicas: int = 1, target: int = 2, modalities: tuple[str, ...] = ("text",), options: Any = None,
        **faults: Any) -> dict[str, Any]:
    return {"backend": "sim", "enabled": False, "replicas": replicas, "replica_max": max(1, replicas),
            "target_inflight": target, "modalities": list(modalities),
            "sim": {"max_seqs": 8, "decode_tokens_per_s": 200, "ttft_ms": 1, **faults}, **(options or {})}


MODELS = {
    "hang": sim(hang_before_headers=True, options=FAST),
    "stall": sim(stall_after_tokens=2, options=FAST),
    "malformed": sim(garbage="malformed"),
    "no-done": sim(garbage="no_done"),
    "truncated": sim(garbage="truncated"),
    "html": sim(error_rate=1.0, error_body="html"),
    "busy": sim(error_rate=1.0, error_status=503),
    "big": sim(response_bytes=300_000),
    "drop": sim(replicas=2, drop_rate=1.0),
    "slow": sim(target=1, modalities=("text", "image"), decode_tokens_per_s=5),
    "doomed": sim(target=1, decode_tokens_per_s=5),
    "pair": sim(replicas=2),
    "flaky": sim(replicas=2, error_rate=1.0),
    "crash": sim(),
}


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def proxy(request: pytest.FixtureRequest) -> Iterator[ProxyProcess]:
    """Each fault with one process, and with two workers (docs/workers.md), where a worker makes
    the send and tells the controller what it met: the same answers, the same blame."""
    service = {"max_response_bytes": 100_000, "health_interval_s": 0.2, "health_timeout_s": 2,
               "eject_after_failures": 3, "eject_base_s": 60, "drain_timeout_s": 0, "workers": request.param}
    proc = ProxyProcess(MODELS, service=service, engine={"fairness": {"max_queue_wait_s": 1}})
    # 16 replicas, and room for the ports a replica may lose to another process while it starts.
    proc.config["supervisor"]["port_range"] = free_port_range(60)
    proc.config_path.write_text(yaml.safe_dump(proc.config))
    try:
        proc.start()
        for name in MODELS:
            load_all_replicas(proc, name)
        yield proc
    finally:
        survivors = proc.cleanup()
        assert not survivors, f"processes outlived their test and were killed: {survivors}"


def load_all_replicas(proxy: ProxyProcess, name: str) -> None:
    """Load one model at a time (a busy machine starts many at once slowly); once more if a replica
    lost its port to another process while it started."""
    for _attempt in range(3):
        status, _, body = http("POST", proxy.url + f"/v1/admin/models/{name}/load")
        if status == 200 and all(r["state"] == "ready" for r in proxy.admin_model(name)["replicas"]):
            return
        if proxy.admin_model(name)["state"] == "loaded":
            http("POST", proxy.url + f"/v1/admin/models/{name}/unload")
    raise AssertionError(f"{name} did not load with every replica ready: {proxy.admin_model(name)}")


def chat(model: str, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream,
            **extra}


def sse_events(text: str) -> list[tuple[str, Any]]:
    events = []
    for block in text.strip().split("\n\n"):
        name, data = "message", None
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
        if data is not None:
            events.append((name, json.loads(data) if data != "[DONE]" else data))
    return events


def stream(proxy: ProxyProcess, path: str, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(proxy.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, resp.read().decode()


def sim_counter(proxy: ProxyProcess, model: str, name: str, index: int | None = None) -> float:
    """A counter of the model's replicas, summed, or of replica `index` alone."""
    replicas = proxy.admin_model(model)["replicas"]
    total = 0.0
    for replica in replicas if index is None else [replicas[index]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{replica['port']}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def assert_clean_log(proxy: ProxyProcess) -> None:
    assert "Traceback" not in proxy.log_path.read_text()


# 1. Hung backends are timed out.

def test_a_backend_that_never_answers_is_a_504_and_frees_the_slot(proxy: ProxyProcess) -> None:
    for body in (chat("hang"), chat("hang", stream=True)):
        status, headers, answer = http("POST", proxy.url + "/v1/chat/completions", body)
        assert status == 504 and answer["error"]["code"] == "backend_timeout", answer
        assert "first_byte_timeout_s" in answer["error"]["message"]
    model = proxy.admin_model("hang")
    assert model["active"] == 0 and model["replicas"][0]["inflight"] == 0


def test_a_stream_that_stalls_ends_with_an_error_event_and_the_backend_stops(proxy: ProxyProcess) -> None:
    status, text = stream(proxy, "/v1/chat/completions", chat("stall", stream=True))
    assert status == 200
    name, data = sse_events(text)[-1]
    assert name == "error" and data["error"]["code"] == "backend_timeout"
    assert "stream_idle_timeout_s" in data["error"]["message"]
    status, text = stream(proxy, "/v1/responses", {"model": "stall", "input": "hi", "stream": True})
    events = sse_events(text)
    assert events[0][0] == "response.created" and events[-1][0] == "error"
    assert events[-1][1]["error"]["code"] == "backend_timeout"
    # The proxy closed the upstream connection: the sim's generation was cancelled.
    wait_for(lambda: sim_counter(proxy, "stall", "vllm:num_requests_running") == 0, what="the sim to stop")
    assert proxy.admin_model("stall")["active"] == 0
    # /metrics counts both by the code of their error event, though their status was 200.
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    for endpoint in ("/v1/chat/completions", "/v1/responses"):
        assert f'llm_pool_requests_total{{code="backend_timeout",endpoint="{endpoint}",key="other",model="stall",' \
               'status="200"} 1.0' in metrics


# 9. Garbage in /v1/responses streams.

@pytest.mark.parametrize("model, says", [("malformed", "malformed stream chunk"), ("no-done", "without [DONE]"),
                                         ("truncated", "malformed stream chunk")])
def test_a_broken_upstream_stream_is_an_error_event_never_completed(proxy: ProxyProcess, model: str,
                                                                   says: str) -> None:
    status, text = stream(proxy, "/v1/responses", {"model": model, "input": "hi", "stream": True})
    assert status == 200
    names = [name for name, _ in sse_events(text)]
    assert names[0] == "response.created" and names[-1] == "error"
    assert "response.completed" not in names
    assert says in sse_events(text)[-1][1]["error"]["message"]
    assert_clean_log(proxy)


# 14 and 13. Backend errors are OpenAI JSON; 503s carry Retry-After.

def test_an_html_error_page_becomes_an_openai_502(proxy: ProxyProcess) -> None:
    for path, body in (("/v1/chat/completions", chat("html")), ("/v1/responses", {"model": "html", "input": "hi"})):
        status, headers, answer = http("POST", proxy.url + path, body)
        assert status == 502 and headers["Content-Type"].startswith("application/json"), answer
        assert answer["error"]["code"] == "backend_error" and "500 Internal Server Error" in answer["error"]["message"]


def test_a_backend_503_passes_through_with_retry_after(proxy: ProxyProcess) -> None:
    for path, body in (("/v1/chat/completions", chat("busy")), ("/v1/responses", {"model": "busy", "input": "hi"})):
        status, headers, answer = http("POST", proxy.url + path, body)
        assert status == 503 and int(headers["Retry-After"]) >= 1, answer
        assert answer["error"]["message"] == "simulated error"


# 11. Non-streamed answers are bounded.

def test_an_answer_over_max_response_bytes_is_a_502(proxy: ProxyProcess) -> None:
    for path, body in (("/v1/chat/completions", chat("big")), ("/v1/responses", {"model": "big", "input": "hi"})):
        status, _, answer = http("POST", proxy.url + path, body)
        assert status == 502 and answer["error"]["code"] == "backend_response_too_large", answer


# 4. A request dropped after it was sent is not replayed (but for the one resend of a request
# dropped on a reused connection, which is how a connection the server had closed fails).

def test_a_dropped_request_is_not_replayed_and_keeps_its_replica_in_rotation(proxy: ProxyProcess) -> None:
    def received() -> list[float]:
        return [sim_counter(proxy, "drop", "llm_pool_sim_requests_received_total", index=i) for i in (0, 1)]
    before = received()
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat("drop"))
    assert status == 502 and answer["error"]["code"] == "backend_error", answer
    assert "dropped the request" in answer["error"]["message"]
    # One replica got it: once, or (when the proxy's connection to it was a kept-alive one, from
    # its health checks) once more on a new connection, which the sim dropped as well.
    assert sorted(after - was for after, was in zip(received(), before)) in ([0, 1], [0, 2])
    assert [r["state"] for r in proxy.admin_model("drop")["replicas"]] == ["ready", "ready"]


# 2. The queue wait is bounded; 13. queued requests failed by an unload get Retry-After.

async def test_a_queued_request_times_out_with_503_or_an_error_event(proxy: ProxyProcess) -> None:
    async with aiohttp.ClientSession() as session:
        holder = asyncio.create_task(session.post(proxy.url + "/v1/chat/completions",
                                                  json=chat("slow", max_tokens=10_000)))
        await asyncio.to_thread(wait_for, lambda: proxy.admin_model("slow")["active"] == 1, what="the slot taken")
        async with session.post(proxy.url + "/v1/chat/completions", json=chat("slow")) as resp:
            answer = await resp.json()
            assert resp.status == 503 and answer["error"]["code"] == "queue_timeout", answer
            assert int(resp.headers["Retry-After"]) >= 1
        async with session.post(proxy.url + "/v1/responses",
                                json={"model": "slow", "input": "hi", "stream": True}) as resp:
            events = sse_events(await resp.text())
        assert [n for n, _ in events] == ["response.created", "error"]
        assert events[-1][1]["error"]["code"] == "queue_timeout"
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
    await asyncio.to_thread(wait_for, lambda: proxy.admin_model("slow")["waiting"] == 0, what="an empty queue")


async def test_requests_queued_when_a_model_is_unloaded_get_503_with_retry_after(proxy: ProxyProcess) -> None:
    async with aiohttp.ClientSession() as session:
        holder = asyncio.create_task(session.post(proxy.url + "/v1/chat/completions",
                                                  json=chat("doomed", max_tokens=10_000)))
        await asyncio.to_thread(wait_for, lambda: proxy.admin_model("doomed")["active"] == 1, what="the slot taken")
        queued = asyncio.create_task(session.post(proxy.url + "/v1/chat/completions", json=chat("doomed")))
        await asyncio.to_thread(wait_for, lambda: proxy.admin_model("doomed")["waiting"] == 1, what="one queued")
        status, _, _ = await asyncio.to_thread(http, "POST", proxy.url + "/v1/admin/models/doomed/unload")
        assert status == 200
        resp = await queued
        assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1
        assert (await resp.json())["error"]["code"] == "model_unloading"
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)


# 3. A frozen replica leaves READY and comes back; a failing one is ejected, never the last.

def test_a_frozen_replica_leaves_rotation_until_it_answers_again(proxy: ProxyProcess) -> None:
    frozen = proxy.admin_model("pair")["replicas"][0]
    os.kill(frozen["pid"], signal.SIGSTOP)
    try:
        wait_for(lambda: proxy.admin_model("pair")["replicas"][0]["state"] == "unhealthy", what="unhealthy")
        assert "health check failed" in proxy.admin_model("pair")["replicas"][0]["last_error"]
        for _ in range(4):
            status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat("pair"))
            assert status == 200, answer
    finally:
        os.kill(frozen["pid"], signal.SIGCONT)
    wait_for(lambda: proxy.admin_model("pair")["replicas"][0]["state"] == "ready", what="ready again")


def test_a_replica_killed_by_sigkill_is_said_by_the_proxy_with_how_it_ended_and_what_supervisord_does(
        proxy: ProxyProcess) -> None:
    # Before: only supervisord's own log said so; the proxy's log and the events feed said nothing.
    (replica,) = proxy.admin_model("crash")["replicas"]
    os.kill(replica["pid"], signal.SIGKILL)

    def crashes() -> list[dict[str, Any]]:
        return http("GET", proxy.url + "/v1/admin/events?kind=crash&model=crash")[2]["data"]
    (event,) = wait_for(crashes, what="the crash event")
    assert (event["replica"], event["host"], event["reason"]) == (0, "local", "killed by SIGKILL"), event
    assert event["message"].startswith(f"model crash replica 0 (pid {replica['pid']}) killed by SIGKILL; "
                                       "supervisord restart"), event
    wait_for(lambda: (r := proxy.admin_model("crash")["replicas"][0])["state"] == "ready" and
             r["pid"] != replica["pid"], what="the restarted replica back in rotation")
    assert len(crashes()) == 1   # one crash, one event, however many passes saw it
    (line,) = [ln for ln in proxy.log_path.read_text().splitlines() if f"(pid {replica['pid']}) killed by" in ln]
    assert "WARNING" in line, line


def test_a_replica_failing_every_request_is_ejected_but_never_the_last(proxy: ProxyProcess) -> None:
    for _ in range(8):
        status, _, _ = http("POST", proxy.url + "/v1/chat/completions", chat("flaky"))
        assert status == 500
    replicas = proxy.admin_model("flaky")["replicas"]
    assert sorted(r["state"] for r in replicas) == ["ready", "unhealthy"]
    (ejected,) = [r for r in replicas if r["state"] == "unhealthy"]
    assert ejected["ejections"] == 1 and ejected["ejected_for_s"] > 0 and "ejected" in ejected["last_error"]
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert re.search(rf'llm_pool_replica_ejections_total\{{host="local",model="flaky",replica="{ejected["index"]}"\}} 1.0', metrics)


# 7. Image URLs; 10. poison bodies.

def test_image_urls_to_private_addresses_or_files_are_refused_on_both_apis(proxy: ProxyProcess) -> None:
    image = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}}
    body = {"model": "slow", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, image]}]}
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["code"] == "image_url_not_allowed", answer
    file_image = {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}
    status, _, answer = http("POST", proxy.url + "/v1/responses", {"model": "slow", "input": [file_image]})
    assert status == 400 and answer["error"]["code"] == "image_url_not_allowed", answer


def test_a_deeply_nested_body_is_a_400_not_a_500(proxy: ProxyProcess) -> None:
    raw = b'{"model": "pair", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/v1/chat/completions", "/v1/responses"):
        status, _, answer = http("POST", proxy.url + path, raw=raw)
        assert status == 400 and answer["error"]["code"] == "invalid_json", answer
    assert_clean_log(proxy)
