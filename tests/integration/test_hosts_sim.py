"""Several hosts: real supervisords on loopback, each started by `llm-pool node` with its own
inet_http_server port and password (each a "host"), driven by one `llm-pool serve` (mode hosts)."""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import xmlrpc.client
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from helpers import REPO, Node, ProxyProcess, free_port, http, node_pool as pool, sim_model as sim, wait_for

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    started: list[Node] = []
    yield started
    for node in started:
        node.stop()


def ask(proxy: ProxyProcess, model: str) -> int:
    return http("POST", proxy.url + "/v1/chat/completions", body={"model": model, "messages": CHAT,
                                                                   "max_tokens": 4})[0]


def two_hosts(nodes: list[Node], proxies: list[ProxyProcess], **supervisor: Any) -> tuple[ProxyProcess, dict[str, Any]]:
    """Hosts a and b, and a proxy over them serving `m` with two replicas, both READY (its admin view)."""
    nodes.extend([Node("a", "pa").start(), Node("b", "pb").start()])
    proxy = pool(nodes, {"m": sim(replicas=2)}, **supervisor)
    proxies.append(proxy)
    proxy.start()
    return proxy, proxy.wait_replicas_ready("m", 2)


def on(host: str, replicas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in replicas if r["host"] == host]


def states_on(proxy: ProxyProcess, host: str) -> list[str]:
    """The states of model m's replicas on `host`."""
    return [r["state"] for r in on(host, proxy.admin_model("m")["replicas"])]


def test_the_plugin_refuses_a_wrong_password_and_names_that_are_not_llm_pools(nodes: list[Node]) -> None:
    node = Node("a", "right-password").start()
    nodes.append(node)
    with pytest.raises(xmlrpc.client.ProtocolError) as refused:
        node.rpc("wrong").llm_pool.listPrograms()
    assert refused.value.errcode == 401
    for name in ("../../etc/cron.d/x", "supervisord", "tiny-0123abcd-r0.conf", "x" * 60 + "-0123abcd-r0"):
        with pytest.raises(xmlrpc.client.Fault) as bad:
            node.rpc().llm_pool.writeProgram(name, f"[program:{name}]\ncommand=/bin/true\n")
        assert bad.value.faultCode == 10, name   # BAD_NAME
    name = "tiny-0123abcd-r0"
    for text in (f"[program:{name}]\ncommand=/bin/true\nuser=root\n",
                 f"[program:{name}]\ncommand=/bin/true\n[include]\nfiles=/tmp/*.conf\n",
                 "[program:other-0123abcd-r0]\ncommand=/bin/true\n",
                 f"[program:{name}]\ncommand=/bin/true\nstdout_logfile=/tmp/elsewhere.log\n"):
        with pytest.raises(xmlrpc.client.Fault) as refused_text:
            node.rpc().llm_pool.writeProgram(name, text)
        assert refused_text.value.faultCode == 2, text   # INCORRECT_PARAMETERS
    assert list((node.state / "programs").iterdir()) == []
    devices = node.rpc().llm_pool.getDevices()
    assert devices["cpu"]["total_bytes"] > 0


def test_the_plugin_reads_a_program_as_supervisord_does_and_writes_it_for_its_user_alone(nodes: list[Node]) -> None:
    node = Node("a", "pa").start()
    nodes.append(node)
    log_dir = node.rpc().llm_pool.getInfo()["log_dir"]
    name = "tiny-0123abcd-r0"
    # supervisord ends the value at ` ;` (an inline comment) and logs to /tmp/elsewhere.log; the
    # whole line, read as a path, resolves back into the node's log folder.
    for logfile in (f"/tmp/elsewhere.log ;/../..{log_dir}/{name}.log", f"/tmp/elsewhere.log #/../..{log_dir}/x.log"):
        with pytest.raises(xmlrpc.client.Fault) as refused:
            node.rpc().llm_pool.writeProgram(name, f"[program:{name}]\ncommand=/bin/true\nstdout_logfile={logfile}\n")
        assert refused.value.faultCode == 2 and "stdout_logfile must be in" in refused.value.faultString, logfile
    assert list((node.state / "programs").iterdir()) == []
    text = f"[program:{name}]\ncommand=/bin/true\nautostart=false\nstdout_logfile={log_dir}/{name}.log\n"
    assert node.rpc().llm_pool.writeProgram(name, text) is True
    (written,) = (node.state / "programs").iterdir()
    assert stat.S_IMODE(written.stat().st_mode) == 0o600   # a program's environment may hold keys
    assert node.rpc().llm_pool.removeProgram(name) is True


