"""What a client sees while a model loads, unloads, or loses its replica mid-stream: 503 with
Retry-After, a drained request that still ends 200, and an `event: error` before the stream ends.
Real `llm-pool serve` and supervisord; the simulated engine (slow on purpose, so a request is still
running while the test acts) and a llama-server held back by a gate file."""
from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from typing import Any

import pytest

from helpers import ProxyProcess, http, wait_for

pytestmark = pytest.mark.integration

# 100 tokens at 20 a second: a request runs for about 5 s, far longer than the few HTTP calls the
# tests make while it runs; each test waits for events, never for time.
SLOW_SIM = {"backend": "sim", "enabled": True, "target_inflight": 2, "sim": {"decode_tokens_per_s": 20}}
LONG = 100


def open_stream(proxy: ProxyProcess, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(proxy.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=120)


def read_until(resp: Any, prefix: bytes) -> None:
    while True:
        line = resp.readline()
        assert line, f"stream ended before a line starting {prefix!r}"
        if line.startswith(prefix):
            return


def in_background(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(value=fn()), daemon=True)
    thread.start()
    return thread, result


def test_graceful_unload_finishes_the_running_request_and_turns_new_ones_away(start_proxy) -> None:
    proxy = start_proxy({"slow": SLOW_SIM})
    proxy.wait_state("slow", "loaded")
    with open_stream(proxy, "/v1/chat/completions",
                     {"model": "slow", "messages": [{"role": "user", "content": "go"}], "max_tokens": LONG}) as resp:
        read_until(resp, b"data: ")           # the request is running
        unload, result = in_background(lambda: http("POST", proxy.url + "/v1/admin/models/slow/unload"))
        wait_for(lambda: proxy.admin_model("slow")["state"] == "unloading", what="the unload to begin")

        status, headers, body = http("POST", proxy.url + "/v1/chat/completions",
                                     body={"model": "slow", "messages": [{"role": "user", "content": "x"}]})
        assert (status, body["error"]["code"]) == (503, "model_unloading")
        assert int(headers["Retry-After"]) >= 1

        assert resp.status == 200
        rest = resp.read()                    # the running request is let finish
    chunks = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith(b"data: {")]
    assert rest.rstrip().endswith(b"data: [DONE]")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    unload.join(60)
    status, _, body = result["value"]
    assert status == 200 and body["state"] == "unloaded"


def test_requests_during_a_load_get_503_model_loading(start_proxy, llama_model, llama_server_bin, tmp_path) -> None:
    gate = tmp_path / "go"
    held = tmp_path / "held-llama-server"
    # A llama-server that starts only once the test opens the gate: the load is under way until then.
    held.write_text(f"#!/bin/sh\nwhile [ ! -e {gate} ]; do sleep 0.05; done\nexec {llama_server_bin} \"$@\"\n")
    held.chmod(0o755)
    proxy = start_proxy({"tiny": llama_model(enabled=False, llama_server_binary=str(held))})
    load, result = in_background(lambda: http("POST", proxy.url + "/v1/admin/models/tiny/load"))
    wait_for(lambda: proxy.admin_model("tiny")["state"] == "loading", what="the load to begin")

    for path, body in (("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/responses", {"model": "tiny", "input": "x"})):
        status, headers, answer = http("POST", proxy.url + path, body=body)
        assert (status, answer["error"]["code"]) == (503, "model_loading"), answer
        assert int(headers["Retry-After"]) >= 1

    gate.touch()
    load.join(120)
    status, _, body = result["value"]
    assert status == 200 and body["state"] == "loaded", body
    proxy.seen_pids.add(body["replicas"][0]["pid"])
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions",
                             body={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                   "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path, body, first", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}], "max_tokens": LONG}, b"data: "),
    ("/v1/responses", {"input": "go", "decoding": {"max_tokens": LONG}}, b"event: response.output_text.delta"),
])
def test_a_replica_dying_mid_stream_sends_an_error_event_before_the_end(start_proxy, path: str, body: dict[str, Any],
                                                                        first: bytes) -> None:
    proxy = start_proxy({"slow": SLOW_SIM})
    pid = proxy.wait_state("slow", "loaded")["replicas"][0]["pid"]
    with open_stream(proxy, path, {"model": "slow", **body}) as resp:
        read_until(resp, first)
        os.kill(pid, signal.SIGKILL)
        rest = resp.read()
    events = [block.strip() for block in rest.decode().split("\n\n") if block.strip()]
    assert events[-1].startswith("event: error\n"), events[-3:]
    error = json.loads(events[-1].split("data: ", 1)[1])
    assert error["error"]["type"] and error["error"]["message"]
    assert b"[DONE]" not in rest and b"response.completed" not in rest
    wait_for(lambda: proxy.admin_model("slow")["replicas"][0]["state"] == "ready", what="the replica to come back")
