"""Operating a real proxy (real supervisord, real llama-server): /ready, the admin view, replica logs,
GPU memory, `llm-pool ctl` as a real command, and SIGUSR1 (the systemd unit's reload)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import REPO, ProxyProcess, free_port, http, wait_for

pytestmark = pytest.mark.integration

SECRETS = ("sk-vllm-secret-1", "hf-secret-2", "sk-remote-secret-3")


def ctl(proxy: ProxyProcess, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`llm-pool ctl` as an admin runs it: the URL comes from the proxy's settings file."""
    env = {**os.environ, "LLM_POOL_LOCAL_SETTINGS_PATH": str(proxy.state_dir / "no-local.yaml"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "proxy.cli", "--config", str(proxy.config_path), "ctl", *argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_ready_waits_for_every_enabled_model_and_shows_why_one_failed(start_proxy, tiny_gguf, tmp_path) -> None:
    flag = tmp_path / "give-up"
    stuck = tmp_path / "stuck-server"
    # A "llama-server" that never becomes healthy until the test says so, then fails.
    stuck.write_text(f"#!/bin/sh\nwhile [ ! -e {flag} ]; do sleep 0.05; done\necho 'stuck-server: giving up'\nexit 3\n")
    stuck.chmod(0o755)
    proxy = start_proxy({"fast": {"backend": "sim", "enabled": True},
                         "stuck": {"backend": "llama_server", "model_path": str(tiny_gguf),
                                   "llama_server_binary": str(stuck), "enabled": True},
                         "off": {"backend": "sim", "enabled": False}})
    status, headers, body = http("GET", proxy.url + "/ready")
    assert status == 503 and "stuck" in body["waiting_for"] and headers.get("Retry-After")
    assert set(body["models"]) == {"fast", "stuck"}  # a disabled model is not waited for
    proxy.wait_state("fast", "loaded")
    status, _, body = http("GET", proxy.url + "/ready")
    assert (status, body["waiting_for"], body["models"]["fast"]) == (503, ["stuck"], {"state": "loaded"})
    assert http("GET", proxy.url + "/health")[0] == 200  # liveness all along
    flag.touch()

    def ready() -> dict[str, Any] | None:
        status, _, body = http("GET", proxy.url + "/ready")
        return body if status == 200 else None

    body = wait_for(ready, what="/ready to answer 200")
    assert body["status"] == "ready" and body["models"]["fast"] == {"state": "loaded"}
    assert body["models"]["stuck"]["state"] == "failed" and "giving up" in body["models"]["stuck"]["reason"]


def test_a_remote_model_on_another_model_of_the_pool_loads_once_that_one_is_up(proxies) -> None:
    proxy = ProxyProcess({"fast": {"backend": "sim", "enabled": True}},
                         service={"load_retry_base_s": 0.2, "load_retry_max_s": 1})
    # The pool is its own provider: at startup "fast" is not up yet (and the proxy not listening).
    proxy.config["engine"]["models"]["relay"] = {
        "backend": "openai_remote", "model_path": None, "remote_base_url": proxy.url + "/v1",
        "remote_model": "fast", "remote_health_check": "models", "enabled": True}
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxies.append(proxy)
    proxy.start()
    wait_for(lambda: proxy.admin_model("relay")["state"] == "loaded", what="relay loaded by a retry")
    log = proxy.log_path.read_text()
    assert "loading relay failed (try 1)" in log and "trying again in 0.2s" in log
    assert proxy.admin_model("relay")["load_retry"] is None
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions",
                             {"model": "relay", "messages": [{"role": "user", "content": "Hi"}], "allow_remote": True})
    assert status == 200, answer


def test_admin_view_logs_and_gpu_memory_through_ctl(start_proxy, llama_model, proxies) -> None:
    proxy = ProxyProcess({
        "tiny": llama_model(description="the tiny demo"),
        "idle": llama_model(enabled=False, replica_max=2),
        "vl": {"backend": "vllm_serve", "vllm_model": "/nowhere/qwen", "vllm_serve_api_key": SECRETS[0],
               "vllm_serve_env": {"HF_TOKEN": SECRETS[1]}, "enabled": False},
        "remote": {"backend": "openai_remote", "remote_base_url": "http://127.0.0.1:9/v1", "remote_model": "x",
                   "remote_api_key_env": "TEST_REMOTE_KEY", "enabled": False},
    })
    proxy.env["TEST_REMOTE_KEY"] = SECRETS[2]
    proxies.append(proxy)
    proxy.start()
    proxy.wait_state("tiny", "loaded")

    listing = ctl(proxy, "--json", "models")
    assert listing.returncode == 0, listing.stderr
    assert not any(s in listing.stdout for s in SECRETS)
    models = {m["id"]: m for m in json.loads(listing.stdout)["data"]}
    tiny = models["tiny"]
    assert tiny["definition"]["model_path"] == llama_model()["model_path"]
    assert tiny["definition"]["description"] == "the tiny demo"
    assert tiny["load_constraints"]["overrides"]["llama_server_spec_draft_n_max"]["maximum"] == 6
    assert models["idle"]["load_constraints"]["replicas"]["maximum"] == 2
    assert models["remote"]["definition"]["fields"]["remote_api_key_env"] == {"variable": "TEST_REMOTE_KEY",
                                                                               "set": True}
    table = ctl(proxy, "models").stdout.splitlines()
    assert table[0].split()[:3] == ["MODEL", "BACKEND", "STATE"]
    assert any(line.split()[:4] == ["tiny", "llama_server", "loaded", "1/1"] for line in table)

    loaded = ctl(proxy, "load", "idle", "--override", "llama_server_n_ctx=1024", "--replicas", "2")
    assert loaded.returncode == 0, loaded.stderr
    assert "replica 1: ready" in loaded.stdout
    idle = proxy.admin_model("idle")
    assert idle["overrides"] == {"llama_server_n_ctx": 1024, "replicas": 2}

    port = idle["replicas"][1]["port"]
    logs = ctl(proxy, "logs", "idle", "--replica", "1")
    assert logs.returncode == 0 and str(port) in logs.stdout  # llama-server logs where it listens
    assert ctl(proxy, "logs", "idle", "--replica", "2").returncode == 1

    assert ctl(proxy, "unload", "idle").returncode == 0
    assert ctl(proxy, "unload", "idle").returncode == 1        # 409 model_not_loaded
    assert ctl(proxy, "load", "nosuch").returncode == 1        # 404
    assert ctl(proxy, "load", "tiny", "--override", "llama_server_n_gpu_layers=1").returncode == 1  # not live

    gpu = ctl(proxy, "--json", "gpu")
    assert gpu.returncode == 0, gpu.stderr
    report = json.loads(gpu.stdout)
    if not report["available"]:  # this machine: no GPU, the reason is said and estimates are still given
        assert report["reason"] and report["gpus"] == []
    estimate = report["models"]["tiny"]["estimate"]
    assert estimate["weights_mib"] > 0 and estimate["kv_cache_mib"] > 0
    assert any("llama_server_n_ctx" in c for c in estimate["counted"])
    assert report["models"]["vl"]["estimate"]["not_counted"]
    assert "MODEL" in ctl(proxy, "gpu").stdout

    dead = subprocess.run([sys.executable, "-m", "proxy.cli", "ctl", "--url", f"http://127.0.0.1:{free_port()}",
                           "models"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert dead.returncode == 3 and "no answer" in dead.stderr


def _default_sigint() -> None:
    # A shell without job control starts background commands with SIGINT ignored, and Python keeps
    # an ignored SIGINT ignored: the follow would then never see the Ctrl-C this test sends.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_logs_follow_prints_what_the_replica_writes(start_proxy, llama_model) -> None:
    proxy = start_proxy({"tiny": llama_model()})
    proxy.wait_state("tiny", "loaded")
    env = {**os.environ, "LLM_POOL_LOCAL_SETTINGS_PATH": str(proxy.state_dir / "no-local.yaml")}
    follow = subprocess.Popen([sys.executable, "-m", "proxy.cli", "--config", str(proxy.config_path), "ctl", "logs",
                               "tiny", "--bytes", "200", "--follow"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              text=True, preexec_fn=_default_sigint)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(follow.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: lines, what="the log tail")
        before = len(lines)
        status, _, _ = http("POST", proxy.url + "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4})
        assert status == 200
        # llama-server logs each task its slots run; the follow shows it without being asked again.
        wait_for(lambda: any("task" in line for line in lines[before:]), what="the request in the log")
    finally:
        follow.send_signal(signal.SIGINT)
        assert follow.wait(30) == 0


def test_sigusr1_hands_the_models_to_a_successor_that_adopts_them(proxies, llama_model) -> None:
    proxy = ProxyProcess({"tiny": llama_model()})
    proxies.append(proxy)
    proxy.start()
    pid = proxy.wait_state("tiny", "loaded")["replicas"][0]["pid"]
    old = proxy.serving_pid
    assert proxy.reload() == 0   # the old process exits 0 once its successor took over
    assert proxy.serving_pid != old
    assert proxy.wait_state("tiny", "loaded")["replicas"][0]["pid"] == pid  # adopted, not reloaded


def test_a_reload_keeps_a_load_override_and_the_process_that_runs_it(proxies, llama_model) -> None:
    proxy = ProxyProcess({"tiny": llama_model(enabled=False)})
    proxies.append(proxy)
    proxy.start()
    status, _, body = http("POST", proxy.url + "/v1/admin/models/tiny/load", {"overrides": {"llama_server_n_ctx": 2048}})
    assert status == 200, body
    pid = body["replicas"][0]["pid"]
    proxy.seen_pids.add(pid)
    assert proxy.reload() == 0
    model = proxy.wait_state("tiny", "loaded")
    assert model["replicas"][0]["pid"] == pid and model["overrides"] == {"llama_server_n_ctx": 2048}
    argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--ctx-size") + 1] == b"4096"   # 2048 per request, 2 slots (configured: 8192)


def test_a_reload_after_a_settings_change_rolls_every_replica_of_the_changed_model(proxies, llama_model) -> None:
    proxy = ProxyProcess({"pair": llama_model(replicas=2, replica_max=2), "other": llama_model()})
    proxies.append(proxy)
    proxy.start()
    before = proxy.wait_replicas_ready("pair", 2)["replicas"]
    other = proxy.wait_state("other", "loaded")["replicas"][0]["pid"]
    proxy.config["engine"]["models"]["pair"]["llama_server_n_ctx"] = 2048
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    assert proxy.reload() == 0     # docs/operating.md's restart without unloading
    old = {r["pid"] for r in before}

    def rolled() -> list[dict[str, Any]] | None:
        model = proxy.wait_replicas_ready("pair", 2)   # fails at once should it go `failed`
        replicas = model["replicas"]
        return replicas if not {r["pid"] for r in replicas} & old and not any(r["outdated"] for r in replicas) else None
    after = wait_for(rolled, what="both replicas restarted with the new settings, one by one")
    restarts = http("GET", proxy.url + "/v1/admin/events?kind=restart&model=pair")[2]["data"]
    assert [e["reason"] for e in restarts] == ["settings changed: llama_server_n_ctx"] * 2
    for replica in after:
        argv = (Path("/proc") / str(replica["pid"]) / "cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--ctx-size") + 1] == b"4096"           # 2048 per request, 2 slots
    assert proxy.wait_state("other", "loaded")["replicas"][0]["pid"] == other   # adopted as it was
    assert "loading pair failed" not in proxy.log_path.read_text()


def test_log_polls_resume_at_the_offset_skip_ahead_and_restart_after_rotation(start_proxy) -> None:
    proxy = start_proxy({"sim": {"backend": "sim", "enabled": True}})
    program = proxy.wait_state("sim", "loaded")["replicas"][0]["program"]
    # supervisord's log file of the replica; the sim writes nothing once started, so the test's
    # own appends are all that changes in it.
    log = proxy.state_dir / "logs" / (program + ".log")
    base = proxy.url + "/v1/admin/models/sim/logs?replica=0&bytes=100"

    status, _, first = http("GET", base)
    assert status == 200 and first["offset"] == log.stat().st_size and first["program"] == program
    with log.open("a") as f:
        f.write("hello\n")
    _, _, new = http("GET", f"{base}&offset={first['offset']}")
    assert (new["text"], new["offset"], new["overflow"]) == ("hello\n", first["offset"] + 6, False)
    _, _, idle = http("GET", f"{base}&offset={new['offset']}")
    assert (idle["text"], idle["offset"]) == ("", new["offset"])
    with log.open("a") as f:
        f.write("x" * 499 + "\n")
    _, _, burst = http("GET", f"{base}&offset={new['offset']}")
    assert burst["overflow"] is True and burst["text"] == "x" * 99 + "\n" and burst["offset"] == log.stat().st_size
    # An offset past the end: the log was rotated, so the new file is read from its start.
    _, _, rotated = http("GET", f"{base}&offset={burst['offset'] + 10_000}")
    assert rotated["overflow"] is True and rotated["offset"] == log.stat().st_size
    for query, param in (("replica=1", "replica"), ("bytes=0", "bytes"), ("offset=-1", "offset")):
        status, _, body = http("GET", f"{proxy.url}/v1/admin/models/sim/logs?{query}")
        assert (status, body["error"]["param"]) == (400, param)
    status, _, body = http("GET", proxy.url + "/v1/admin/models/nosuch/logs")
    assert status == 404


def test_ctl_sends_the_admin_token_from_the_variable_the_settings_name(proxies) -> None:
    proxy = ProxyProcess({"sim": {"backend": "sim", "enabled": False}},
                         service={"admin_token_env": "LLM_POOL_TEST_CTL_TOKEN"})
    proxy.env["LLM_POOL_TEST_CTL_TOKEN"] = "ctl-token-for-tests"
    proxies.append(proxy)
    proxy.start()
    refused = ctl(proxy, "models")
    assert refused.returncode == 1 and "401 invalid_admin_token" in refused.stderr
    # Which variable ctl read (the settings' service.admin_token_env), never the token.
    assert "(ctl found no admin token: $LLM_POOL_TEST_CTL_TOKEN and $LLM_POOL_ADMIN_TOKEN are not set)" \
        in refused.stderr
    wrong = ctl(proxy, "models", env={"LLM_POOL_TEST_CTL_TOKEN": "wrong-SECRET-5"})
    assert wrong.returncode == 1 and "(ctl sent the token from $LLM_POOL_TEST_CTL_TOKEN)" in wrong.stderr
    assert "wrong-SECRET-5" not in wrong.stdout + wrong.stderr
    allowed = ctl(proxy, "models", env={"LLM_POOL_TEST_CTL_TOKEN": "ctl-token-for-tests"})
    assert allowed.returncode == 0 and "sim" in allowed.stdout
    assert "ctl-token-for-tests" not in allowed.stdout + allowed.stderr


def test_ctl_load_scale_and_unload_are_json_posts_the_admin_api_takes(proxies) -> None:
    # The admin API refuses a POST that is not application/json (415), an unload's with no body too.
    proxy = ProxyProcess({"sim": {"backend": "sim", "enabled": False, "replica_max": 2}})
    proxies.append(proxy)
    proxy.start()
    for argv, state, replicas in ((("load", "sim"), "loaded", 1), (("scale", "sim", "2"), "loaded", 2),
                                  (("unload", "sim"), "unloaded", 0)):
        done = ctl(proxy, *argv)
        assert done.returncode == 0, done.stderr
        model = proxy.admin_model("sim")
        assert (model["state"], len(model["replicas"])) == (state, replicas), argv


def test_ctl_finds_a_proxy_started_with_port_and_still_finds_it_when_the_settings_break(proxies) -> None:
    proxy = ProxyProcess({"sim": {"backend": "sim", "enabled": False}})
    proxies.append(proxy)
    # The default state folder (under $XDG_STATE_HOME), which ctl still knows when the YAML does not parse.
    home = proxy.state_dir
    del proxy.config["service"]["state_dir"]
    proxy.state_dir = home / "llm-pool"
    proxy.env["XDG_STATE_HOME"] = str(home)
    # The settings name a port nothing listens on: `serve --port` puts the proxy elsewhere.
    proxy.config["service"]["port"] = free_port()
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.start(serve_args=("--port", str(proxy.port)))
    record = proxy.state_dir / "serve.address.json"
    assert json.loads(record.read_text()) == {"pid": proxy.serving_pid, "public": ["127.0.0.1", proxy.port],
                                              "admin": None}
    env = {"XDG_STATE_HOME": str(home)}
    found = ctl(proxy, "models", env=env)
    assert (found.returncode, found.stderr) == (0, "") and "sim" in found.stdout

    def recorded_pid() -> int | None:
        try:
            return int(json.loads(record.read_text())["pid"])
        except FileNotFoundError:
            return None

    # A reload: the successor records itself once it has taken over; its predecessor, gone, leaves it.
    proxy.reload()
    wait_for(lambda: recorded_pid() == proxy.serving_pid, what="the successor's address record")
    for broken in ("service: {port: eighty}\n", "service: {port: [unclosed\n"):   # a wrong value; not YAML
        proxy.config_path.write_text(broken)
        found = ctl(proxy, "models", env=env)
        assert found.returncode == 0 and "sim" in found.stdout, found.stderr
        assert found.stderr.startswith("llm-pool ctl: settings unusable (")
        assert f"using the address the running proxy (pid {proxy.serving_pid}) recorded in {record}" in found.stderr
    proxy.stop()
    assert not record.exists()   # a clean exit takes it away
    gone = ctl(proxy, "models", "--timeout", "5", env=env)
    assert f"no running proxy recorded in {record}; trying http://127.0.0.1:8011" in gone.stderr
