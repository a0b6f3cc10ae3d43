"""Lifecycle under faults, with real supervisord and real replica processes: unload always
finishes, ports come back, orphans of a dead supervisord are stopped, secrets stay with the proxy."""
from __future__ import annotations

import concurrent.futures
import http.client as http_client
import json
import os
import signal
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import ProxyProcess, free_port_range, http, pid_alive, wait_for

pytestmark = pytest.mark.integration


def sim_model(**fields: Any) -> dict[str, Any]:
    return {"backend": "sim", "target_inflight": 2, "enabled": True,
            "sim": {"max_seqs": 2, "decode_tokens_per_s": 200, "ttft_ms": 1}, **fields}


def start(proxies: list[ProxyProcess], models: dict[str, Any], ports: list[int] | None = None,
          **service: Any) -> ProxyProcess:
    proxy = ProxyProcess(models, service=service)
    if ports is not None:
        proxy.config["supervisor"]["port_range"] = ports
        proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxies.append(proxy)
    return proxy.start()


def chat(proxy: ProxyProcess, model: str = "sim", **fields: Any) -> tuple[int, Any]:
    status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                           {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                            **fields})
    return status, body


def test_unload_and_load_again_on_a_one_port_range(proxies) -> None:
    port = free_port_range(1)[0]
    proxy = start(proxies, {"sim": sim_model()}, ports=[port, port])
    for _ in range(2):
        model = proxy.wait_state("sim", "loaded")
        assert model["replicas"][0]["port"] == port
        # Requests and health probes leave connections that the replica's exit puts in TIME_WAIT.
        assert chat(proxy)[0] == 200
        status, _, body = http("POST", proxy.url + "/v1/admin/models/sim/unload")
        assert (status, body["state"]) == (200, "unloaded")
        status, _, body = http("POST", proxy.url + "/v1/admin/models/sim/load")
        assert status == 200, body


def _stream_until_killed(proxy: ProxyProcess, started: threading.Event) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000, "stream": True}
    req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.readline()
            started.set()
            while resp.readline():
                pass
    except OSError:
        pass
    finally:
        started.set()


def test_unload_while_a_replica_crashes_mid_stream_ends_unloaded(proxies) -> None:
    proxy = start(proxies, {"sim": sim_model()}, drain_timeout_s=60)
    model = proxy.wait_state("sim", "loaded")
    pid = model["replicas"][0]["pid"]
    started = threading.Event()
    stream = threading.Thread(target=_stream_until_killed, args=(proxy, started))
    stream.start()
    assert started.wait(60)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        unload = pool.submit(http, "POST", proxy.url + "/v1/admin/models/sim/unload")
        wait_for(lambda: proxy.admin_model("sim")["state"] == "unloading", what="the unload to start draining")
        os.kill(pid, signal.SIGKILL)     # the replica crashes mid-stream; supervisord restarts it
        status, _, body = unload.result(120)
    stream.join(60)
    assert (status, body.get("state")) == (200, "unloaded"), (body, proxy.log_path.read_text()[-3000:])
    assert not proxy.supervisorctl("status").stdout.strip()   # no program left running
    status, _, body = http("POST", proxy.url + "/v1/admin/models/sim/load")
    assert (status, body["state"]) == (200, "loaded"), body


