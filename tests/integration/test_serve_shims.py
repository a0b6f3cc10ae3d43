"""CT2 and llama-cpp-python behind their shims, end to end: real `llm-pool serve`, real supervisord,
the real engines on tiny random-weight models, the official openai client and /v1/responses.

Each backend is the seed's example with its path pointed at a tiny model (and CT2 on the CPU).
"""
from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any, Callable

import openai
import pytest
import yaml

from helpers import ProxyProcess, http, pid_alive, supervisord_shows_running, wait_for
from proxy.config.files import REPO_ROOT

pytestmark = pytest.mark.integration

SEED = yaml.safe_load((REPO_ROOT / "conf" / "examples" / "in-process.yaml").read_text())["engine"]["models"]
CHAT = [{"role": "user", "content": "Hello there, tiny model."}]


@pytest.fixture(params=["ct2", "llama_cpp"])
def shim_model(request: pytest.FixtureRequest, tiny_ct2: dict[str, Path], tiny_gguf: Path) -> Callable[..., dict]:
    """The seed example of one backend on its tiny model; keyword arguments override fields."""
    if request.param == "ct2":
        base = {**SEED["some-ct2-model"], "model_path": str(tiny_ct2["decoder"]), "device": "cpu",
                "target_inflight": 2}
    else:
        request.getfixturevalue("llama_cpp_python")
        base = {**SEED["some-gguf-model"], "model_path": str(tiny_gguf)}

    def make(**fields: Any) -> dict[str, Any]:
        return {**base, "enabled": True, **fields}
    return make


def client(proxy: ProxyProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)


def replica_metric(replica: dict[str, Any], name: str) -> float:
    """A value from the shim's own /metrics, read straight from the replica."""
    with urllib.request.urlopen(f"http://127.0.0.1:{replica['port']}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the replica's metrics")


def test_seed_example_loads_and_serves_both_apis(start_proxy, shim_model) -> None:
    proxy = start_proxy({"tiny": shim_model()})
    replica = proxy.wait_state("tiny", "loaded")["replicas"][0]
    oai = client(proxy)

    reply = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    assert reply.model == "tiny" and reply.usage.completion_tokens > 0
    chunks = list(oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=32, stream=True,
                                              extra_body={"ignore_eos": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) >= 8  # streamed as made, not one blob at the end
    completion = oai.completions.create(model="tiny", prompt="The weather", max_tokens=4, temperature=0)
    assert completion.usage.completion_tokens >= 1

    status, _, body = http("POST", proxy.url + "/v1/responses",
                           body={"model": "tiny", "input": "The weather is pleasant today.",
                                 "instructions": "Translate to Dutch.",
                                 "decoding": {"max_tokens": 8, "temperature": 0}})
    assert status == 200, body
    assert body["metrics"]["engine_output_tokens"] >= 1
    req = urllib.request.Request(proxy.url + "/v1/responses", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", "input": "Hello", "stream": True,
                                                  "decoding": {"max_tokens": 8, "temperature": 0}}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = resp.read().decode()
    assert "event: response.output_text.delta" in events and "event: response.completed" in events

    assert [m.id for m in oai.models.list().data] == ["tiny"]
    supervisord_shows_running(lambda: proxy.supervisorctl("status").stdout, replica["program"])
    assert replica_metric(replica, "vllm:request_success_total") >= 4


def test_a_client_that_leaves_stops_the_engine(start_proxy, shim_model) -> None:
    proxy = start_proxy({"tiny": shim_model()})
    replica = proxy.wait_state("tiny", "loaded")["replicas"][0]
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.readline().startswith(b"data: ")
    # The proxy closed its upstream request and the shim stopped its engine there, long before 3000.
    wait_for(lambda: replica_metric(replica, "llm_pool_shim:requests_cancelled_total") == 1,
             what="the shim to stop the generation")
    assert replica_metric(replica, "vllm:num_requests_running") == 0
    made = replica_metric(replica, "vllm:generation_tokens_total")
    assert made < 3000
    assert wait_for(lambda: proxy.admin_model("tiny")["active"] == 0, what="the proxy to free the slot")


def test_unload_ends_the_process_and_a_crash_costs_one_restart(start_proxy, shim_model) -> None:
    proxy = start_proxy({"tiny": shim_model()})
    old_pid = proxy.wait_state("tiny", "loaded")["replicas"][0]["pid"]
    os.kill(old_pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        replica = proxy.admin_model("tiny")["replicas"][0]
        return replica if replica["state"] == "ready" and replica["pid"] not in (None, old_pid) else None

    replica = wait_for(restarted, what="the killed shim to be restarted and healthy")
    assert replica["restarts"] >= 1
    assert client(proxy).chat.completions.create(model="tiny", messages=CHAT, max_tokens=4).choices

    status, _, body = http("POST", proxy.url + "/v1/admin/models/tiny/unload")
    assert status == 200 and body["state"] == "unloaded", body
    assert not pid_alive(replica["pid"])
    assert client(proxy).models.list().data == []
