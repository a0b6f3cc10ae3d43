"""Several hosts: real supervisords on loopback, each started by `llm-pool node` with its own
inet_http_server port and password (each a "host"), driven by one `llm-pool serve` (mode hosts)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import xmlrpc.client
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from helpers import REPO, ProxyProcess, free_port, http, pid_alive, wait_for

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "hi"}]


class Node:
    """One host: `llm-pool node` (which becomes supervisord) in its own state folder."""

    def __init__(self, name: str, password: str) -> None:
        self.name = name
        self.password = password
        self.port = free_port()
        self.state = Path(tempfile.mkdtemp(prefix=f"lp-node-{name}-", dir="/tmp"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: set[int] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rpc(self, password: str | None = None) -> Any:
        return xmlrpc.client.ServerProxy(f"http://llm-pool:{password or self.password}@127.0.0.1:{self.port}/RPC2")

    def start(self) -> "Node":
        env = {**os.environ, "LLM_POOL_NODE_PASSWORD": self.password}
        log = open(self.state.parent / f"{self.state.name}.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "node", "--listen", f"127.0.0.1:{self.port}",
                                      "--state-dir", str(self.state)], cwd=REPO, env=env, stdout=log,
                                     stderr=subprocess.STDOUT)
        self.pids.add(self.proc.pid)

        def answers() -> bool:
            try:
                return bool(self.rpc().supervisor.getState())
            except OSError:
                return False
        wait_for(answers, what=f"node {self.name} on {self.url}")
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def remember(self) -> None:
        try:
            self.pids.update(p["pid"] for p in self.rpc().supervisor.getAllProcessInfo() if p["pid"])
        except OSError:
            pass

    def stop(self) -> None:
        self.remember()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    started: list[Node] = []
    yield started
    for node in started:
        node.stop()


def pool(nodes: list[Node], models: dict[str, Any], budgets: dict[str, float] | None = None) -> ProxyProcess:
    proxy = ProxyProcess(models)
    proxy.config["supervisor"].update(mode="hosts", hosts={
        n.name: {"url": n.url, "password_env": f"NODE_{n.name.upper()}_PASSWORD",
                 **({"cpu_budget_mib": budgets[n.name]} if budgets and n.name in budgets else {})} for n in nodes})
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.env = {f"NODE_{n.name.upper()}_PASSWORD": n.password for n in nodes}
    return proxy


def sim(**fields: Any) -> dict[str, Any]:
    return {"backend": "sim", "enabled": True, "target_inflight": 4, "sim": {"ttft_ms": 1, "tokens_per_s": 2000},
            **fields}


def ask(proxy: ProxyProcess, model: str) -> int:
    return http("POST", proxy.url + "/v1/chat/completions", body={"model": model, "messages": CHAT,
                                                                   "max_tokens": 4})[0]


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
    nodes += [Node("a", "pa").start(), Node("b", "pb").start()]
    proxy = pool(nodes, {"m": sim(replicas=2)})
    proxies.append(proxy)
    proxy.start()
    model = proxy.wait_replicas_ready("m", 2)
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

    nodes[0].kill()      # host a's supervisord: SIGKILL
    wait_for(lambda: [r["state"] for r in proxy.admin_model("m")["replicas"] if r["host"] == "a"] != ["ready"],
             what="host a's replica to leave rotation")
    assert all(ask(proxy, "m") == 200 for _ in range(6))     # b serves them all
    (b_replica,) = [r for r in proxy.admin_model("m")["replicas"] if r["host"] == "b"]
    assert b_replica["state"] == "ready"
    down = {h["name"]: h for h in http("GET", proxy.url + "/v1/admin/hosts")[2]["data"]}
    assert not down["a"]["answering"] and down["b"]["answering"]

    nodes[0].start()     # the host returns: its replica is started again from its program file
    model = proxy.wait_replicas_ready("m", 2)
    assert sorted(r["host"] for r in model["replicas"]) == ["a", "b"]
    assert [r["pid"] for r in model["replicas"] if r["host"] == "b"] == [b_replica["pid"]]   # b untouched
    assert all(ask(proxy, "m") == 200 for _ in range(6))


def test_a_host_that_stops_answering_and_returns_is_adopted_without_a_restart(nodes: list[Node],
                                                                              proxies: list[ProxyProcess]) -> None:
    nodes += [Node("a", "pa").start(), Node("b", "pb").start()]
    proxy = pool(nodes, {"m": sim(replicas=2)})
    proxy.config["supervisor"]["rpc_timeout_s"] = 1
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxies.append(proxy)
    proxy.start()
    model = proxy.wait_replicas_ready("m", 2)
    (before,) = [r for r in model["replicas"] if r["host"] == "a"]
    assert nodes[0].proc is not None
    os.kill(nodes[0].proc.pid, signal.SIGSTOP)      # a partition: its supervisord does not answer
    try:
        wait_for(lambda: [r["state"] for r in proxy.admin_model("m")["replicas"] if r["host"] == "a"] != ["ready"],
                 what="host a's replica to leave rotation")
        assert ask(proxy, "m") == 200
    finally:
        os.kill(nodes[0].proc.pid, signal.SIGCONT)
    model = proxy.wait_replicas_ready("m", 2)
    (after,) = [r for r in model["replicas"] if r["host"] == "a"]
    assert after["pid"] == before["pid"] and after["restarts"] == before["restarts"]