def test_an_unload_whose_client_leaves_still_finishes(proxies) -> None:
    proxy = start(proxies, {"sim": sim_model()}, drain_timeout_s=3)
    proxy.wait_state("sim", "loaded")
    started = threading.Event()
    stream = threading.Thread(target=_stream_until_killed, args=(proxy, started))
    stream.start()
    assert started.wait(60)
    # The drain waits for the stream; the admin's client gives up long before.
    req = urllib.request.Request(proxy.url + "/v1/admin/models/sim/unload", data=b"", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(OSError):
        urllib.request.urlopen(req, timeout=0.5)
    model = proxy.wait_state("sim", "unloaded")
    assert model["replicas"] == [] and not proxy.supervisorctl("status").stdout.strip()
    stream.join(60)


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_model_servers_get_a_minimal_environment_without_the_proxys_secrets(proxies) -> None:
    proxy = ProxyProcess({"sim": sim_model(),
                          "remote": {"backend": "openai_remote", "remote_api_key_env": "LLM_POOL_TEST_PROVIDER_KEY",
                                     "remote_base_url": "http://127.0.0.1:9/v1", "remote_model": "m",
                                     "enabled": False}},
                         service={"admin_token_env": "LLM_POOL_TEST_ADMIN_TOKEN"})
    proxy.config["supervisor"]["pass_env"] = ["LLM_POOL_TEST_PASSED"]
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.env.update(LLM_POOL_TEST_ADMIN_TOKEN="admin-secret-4711", LLM_POOL_TEST_PROVIDER_KEY="provider-secret-4712",
                     LLM_POOL_TEST_UNRELATED="not-for-models", LLM_POOL_TEST_PASSED="for-models",
                     LC_ALL="C.UTF-8", PATH="/usr/bin:/bin")
    proxies.append(proxy)
    proxy.start()
    headers = {"Authorization": "Bearer admin-secret-4711"}
    status, _, body = http("GET", proxy.url + "/v1/admin/models", headers=headers)
    assert status == 200
    wait_for(lambda: any(m["state"] == "loaded" for m in http("GET", proxy.url + "/v1/admin/models",
                                                              headers=headers)[2]["data"]), what="sim loaded")
    (sim,) = [m for m in http("GET", proxy.url + "/v1/admin/models", headers=headers)[2]["data"] if m["id"] == "sim"]
    pid = sim["replicas"][0]["pid"]
    proxy.seen_pids.add(pid)
    supervisord = int((proxy.state_dir / "supervisord.pid").read_text())
    for environ in (_environ_of(pid), _environ_of(supervisord)):
        values = "\n".join(environ.values())
        assert "admin-secret-4711" not in values and "provider-secret-4712" not in values
        assert "LLM_POOL_TEST_UNRELATED" not in environ
        assert environ["PATH"] == "/usr/bin:/bin" and environ["LC_ALL"] == "C.UTF-8"
        assert environ["LLM_POOL_TEST_PASSED"] == "for-models"
    # The shim's own setting, from its program's environment=.
    assert _environ_of(pid)["PYTHONPATH"] == str(Path(__file__).resolve().parents[2])


def test_a_serve_stops_the_replicas_a_killed_supervisord_left_running(proxies) -> None:
    proxy = start(proxies, {"sim": sim_model()})
    before = proxy.wait_state("sim", "loaded")["replicas"][0]
    supervisord = int((proxy.state_dir / "supervisord.pid").read_text())
    # Both killed (an OOM kill of the whole service, say): no proxy is left to start supervisord
    # again (a running one does: the test below).
    assert proxy.proc is not None
    proxy.proc.kill()
    proxy.proc.wait()
    os.kill(supervisord, signal.SIGKILL)
    wait_for(lambda: not pid_alive(supervisord), what="supervisord to die")
    assert pid_alive(before["pid"])            # its model server lives on, holding its port
    proxy.stop()
    proxy.start()                              # same state folder, same settings
    assert not pid_alive(before["pid"])        # stopped before the new supervisord started
    after = proxy.wait_state("sim", "loaded")["replicas"][0]
    assert after["pid"] != before["pid"] and after["port"] == before["port"]   # its port came back
    assert chat(proxy)[0] == 200



def _program_pids(proxy: ProxyProcess, *models: str) -> dict[str, int]:
    return {f"{m}/{r['index']}": r["pid"] for m in models for r in proxy.admin_model(m)["replicas"]}


def test_a_supervisord_killed_under_a_running_proxy_is_started_again_with_its_replicas(proxies) -> None:
    proxy = start(proxies, {"sim": sim_model(), "pair": sim_model(replicas=2, replica_max=2)})
    proxy.wait_state("sim", "loaded")
    proxy.wait_replicas_ready("pair", 2)
    # A replica can serve (pass its health check) before its PID is known; its start reads it
    # (programs.start_replica), and this wait makes sure: a null would pass for "a new one" below.
    before = wait_for(lambda: (lambda pids: pids if all(pids.values()) else None)(_program_pids(proxy, "sim", "pair")),
                      what="the PIDs of the 3 replicas")
    supervisord = int((proxy.state_dir / "supervisord.pid").read_text())
    os.kill(supervisord, signal.SIGKILL)

    def started_again() -> dict[str, int] | None:
        models = [proxy.admin_model(m) for m in ("sim", "pair")]
        ready = all(r["state"] == "ready" for m in models for r in m["replicas"])
        after = _program_pids(proxy, "sim", "pair")
        new = all(after.values()) and not set(after.values()) & set(before.values())
        return after if ready and len(after) == 3 and new else None

    after = wait_for(started_again, what="the replicas running again under a new supervisord")
    assert int((proxy.state_dir / "supervisord.pid").read_text()) != supervisord
    assert not [pid for pid in before.values() if pid_alive(pid)]    # what the dead one left was stopped
    # READY may come before supervisord's startsecs are over: RUNNING by then, or soon after.
    status = wait_for(lambda: (lambda text: text if text.count("RUNNING") == 3 else None)(
        proxy.supervisorctl("status").stdout), what="supervisorctl to show the 3 replicas RUNNING")
    assert all(str(pid) in status for pid in after.values())
    assert chat(proxy, "pair")[0] == 200 and chat(proxy, "sim")[0] == 200
    _, _, health = http("GET", proxy.url + "/health")
    assert health["status"] == "ok" and health["supervisord"]["answering"] is True
    assert health["supervisord"]["restarts"] == 1
    log = proxy.log_path.read_text()
    assert log.count("supervisord is not answering") == 1 and "supervisord died" in log
    assert proxy.admin_model("pair")["replicas"][0]["restarts"] == 1
    proxy.stop()                               # Ctrl-C: nothing is left running (checked by `proxies`)
    assert not [pid for pid in after.values() if pid_alive(pid)]


def test_a_supervisord_that_stops_answering_is_reported_and_logged_once(proxies) -> None:
    proxy = ProxyProcess({"sim": sim_model()})
    proxy.config["supervisor"]["rpc_timeout_s"] = 0.3
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxies.append(proxy)
    proxy.start()
    pid = proxy.wait_state("sim", "loaded")["replicas"][0]["pid"]
    supervisord = int((proxy.state_dir / "supervisord.pid").read_text())
    os.kill(supervisord, signal.SIGSTOP)       # alive, not answering: it still owns its programs
    try:
        def down_a_while() -> dict[str, Any] | None:
            body = http("GET", proxy.url + "/health")[2]
            state = body["supervisord"]
            return body if not state["answering"] and state["down_for_s"] >= 2 else None

        health = wait_for(down_a_while, what="/health to report supervisord down")
        assert health["status"] == "degraded" and "did not answer" in health["supervisord"]["error"]
        _, _, admin = http("GET", proxy.url + "/v1/admin/models")
        assert admin["supervisord"]["answering"] is False
        assert chat(proxy)[0] == 200           # what runs keeps serving
        assert proxy.log_path.read_text().count("supervisord is not answering") == 1   # not every poll
        assert pid_alive(supervisord) and proxy.admin_model("sim")["replicas"][0]["pid"] == pid
    finally:
        os.kill(supervisord, signal.SIGCONT)
    wait_for(lambda: http("GET", proxy.url + "/health")[2]["supervisord"]["answering"], what="supervisord back")
    assert "supervisord answers again" in proxy.log_path.read_text()
    assert proxy.admin_model("sim")["replicas"][0]["pid"] == pid   # nothing was restarted


STALLING_SIM = {"max_seqs": 2, "decode_tokens_per_s": 200, "ttft_ms": 1, "stall_after_tokens": 2}


def _held_stream(conn: http_client.HTTPConnection) -> http_client.HTTPResponse:
    """A stream on the stalling sim, its first line read: it holds the shutdown open until `conn`
    closes (the sim goes silent after two tokens)."""
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}),
        {"Content-Type": "application/json"})
    stream = conn.getresponse()
    assert stream.status == 200 and stream.readline().startswith(b"data: ")
    return stream