def test_a_model_goes_to_the_host_with_room_and_one_that_fits_nowhere_is_refused_with_the_numbers(
        nodes: list[Node], proxies: list[ProxyProcess], tmp_path: Path) -> None:
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"\0" * (30 * 1024 * 1024))   # its estimate: 30 MiB of weights
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (80 * 1024 * 1024))
    nodes += [Node("a", "pa").start(), Node("b", "pb").start()]
    proxy = pool(nodes, {"fits": sim(model_path=str(weights), pinned=True),
                         "huge": sim(model_path=str(big), enabled=False)},
                 budgets={"a": 10, "b": 100})
    proxies.append(proxy)
    proxy.start()
    model = proxy.wait_state("fits", "loaded")
    assert [r["host"] for r in model["replicas"]] == ["b"]            # a's 10 MiB cannot hold it
    assert ask(proxy, "fits") == 200
    assert len(os.listdir(nodes[1].state / "programs")) == 1 and os.listdir(nodes[0].state / "programs") == []
    status, _, body = http("POST", proxy.url + "/v1/admin/models/huge/load", body={})
    # a is too small, b holds the pinned `fits`: it fits nowhere, and says so with the numbers.
    assert status == 409 and body["error"]["code"] == "model_too_large", body
    assert re.search(r"b:cpu: needs 80\.0 MiB, [\d.]+ MiB free of a budget of 100\.0 MiB", body["error"]["message"]), body


