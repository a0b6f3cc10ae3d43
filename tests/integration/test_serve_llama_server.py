"""End to end: real `llm-pool serve`, real supervisord, real llama-server on the tiny GGUF, the
official openai client."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from helpers import ProxyProcess, http, pid_alive, supervisord_shows_running, wait_for

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "Hello there, tiny model."}]


def client(proxy: ProxyProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)


def assert_answers(proxy: ProxyProcess, model: str = "tiny") -> None:
    """A real answer: the tokens asked for, from the model asked, as text (random weights may emit
    U+FFFD, never nothing)."""
    reply = client(proxy).chat.completions.create(model=model, messages=CHAT, max_tokens=8,
                                                  extra_body={"ignore_eos": True})
    assert reply.model == model and reply.usage.completion_tokens == 8
    content = reply.choices[0].message.content
    assert isinstance(content, str) and content.strip()
    assert reply.choices[0].finish_reason == "length"


def replica_metric(replica: dict[str, Any], name: str) -> float:
    """A counter from one llama-server's own /metrics, read straight from the replica."""
    with urllib.request.urlopen(f"http://127.0.0.1:{replica['port']}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(f"llamacpp:{name} "):
                return float(line.split()[1])
    raise AssertionError(f"llamacpp:{name} not in the replica's metrics")


def test_chat_non_streamed_and_streamed(start_proxy, llama_model) -> None:
    proxy = start_proxy({"tiny": llama_model()})
    proxy.wait_state("tiny", "loaded")
    oai = client(proxy)

    reply = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0)
    assert reply.model == "tiny"
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0

    chunks = list(oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=32, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) >= 16  # one event per token, not one blob at the end
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)

    assert [m.id for m in oai.models.list().data] == ["tiny"]
    supervisord_shows_running(lambda: subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c",
                                                      str(proxy.supervisord_conf), "status"],
                                                     capture_output=True, text=True, timeout=30).stdout,
                              proxy.admin_model("tiny")["replicas"][0]["program"])