def test_a_second_sigterm_during_shutdown_is_ignored_and_the_models_are_still_stopped(proxies) -> None:
    # The sim goes silent after two tokens, so the stream holds the shutdown open for as long as
    # the test needs: the second signal surely lands while the proxy is stopping.
    proxy = start(proxies, {"sim": sim_model(sim=STALLING_SIM)})
    replica = proxy.wait_state("sim", "loaded")["replicas"][0]
    supervisord = int((proxy.state_dir / "supervisord.pid").read_text())
    conn = http_client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    _held_stream(conn)
    assert proxy.proc is not None
    proxy.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "shutting down" in proxy.log_path.read_text(), what="the shutdown to begin")
    proxy.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM ignored: already shutting down" in proxy.log_path.read_text(),
             what="the second SIGTERM to be logged as ignored")
    conn.close()   # the last request in flight ends; the shutdown goes on
    assert proxy.proc.wait(60) == 0
    assert not pid_alive(replica["pid"]) and not pid_alive(supervisord)
    assert "unload did not finish" not in proxy.log_path.read_text()


def test_during_the_shutdown_new_requests_get_503_shutting_down_and_the_port_stays_open(proxies) -> None:
    # A stalled stream holds the drain open: what the test sends meanwhile surely meets a proxy
    # that is stopping, not one that has already closed its port.
    proxy = start(proxies, {"sim": sim_model(sim=STALLING_SIM)})
    replica = proxy.wait_state("sim", "loaded")["replicas"][0]
    supervisord = int((proxy.state_dir / "supervisord.pid").read_text())
    conn = http_client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    try:
        _held_stream(conn)
        assert proxy.proc is not None
        proxy.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "shutting down" in proxy.log_path.read_text(), what="the shutdown to begin")
        _answers_while_stopping(proxy, replica["pid"])
    finally:
        conn.close()   # the last request in flight ends; the models are unloaded and the proxy exits
    assert proxy.proc.wait(60) == 0
    assert not pid_alive(replica["pid"]) and not pid_alive(supervisord)
    assert "unload did not finish" not in proxy.log_path.read_text()