def test_two_replicas_on_two_hosts_and_a_host_that_dies_takes_only_its_own(nodes: list[Node],
                                                                          proxies: list[ProxyProcess]) -> None:
    proxy, model = two_hosts(nodes, proxies)
    assert sorted(r["host"] for r in model["replicas"]) == ["a", "b"]
    assert all(ask(proxy, "m") == 200 for _ in range(6))
    for node in nodes:
        node.remember()
    status, _, hosts = http("GET", proxy.url + "/v1/admin/hosts")
    assert status == 200 and [h["name"] for h in hosts["data"]] == ["a", "b"], hosts
    assert all(h["answering"] and h["replicas"] == 1 for h in hosts["data"]), hosts
    shown = subprocess.run([sys.executable, "-m", "proxy.cli", "ctl", "--url", proxy.url, "hosts"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and [line.split()[0] for line in shown.stdout.splitlines()[1:]] == ["a", "b"], shown
    assert "pa" not in shown.stdout and "pb" not in proxy.log_path.read_text()   # no password shown or logged
    # A replica's log comes from its own host's supervisord (the sim writes nothing: a line is added
    # to each log file on its host, which supervisord reads back).
    for replica in model["replicas"]:
        node = {n.name: n for n in nodes}[replica["host"]]
        with open(node.state / "logs" / f"{replica['program']}.log", "a") as log_file:
            log_file.write(f"written on host {replica['host']}\n")
        logs = subprocess.run([sys.executable, "-m", "proxy.cli", "ctl", "--url", proxy.url, "--json", "logs", "m",
                               "--replica", str(replica["index"])], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert logs.returncode == 0, logs
        chunk = json.loads(logs.stdout.splitlines()[0])
        assert chunk["host"] == replica["host"] and chunk["text"] == f"written on host {replica['host']}\n", chunk
    # gpu-memory has each host's devices, and each node's replicas measured there.
    status, _, gpu = http("GET", proxy.url + "/v1/admin/gpu-memory")
    assert status == 200 and set(gpu["hosts"]) == {"a", "b"}, gpu
    for name in ("a", "b"):
        host = gpu["hosts"][name]
        assert host["answering"] and host["cpu"]["total_mib"] > 0, host
        (measured,) = host["replicas"]
        assert measured["replica"].startswith("m/r") and measured["measured_mib"]["cpu"] > 0, host
    # Every per-replica metric names the host.
    metrics = http("GET", proxy.url + "/metrics")[2].decode()
    assert re.search(r'llm_pool_replica_ready\{host="a",model="m",replica="\d"\} 1', metrics), metrics
    assert re.search(r'llm_pool_replica_ready\{host="b",model="m",replica="\d"\} 1', metrics), metrics

    nodes[0].kill()      # host a's supervisord: SIGKILL
    wait_for(lambda: states_on(proxy, "a") == ["host_unreachable"],
             what="host a's replica to leave rotation")
    assert all(ask(proxy, "m") == 200 for _ in range(6))     # b serves them all
    (b_replica,) = on("b", proxy.admin_model("m")["replicas"])
    assert b_replica["state"] == "ready"
    down = {h["name"]: h for h in http("GET", proxy.url + "/v1/admin/hosts")[2]["data"]}
    assert not down["a"]["answering"] and down["b"]["answering"]

    nodes[0].start()     # the host returns: its replica is started again from its program file
    model = proxy.wait_replicas_ready("m", 2)
    assert sorted(r["host"] for r in model["replicas"]) == ["a", "b"]
    assert [r["pid"] for r in on("b", model["replicas"])] == [b_replica["pid"]]   # b untouched
    assert all(ask(proxy, "m") == 200 for _ in range(6))


def test_a_host_that_stops_answering_and_returns_is_adopted_without_a_restart(nodes: list[Node],
                                                                              proxies: list[ProxyProcess]) -> None:
    proxy, model = two_hosts(nodes, proxies, rpc_timeout_s=1)
    (before,) = on("a", model["replicas"])
    assert nodes[0].proc is not None
    os.kill(nodes[0].proc.pid, signal.SIGSTOP)      # a partition: its supervisord does not answer
    try:
        wait_for(lambda: states_on(proxy, "a") == ["host_unreachable"],
                 what="host a's replica to leave rotation")
        assert ask(proxy, "m") == 200
    finally:
        os.kill(nodes[0].proc.pid, signal.SIGCONT)
    model = proxy.wait_replicas_ready("m", 2)
    (after,) = on("a", model["replicas"])
    assert after["pid"] == before["pid"] and after["restarts"] == before["restarts"]


def test_a_frozen_host_does_not_hold_up_the_monitoring_of_the_others(nodes: list[Node],
                                                                      proxies: list[ProxyProcess]) -> None:
    # Far longer than the test waits: a pass that waits for host a's answer sees nothing in time.
    proxy, model = two_hosts(nodes, proxies, rpc_timeout_s=3600)
    (on_b,) = on("b", model["replicas"])
    assert nodes[0].proc is not None
    os.kill(nodes[0].proc.pid, signal.SIGSTOP)      # host a's supervisord answers nothing, and refuses nothing
    try:
        nodes[1].rpc().supervisor.stopProcess(f"{on_b['program']}:{on_b['program']}")
        wait_for(lambda: states_on(proxy, "b") == ["stopped"],
                 what="host b's stop to be seen while host a is frozen")
        nodes[1].rpc().supervisor.startProcess(f"{on_b['program']}:{on_b['program']}")
        wait_for(lambda: states_on(proxy, "b") == ["ready"],
                 what="host b's replica back in rotation while host a is frozen")
    finally:
        os.kill(nodes[0].proc.pid, signal.SIGCONT)


def test_program_files_of_models_no_longer_configured_are_removed_on_every_host(
        nodes: list[Node], proxies: list[ProxyProcess]) -> None:
    from launchers import sim as sim_launcher
    from launchers.spec import program_name, render_replica
    from proxy.config.loading import load_settings

    nodes += [Node("a", "pa").start(), Node("b", "pb").start()]
    # A model an earlier configuration placed on host b, running there.
    proxy = pool(nodes, {"gone": sim(), "kept": sim()})
    config = load_settings(proxy.config_path).models["gone"]
    spec = sim_launcher.launch(config, 0, proxy.config["supervisor"]["port_range"][1], 5, {})
    assert spec.program == program_name("gone", 0)
    info = nodes[1].rpc().llm_pool.getInfo()
    nodes[1].rpc().llm_pool.writeProgram(spec.program, render_replica("gone", spec, Path(info["log_dir"])))
    nodes[1].rpc().supervisor.startProcess(f"{spec.program}:{spec.program}")
    nodes[1].remember()
    del proxy.config["engine"]["models"]["gone"]
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxies.append(proxy)
    proxy.start()
    proxy.wait_state("kept", "loaded")
    wait_for(lambda: spec.program not in nodes[1].rpc().llm_pool.listPrograms(), what="b's stale program removed")
    assert not (nodes[1].state / "programs" / f"{spec.program}.conf").exists()
    assert all(p["name"] != spec.program for p in nodes[1].rpc().supervisor.getAllProcessInfo())
    assert "removing " + spec.program + " on host b" in proxy.log_path.read_text()


def test_a_node_whose_old_pid_is_now_another_process_starts_and_one_beside_a_running_node_is_refused(
        nodes: list[Node]) -> None:
    node = Node("a", "pa")
    other = subprocess.Popen(["sleep", "300"])     # the old supervisord's PID, taken by another process
    try:
        (node.state / "supervisord.pid").write_text(f"{other.pid}\n")
        nodes.append(node.start())
    finally:
        other.kill()
        other.wait()
    second = subprocess.run([sys.executable, "-m", "proxy.cli", "node", "--listen", "127.0.0.1:1",
                             "--state-dir", str(node.state)], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "LLM_POOL_NODE_PASSWORD": "pa"})
    assert second.returncode == 2 and "already has a running supervisord" in second.stderr, second
    assert node.rpc().supervisor.getState()["statename"] == "RUNNING"   # the running one is untouched
    unset = subprocess.run([sys.executable, "-m", "proxy.cli", "node", "--listen", "127.0.0.1:1",
                            "--state-dir", str(node.state.parent / (node.state.name + "-x"))], cwd=REPO,
                           capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "LLM_POOL_NODE_PASSWORD"})
    assert unset.returncode == 2 and "LLM_POOL_NODE_PASSWORD is unset" in unset.stderr, unset


def test_check_config_hosts_logs_into_each_node_and_names_the_one_that_refuses(nodes: list[Node],
                                                                               tmp_path: Path) -> None:
    # Before: check-config had no --hosts, and a wrong password showed only once `serve` ran.
    nodes.extend([Node("a", "node-a-secret-7").start(), Node("b", "node-b-secret-8").start()])
    closed = f"http://127.0.0.1:{free_port()}"   # nothing listens there
    config = tmp_path / "pool.yaml"
    config.write_text(yaml.safe_dump({
        "service": {"state_dir": str(tmp_path / "state")},
        "supervisor": {"mode": "hosts", "rpc_timeout_s": 5, "hosts": {
            "a": {"url": nodes[0].url, "password_env": "NODE_A_PASSWORD"},
            "b": {"url": nodes[1].url, "password_env": "NODE_B_PASSWORD"},
            "c": {"url": closed, "password_env": "NODE_C_PASSWORD"}}},
        "engine": {"models": {"m": sim()}}}))

    def check_hosts(**passwords: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "proxy.cli", "--config", str(config), "check-config", "--hosts"],
                              cwd=REPO, env={**os.environ, **passwords}, capture_output=True, text=True, timeout=60)

    done = check_hosts(NODE_A_PASSWORD="node-a-secret-7", NODE_B_PASSWORD="wrong-secret-9", NODE_C_PASSWORD="x")
    assert done.returncode == 2, done
    assert done.stdout.splitlines() == [f"host a: {nodes[0].url} answered, login as llm-pool worked",
                                        f"host b: {nodes[1].url} answered, login as llm-pool refused",
                                        f"host c: {closed} did not answer"], done
    assert (f"  supervisor.hosts.b: {nodes[1].url} refused the login as llm-pool with the password in "
            f"NODE_B_PASSWORD; set that variable to the node's LLM_POOL_NODE_PASSWORD") in done.stderr, done.stderr
    assert f"  supervisor.hosts.c: supervisord at {closed} did not answer llm_pool.getInfo" in done.stderr, done.stderr
    assert "supervisor.hosts.a" not in done.stderr
    assert "secret" not in done.stdout + done.stderr   # no password shown, right or wrong
    config.write_text(config.read_text().replace(closed, nodes[0].url))   # c: a second name for node a
    done = check_hosts(NODE_A_PASSWORD="node-a-secret-7", NODE_B_PASSWORD="node-b-secret-8",
                       NODE_C_PASSWORD="node-a-secret-7")
    assert done.returncode == 0 and done.stdout.splitlines()[-1].startswith("ok: 1 model(s), 1 enabled"), done
    assert done.stdout.count("login as llm-pool worked") == 3, done