def test_stream_chunks_arrive_while_the_backend_is_still_generating(start_proxy, llama_model) -> None:
    # --context-shift: the answer goes on past its slot's context (2,048 tokens), which a busy
    # machine's test could see end before it looked.
    proxy = start_proxy({"tiny": llama_model(llama_server_extra_args=["--context-shift"])})
    replica = proxy.wait_state("tiny", "loaded")["replicas"][0]

    def processing() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{replica['port']}/slots", timeout=10) as slots:
            return any(s["is_processing"] for s in json.load(slots))

    body = {"model": "tiny", "messages": CHAT, "max_tokens": 10 ** 6, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        first = resp.readline()
        assert first.startswith(b"data: ")
        # The first token is in our hands; the replica must still be busy with the rest.
        assert processing()
        for _ in range(200):   # and the next ones come as they are made
            assert resp.readline()
    # The client left: the proxy closes the replica's connection, and llama-server stops.
    wait_for(lambda: not processing(), timeout=60, what="llama-server to stop the abandoned answer")


def test_load_then_unload_ends_the_process(start_proxy, llama_model) -> None:
    proxy = start_proxy({"tiny": llama_model(enabled=False)})
    assert proxy.admin_model("tiny")["state"] == "unloaded"
    status, _, body = http("POST", proxy.url + "/v1/admin/models/tiny/load")
    assert status == 200, body
    assert body["state"] == "loaded" and body["replicas"][0]["state"] == "ready"
    pid = body["replicas"][0]["pid"]
    proxy.seen_pids.add(pid)
    assert pid_alive(pid)
    assert [m.id for m in client(proxy).models.list().data] == ["tiny"]

    status, _, body = http("POST", proxy.url + "/v1/admin/models/tiny/unload")
    assert status == 200, body
    assert body["state"] == "unloaded" and body["replicas"] == []
    assert not pid_alive(pid)
    assert client(proxy).models.list().data == []
    status, _, body = http("POST", proxy.url + "/v1/admin/models/tiny/unload")
    assert (status, body["error"]["code"]) == (409, "model_not_loaded")


def test_load_of_a_server_that_exits_fails_with_its_log(start_proxy, llama_model, tmp_path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but not really")
    proxy = start_proxy({"broken": llama_model(model_path=str(broken), enabled=False)})
    status, _, body = http("POST", proxy.url + "/v1/admin/models/broken/load")
    assert status == 502
    assert body["error"]["code"] == "model_load_failed"
    assert "log tail" in body["error"]["message"]
    model = proxy.admin_model("broken")
    assert model["state"] == "failed" and model["replicas"] == []


def test_sigkill_costs_one_restart_and_service_resumes(start_proxy, llama_model) -> None:
    proxy = start_proxy({"tiny": llama_model()})
    old_pid = proxy.wait_state("tiny", "loaded")["replicas"][0]["pid"]
    os.kill(old_pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        replica = proxy.admin_model("tiny")["replicas"][0]
        return replica if replica["state"] == "ready" and replica["pid"] not in (None, old_pid) else None

    replica = wait_for(restarted, what="the killed replica to be restarted and healthy")
    assert replica["restarts"] >= 1
    assert_answers(proxy)


def test_restarted_proxy_adopts_running_replicas_and_drops_unconfigured_ones(start_proxy, llama_model) -> None:
    proxy = start_proxy({"tiny": llama_model(), "idle": llama_model(enabled=False), "gone": llama_model()},
                        keep_models=True)
    pid = proxy.wait_state("tiny", "loaded")["replicas"][0]["pid"]
    gone = proxy.wait_state("gone", "loaded")["replicas"][0]["pid"]
    status, _, body = http("POST", proxy.url + "/v1/admin/models/idle/load")
    assert status == 200, body
    idle = body["replicas"][0]["pid"]
    proxy.seen_pids.add(idle)
    proxy.stop()
    assert all(pid_alive(p) for p in (pid, gone, idle))  # --keep-models: the models outlive the proxy

    # A new proxy process on the same state dir, with `gone` removed from the config.
    del proxy.config["engine"]["models"]["gone"]
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.start()
    assert proxy.wait_state("tiny", "loaded")["replicas"][0]["pid"] == pid
    assert proxy.wait_state("idle", "loaded")["replicas"][0]["pid"] == idle  # admin-loaded: adopted too
    wait_for(lambda: not pid_alive(gone), what="the unconfigured model's process to be stopped")
    assert_answers(proxy)
    assert_answers(proxy, "idle")


def test_two_replicas_both_receive_traffic(start_proxy, llama_model) -> None:
    proxy = start_proxy({"tiny": llama_model(replicas=2, replica_max=2)})
    model = proxy.wait_replicas_ready("tiny", 2)
    oai = client(proxy)
    # Six conversations: under the default routing (affinity) one conversation stays on its
    # replica, and different ones spread (these six have homes on both).
    for i in range(6):
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Conversation {i}: say hello"}],
                                    max_tokens=4)
    served = [replica_metric(r, "prompt_tokens_total") for r in model["replicas"]]
    assert all(n > 0 for n in served), served


def test_supervisorctl_stop_is_respected_and_start_rejoins(start_proxy, llama_model) -> None:
    proxy = start_proxy({"tiny": llama_model(replicas=2, replica_max=2)})
    model = proxy.wait_replicas_ready("tiny", 2)
    r0, r1 = model["replicas"]
    out = proxy.supervisorctl("stop", r1["program"])
    assert "stopped" in out.stdout, out
    oai = client(proxy)
    # Routed away at once: every request right after the stop succeeds, on the other replica.
    before = replica_metric(r0, "prompt_tokens_total")
    for _ in range(6):
        oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    assert replica_metric(r0, "prompt_tokens_total") > before
    stopped = wait_for(lambda: proxy.admin_model("tiny")["replicas"][1]["state"] == "stopped",
                       what="the proxy to mark the replica stopped")
    assert stopped
    assert "STOPPED" in proxy.supervisorctl("status", r1["program"]).stdout  # not restarted by the pool

    out = proxy.supervisorctl("start", r1["program"])
    assert "started" in out.stdout, out
    model = proxy.wait_replicas_ready("tiny", 2)
    r1 = model["replicas"][1]
    proxy.seen_pids.add(r1["pid"])
    for _ in range(6):
        oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    assert replica_metric(r1, "prompt_tokens_total") > 0


def test_bad_requests_get_the_openai_error_envelope(start_proxy, llama_model) -> None:
    proxy = start_proxy({"tiny": llama_model(), "idle": llama_model(enabled=False)}, max_body_bytes=4096)
    proxy.wait_state("tiny", "loaded")
    url = proxy.url + "/v1/chat/completions"
    cases = [
        (dict(raw=b"{not json"), 400, "invalid_json"),
        (dict(body={"messages": CHAT}), 400, "missing_model"),
        (dict(body={"model": "nope", "messages": CHAT}), 404, "model_not_found"),
        (dict(body={"model": "idle", "messages": CHAT}), 409, "model_not_loaded"),
        (dict(body={"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}), 413,
         "request_too_large"),
    ]
    for kwargs, status, code in cases:
        got, _, body = http("POST", url, **kwargs)
        assert (got, body["error"]["code"]) == (status, code), body
        assert set(body["error"]) == {"message", "type", "code", "param"}
    status, _, body = http("POST", proxy.url + "/v1/admin/models/nope/load")
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    status, _, body = http("POST", proxy.url + "/v1/admin/models/idle/load", body={"overrides": {"model_path": "/x"}})
    assert (status, body["error"]["code"]) == (400, "invalid_load_request")
    status, _, body = http("POST", proxy.url + "/v1/admin/models/idle/load", body={"replicas": 5})
    assert (status, body["error"]["code"]) == (400, "invalid_load_request")
    assert proxy.admin_model("idle")["state"] == "unloaded"  # nothing changed


def test_a_second_serve_on_the_same_state_dir_or_port_fails_and_touches_nothing(start_proxy, llama_model) -> None:
    proxy = start_proxy({"tiny": llama_model()})
    pid = proxy.wait_state("tiny", "loaded")["replicas"][0]["pid"]
    argv = [sys.executable, "-m", "proxy.cli", "--config", str(proxy.config_path), "serve"]
    same_dir = subprocess.run(argv + ["--port", "0"], capture_output=True, text=True, timeout=60)
    assert same_dir.returncode == 1 and "is in use by llm-pool serve" in same_dir.stderr

    other = ProxyProcess({"tiny": llama_model()})
    other.config["service"]["port"] = proxy.port
    other.config_path.write_text(yaml.safe_dump(other.config))
    same_port = subprocess.run([sys.executable, "-m", "proxy.cli", "--config", str(other.config_path), "serve"],
                               capture_output=True, text=True, timeout=60)
    assert same_port.returncode == 1 and f"cannot listen on 127.0.0.1:{proxy.port}" in same_port.stderr
    assert not (other.state_dir / "supervisord.pid").exists()  # it started nothing

    assert proxy.admin_model("tiny")["replicas"][0]["pid"] == pid and pid_alive(pid)


def test_load_takes_a_replica_count_and_fails_a_server_that_never_gets_healthy(start_proxy, llama_model,
                                                                               tmp_path) -> None:
    silent = tmp_path / "silent-server"
    silent.write_text("#!/bin/sh\necho 'loading forever'\nexec sleep 300\n")
    silent.chmod(0o755)
    proxy = start_proxy({"idle": llama_model(enabled=False, replica_max=2),
                         "stuck": llama_model(enabled=False, llama_server_binary=str(silent),
                                              llama_server_start_timeout_s=2)})
    status, _, body = http("POST", proxy.url + "/v1/admin/models/idle/load", body={"replicas": 2})
    assert status == 200, body
    assert [r["state"] for r in body["replicas"]] == ["ready", "ready"]
    proxy.seen_pids.update(r["pid"] for r in body["replicas"])

    status, _, body = http("POST", proxy.url + "/v1/admin/models/stuck/load")
    assert (status, body["error"]["code"]) == (502, "model_load_failed")
    assert "not healthy within 2s" in body["error"]["message"] and "loading forever" in body["error"]["message"]
    assert proxy.admin_model("stuck")["state"] == "failed"


async def test_streams_one_after_another_and_many_at_once_all_arrive_whole(start_proxy, llama_model) -> None:
    # llama-server closes the connection after every stream although it answers Keep-Alive: the
    # proxy must never hand such a connection to the next request (issue 16: 14-16% of streams
    # failed at 16 at once, several percent one at a time).
    proxy = start_proxy({"tiny": llama_model(target_inflight=4)})
    proxy.wait_state("tiny", "loaded")
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 16, "ignore_eos": True}

    async def ask(session: aiohttp.ClientSession, stream: bool = True) -> str | None:
        """None when the answer arrived whole; else what came instead."""
        async with session.post(proxy.url + "/v1/chat/completions", json={**body, "stream": stream}) as resp:
            raw = await resp.read()
        whole = raw.rstrip().endswith(b"data: [DONE]") if stream else b'"choices"' in raw
        return None if resp.status == 200 and whole else f"{resp.status}: {raw[-200:]!r}"

    async with aiohttp.ClientSession() as session:
        outcomes = [await ask(session) for _ in range(40)]
        for _ in range(4):
            outcomes += await asyncio.gather(*(ask(session) for _ in range(16)))
        # Non-streamed answers among the streams, on whatever connections the proxy keeps.
        for _ in range(8):
            outcomes += await asyncio.gather(ask(session), ask(session), ask(session, stream=False))
    failed = [o for o in outcomes if o is not None]
    assert not failed, f"{len(failed)} of {len(outcomes)} failed: {failed[:3]}"
    replica = proxy.admin_model("tiny")["replicas"][0]
    assert replica["state"] == "ready" and replica["consecutive_failures"] == 0