def _answers_while_stopping(proxy: ProxyProcess, replica_pid: int) -> None:
    assert proxy.proc is not None
    status, headers, body = http("POST", proxy.url + "/v1/chat/completions",
                                 {"model": "sim", "messages": [{"role": "user", "content": "hi"}]})
    assert (status, body["error"]["code"], body["error"]["type"]) == (503, "shutting_down", "server_error")
    assert int(headers["Retry-After"]) >= 1 and headers["Connection"] == "close"
    status, headers, body = http("GET", proxy.url + "/ready")
    assert (status, body["status"]) == (503, "shutting_down") and int(headers["Retry-After"]) >= 1
    status, _, body = http("GET", proxy.url + "/health")
    assert (status, body["status"]) == (200, "shutting_down")   # alive: killing it would cut the drain short
    assert proxy.proc.poll() is None and pid_alive(replica_pid)   # the stream in flight still has its model


def test_a_request_that_outlives_the_drain_timeout_does_not_hold_the_exit(proxies) -> None:
    # The stalled stream never ends by itself: after service.drain_timeout_s the models are unloaded
    # anyway, and its client is told so by an error event, not left hanging.
    proxy = start(proxies, {"sim": sim_model(sim=STALLING_SIM)}, drain_timeout_s=1)
    replica = proxy.wait_state("sim", "loaded")["replicas"][0]
    conn = http_client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    try:
        stream = _held_stream(conn)
        assert proxy.proc is not None
        proxy.proc.send_signal(signal.SIGTERM)
        assert proxy.proc.wait(60) == 0
        assert b"event: error" in stream.read()
    finally:
        conn.close()
    assert not pid_alive(replica["pid"])
    assert "1 request(s) still in flight after service.drain_timeout_s" in proxy.log_path.read_text()