def host_up_gauges(proxy: ProxyProcess) -> dict[str, float]:
    """llm_pool_host_up by host, read through prometheus-client's parser (the exposition stays valid)."""
    text = http("GET", proxy.url + "/metrics")[2].decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    contact = {s.labels["host"] for s in families["llm_pool_host_last_contact_seconds"].samples}
    assert contact == {"a", "b"}, contact
    return {s.labels["host"]: s.value for s in families["llm_pool_host_up"].samples}


def test_a_host_that_does_not_answer_is_named_in_health_metrics_events_and_its_replicas_state(
        nodes: list[Node], proxies: list[ProxyProcess]) -> None:
    # Before: a's replica showed `starting`, /health said ok and no metric or event said a host was down.
    proxy, model = two_hosts(nodes, proxies, rpc_timeout_s=1)
    status, _, health = http("GET", proxy.url + "/health")
    assert status == 200 and health["status"] == "ok", health
    assert set(health["hosts"]) == {"a", "b"} and all(h["answering"] for h in health["hosts"].values()), health
    assert host_up_gauges(proxy) == {"a": 1.0, "b": 1.0}
    assert nodes[0].proc is not None
    os.kill(nodes[0].proc.pid, signal.SIGSTOP)      # host a's supervisord answers nothing
    try:
        wait_for(lambda: states_on(proxy, "a") == ["host_unreachable"], what="a's replica host_unreachable")
        assert states_on(proxy, "b") == ["ready"]
        assert all(ask(proxy, "m") == 200 for _ in range(4))         # out of rotation: b serves them all
        (on_a,) = on("a", proxy.admin_model("m")["replicas"])
        assert on_a["last_error"].startswith("host a is not answering"), on_a
        status, _, health = http("GET", proxy.url + "/health")
        assert status == 200 and health["status"] == "degraded", health
        down = health["hosts"]["a"]
        assert not down["answering"] and down["down_for_s"] >= 0 and down["error"], health
        assert health["hosts"]["b"]["answering"] and health["supervisord"]["answering"] is True, health
        assert host_up_gauges(proxy) == {"a": 0.0, "b": 1.0}
        shown = subprocess.run([sys.executable, "-m", "proxy.cli", "ctl", "--url", proxy.url, "models"], cwd=REPO,
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown
        (row,) = [line for line in shown.stdout.splitlines() if line.startswith("m ")]
        assert "(host unreachable)" in row and "1/2" in row.split(), shown.stdout
        status, _, feed = http("GET", proxy.url + "/v1/admin/events?kind=host_down")
        assert status == 200 and [(e["kind"], e["host"]) for e in feed["data"]] == [("host_down", "a")], feed
    finally:
        os.kill(nodes[0].proc.pid, signal.SIGCONT)
    model = proxy.wait_replicas_ready("m", 2)       # back through its health check, same process
    (after,) = on("a", model["replicas"])
    assert after["state"] == "ready" and after["pid"] == on_a["pid"]
    health = http("GET", proxy.url + "/health")[2]
    assert health["status"] == "ok" and health["hosts"]["a"]["answering"], health
    assert host_up_gauges(proxy) == {"a": 1.0, "b": 1.0}
    feed = http("GET", proxy.url + "/v1/admin/events?kind=host_up")[2]
    assert [(e["kind"], e["host"]) for e in feed["data"]] == [("host_up", "a")], feed
    assert "host a answers again after" in proxy.log_path.read_text()


def test_a_host_down_from_the_start_shows_its_error_on_the_admin_listener_only(proxies: list[ProxyProcess]) -> None:
    closed = f"http://127.0.0.1:{free_port()}"   # nothing listens there
    admin_port = free_port()
    proxy = ProxyProcess({"m": sim(enabled=False)}, service={"admin_host": "127.0.0.1", "admin_port": admin_port})
    proxy.config["supervisor"].update(mode="hosts", rpc_timeout_s=1,
                                      hosts={"c": {"url": closed, "password_env": "NODE_C_PASSWORD"}})
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.env = {"NODE_C_PASSWORD": "pc"}
    proxies.append(proxy)
    proxy.start()
    admin = f"http://127.0.0.1:{admin_port}"
    private = wait_for(lambda: (h := http("GET", admin + "/health")[2])["status"] == "degraded" and h,
                       what="host c to be seen down")
    assert not private["hosts"]["c"]["answering"] and private["hosts"]["c"]["last_contact_s"] is None, private
    assert private["hosts"]["c"]["error"] and "admin listener" not in private["hosts"]["c"]["error"], private
    status, _, public = http("GET", proxy.url + "/health")
    assert status == 200 and public["status"] == "degraded", public
    assert public["hosts"]["c"]["error"] == "the reason is shown on the admin listener (service.admin_port)", public
    text = http("GET", proxy.url + "/metrics")[2].decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert [(s.labels, s.value) for s in families["llm_pool_host_up"].samples] == [({"host": "c"}, 0.0)]
    assert families["llm_pool_host_last_contact_seconds"].samples == []   # it never answered
