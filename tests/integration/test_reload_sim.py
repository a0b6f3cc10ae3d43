"""A reload (SIGUSR1) hands the service to a successor without a refused connection or a failed
request: real `llm-pool serve` processes under a real supervisord with sim replicas, clients on
keep-alive connections that send without pause, and systemd's notification socket played by the
test (what the unit's Type=notify reads)."""
from __future__ import annotations

import http.client as httpc
import json
import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import yaml

from helpers import ProxyProcess, http, pid_alive, sim_model, wait_for

pytestmark = pytest.mark.integration
CLIENTS = 4
AT_LEAST = 2000            # requests in all, across the reload
AFTER_RELOAD = 200         # and at least these after the old process has exited
CAP = 20000                # bounded whatever happens


def chat(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


BODY = chat("sim")


class Clients:
    """CLIENTS threads, each on its own keep-alive connection (a new one when the proxy answers
    `Connection: close`), sending one chat request after another without pause. Every failure is
    kept: an exception (a refused or reset connection) or a status other than 200."""

    def __init__(self, port: int, bodies: tuple[bytes, ...] = (BODY,)) -> None:
        self.port = port
        self.bodies = bodies
        self.lock = threading.Lock()
        self.done: list[tuple[float, float, int | str]] = []   # (start, end, status or exception name)
        self.stop_when = lambda: len(self.done) >= CAP
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(CLIENTS)]

    def __enter__(self) -> "Clients":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_when = lambda: True
        for thread in self.threads:
            thread.join(60)

    def _run(self) -> None:
        conn: httpc.HTTPConnection | None = None
        sent = 0
        while not self.stop_when():
            conn = conn or httpc.HTTPConnection("127.0.0.1", self.port, timeout=60)
            started = time.monotonic()
            outcome: int | str
            try:
                body = self.bodies[sent % len(self.bodies)]
                sent += 1
                conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                outcome = resp.status
                if resp.will_close:
                    conn.close()
                    conn = None
            except (OSError, httpc.HTTPException) as exc:
                outcome = type(exc).__name__
                conn.close()
                conn = None
            with self.lock:
                self.done.append((started, time.monotonic(), outcome))
        if conn is not None:
            conn.close()

    def count(self) -> int:
        with self.lock:
            return len(self.done)


class NotifySocket:
    """What systemd's NOTIFY_SOCKET receives, with the PID that sent each datagram."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.settimeout(0.1)
        self.received: list[tuple[int, str]] = []

    def read(self) -> list[tuple[int, str]]:
        while True:
            try:
                data, ancillary, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except TimeoutError:
                return self.received
            pid = next((struct.unpack("3i", d[:12])[0] for level, kind, d in ancillary
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), 0)
            self.received.append((pid, data.decode()))

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_reload_under_load_fails_no_request_and_refuses_no_connection(proxies, tmp_path, workers: int) -> None:
    """With workers (docs/workers.md), the successor starts its own on the same socket and the old
    controller's stop accepting at the handover and finish what they relay."""
    notify = NotifySocket(tmp_path / "notify")
    proxy = ProxyProcess({"sim": sim_model(replicas=2, replica_max=2)}, service={"workers": workers})
    proxy.env = {"NOTIFY_SOCKET": str(notify.path)}
    proxies.append(proxy)
    try:
        proxy.start()
        replicas = {r["pid"] for r in proxy.wait_replicas_ready("sim", 2)["replicas"]}
        old = proxy.serving_pid
        with Clients(proxy.port) as clients:
            wait_for(lambda: clients.count() >= 100, what="100 requests before the reload")
            reload_started = time.monotonic()
            code = proxy.reload()
            reload_done = time.monotonic()
            served_by_then = clients.count()
            clients.stop_when = lambda: clients.count() >= CAP or (
                clients.count() >= max(AT_LEAST, served_by_then + AFTER_RELOAD))
            for thread in clients.threads:
                thread.join(120)
        done = clients.done
        failed = [o for _s, _e, o in done if o != 200]
        refused = [o for o in failed if o == "ConnectionRefusedError"]
        during = [e - s for s, e, _o in done if e >= reload_started and s <= reload_done]
        print(f"\nreload under {CLIENTS} clients: {len(done)} requests, {len(failed)} failed "
              f"({len(refused)} refused connections), {served_by_then} sent before the old process had exited; "
              f"reload {reload_done - reload_started:.2f}s from SIGUSR1 to the old process's exit; longest "
              f"request during it {max(during) * 1000:.0f} ms ({len(during)} requests overlapped it)")
        assert failed == [], f"{len(failed)} of {len(done)} failed: {sorted(set(map(str, failed)))}"
        assert len(done) >= AT_LEAST and len(done) - served_by_then >= AFTER_RELOAD   # the reload ran under load
        assert code == 0                                  # the old process exited 0...
        new = proxy.serving_pid
        assert new != old
        model = proxy.admin_model("sim")
        assert {r["pid"] for r in model["replicas"]} == replicas and model["state"] == "loaded"   # ...kept them
        log = proxy.log_path.read_text()
        assert f"reload: successor pid {new} started" in log and f"reload: handing over to pid {new}" in log
        assert f"reload: took over from pid {old}" in log and f"reload: the predecessor (pid {old}) has exited" in log
        status, _, events = http("GET", proxy.url + "/v1/admin/events?kind=reload")
        assert status == 200 and [e["reason"] for e in events["data"]] == ["took_over"], events   # the admin's feed
        # systemd: ready once listening; on the reload RELOADING=1, then the main PID changes and
        # the reload ends. Sent by the main process each time (NotifyAccess=main is enough).
        messages = notify.read()
        assert [m.split("\n")[0] for _p, m in messages] == ["READY=1", "RELOADING=1", f"MAINPID={new}"], messages
        assert {p for p, _m in messages} == {old} and "READY=1" in messages[2][1].split("\n")
    finally:
        notify.close()


def test_a_reload_that_changes_one_model_fails_no_request_and_rolls_it_replica_by_replica(proxies) -> None:
    """The issue's acceptance: 4 clients, 2,000 requests or more over two models, a reload whose
    settings change one of them. No request fails, no connection is refused, the unchanged model
    keeps its processes, and the changed one is rolled onto its new settings without ever being
    left with no READY replica (read from the admin view all along)."""
    proxy = ProxyProcess({"same": sim_model(replicas=2, replica_max=2),
                          "changed": sim_model(replicas=2, replica_max=2)})
    proxies.append(proxy)
    proxy.start()
    same = {r["pid"] for r in proxy.wait_replicas_ready("same", 2)["replicas"]}
    before = {r["pid"] for r in proxy.wait_replicas_ready("changed", 2)["replicas"]}
    ready_seen: list[int] = []
    watching = threading.Event()

    def watch() -> None:
        # READY replicas of the changed model, read as often as the admin view answers.
        while not watching.is_set():
            status, _, body = http("GET", proxy.url + "/v1/admin/models")
            if status == 200:
                row = next(m for m in body["data"] if m["id"] == "changed")
                ready_seen.append(sum(r["state"] == "ready" for r in row["replicas"]))

    def rolled() -> bool:
        replicas = proxy.admin_model("changed")["replicas"]
        return (len(replicas) == 2 and all(r["state"] == "ready" and not r["outdated"] for r in replicas)
                and not {r["pid"] for r in replicas} & before)

    config = yaml.safe_load(proxy.config_path.read_text())
    config["engine"]["models"]["changed"]["sim"]["ttft_ms"] = 2
    proxy.config_path.write_text(yaml.safe_dump(config))
    watcher = threading.Thread(target=watch, daemon=True)
    with Clients(proxy.port, (chat("same"), chat("changed"))) as clients:
        watcher.start()
        wait_for(lambda: clients.count() >= 100, what="100 requests before the reload")
        assert proxy.reload() == 0
        wait_for(rolled, what="the changed model rolled onto its new settings")
        rolled_at = clients.count()
        clients.stop_when = lambda: clients.count() >= CAP or clients.count() >= max(AT_LEAST, rolled_at + AFTER_RELOAD)
        for thread in clients.threads:
            thread.join(120)
    watching.set()
    watcher.join(60)
    done = clients.done
    failed = [o for _s, _e, o in done if o != 200]
    print(f"\nreload changing one model under {CLIENTS} clients: {len(done)} requests, {len(failed)} failed, "
          f"{rolled_at} sent until the roll ended; fewest READY replicas of the changed model seen "
          f"{min(ready_seen)} over {len(ready_seen)} readings")
    assert failed == [], f"{len(failed)} of {len(done)} failed: {sorted(set(map(str, failed)))}"
    assert len(done) >= AT_LEAST
    assert min(ready_seen) >= 1 and len(ready_seen) > 1
    assert {r["pid"] for r in proxy.admin_model("same")["replicas"]} == same    # adopted as it was
    status, _, events = http("GET", proxy.url + "/v1/admin/events?kind=restart&model=changed")
    assert status == 200 and [e["reason"] for e in events["data"]] == ["settings changed: sim.ttft_ms"] * 2, events


def test_a_reload_with_broken_settings_changes_nothing_and_says_why(proxies) -> None:
    proxy = ProxyProcess({"sim": sim_model()})
    proxies.append(proxy)
    proxy.start()
    replica = proxy.wait_state("sim", "loaded")["replicas"][0]["pid"]
    good = proxy.config_path.read_text()
    broken = yaml.safe_load(good)
    broken["engine"]["models"]["sim"]["target_inflight"] = -1
    proxy.config_path.write_text(yaml.safe_dump(broken))
    assert proxy.proc is not None
    proxy.proc.send_signal(signal.SIGUSR1)
    log = wait_for(lambda: "reload failed: successor pid" in (text := proxy.log_path.read_text()) and text,
                   what="the reload to fail")
    # Why, in the old process's log: the successor's exit status and its own words.
    assert "exited with 2 before it was ready" in log
    assert "engine.models.sim.target_inflight: -1 is less than the minimum of 1" in log.split("reload failed")[1]
    # Nothing changed: the same process serves the same replica, and holds the state folder.
    assert proxy.proc.poll() is None and proxy.lock_owner() == proxy.proc.pid
    status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                           {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200, body
    assert proxy.admin_model("sim")["replicas"][0]["pid"] == replica
    status, _, events = http("GET", proxy.url + "/v1/admin/events?kind=reload")
    assert [e["reason"] for e in events["data"]] == ["failed"] and "exited with 2" in events["data"][0]["message"]
    # A later SIGUSR1 tries again, and with the settings fixed it goes through.
    proxy.config_path.write_text(good)
    assert proxy.reload() == 0
    assert proxy.admin_model("sim")["replicas"][0]["pid"] == replica
    # And the new process reloads in turn (its descriptors were handed over, its stdout is the journal's).
    first = proxy.serving_pid
    proxy.reload()
    assert proxy.serving_pid != first and proxy.admin_model("sim")["replicas"][0]["pid"] == replica
    assert f"reload: took over from pid {first}" in proxy.log_path.read_text()


def test_a_request_during_adoption_waits_for_it_instead_of_503_model_loading(proxies) -> None:
    proxy = ProxyProcess({"sim": sim_model()})
    proxies.append(proxy)
    proxy.start(keep_models=True)
    replica = proxy.wait_state("sim", "loaded")["replicas"][0]["pid"]
    proxy.stop()   # --keep-models: the replica runs on for the next proxy to adopt
    os.kill(replica, signal.SIGSTOP)   # its health check cannot pass: the adoption stays under way
    try:
        proxy.start()
        assert proxy.admin_model("sim")["state"] == "loading"
        answer: list[tuple[int, object]] = []
        request = threading.Thread(target=lambda: answer.append(http(
            "POST", proxy.url + "/v1/chat/completions",
            {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})[::2]))
        request.start()
        # It waits in the model's queue (it used to get 503 model_loading at once)...
        wait_for(lambda: proxy.admin_model("sim")["waiting"] == 1 or answer, what="the request to queue")
        assert answer == [] and proxy.admin_model("sim")["state"] == "loading"
    finally:
        os.kill(replica, signal.SIGCONT)
    request.join(60)
    # ...and is served by the adopted replica once its health check passes.
    assert answer and answer[0][0] == 200, answer
    assert proxy.wait_state("sim", "loaded")["replicas"][0]["pid"] == replica


def test_a_successor_not_ready_in_time_is_stopped_and_a_stop_during_a_reload_stops_it_first(proxies) -> None:
    proxy = ProxyProcess({"sim": sim_model()}, service={"reload_timeout_s": 15})
    proxies.append(proxy)
    proxy.start()
    replica = proxy.wait_state("sim", "loaded")["replicas"][0]["pid"]
    assert proxy.proc is not None
    os.kill(replica, signal.SIGSTOP)   # its health check cannot pass: a successor's adoption never ends
    try:
        proxy.proc.send_signal(signal.SIGUSR1)
        log = wait_for(lambda: "reload failed" in (text := proxy.log_path.read_text()) and text,
                       what="the reload to time out")
        assert "was not ready within service.reload_timeout_s (15s)" in log
        first = int(log.split("reload: successor pid ")[1].split()[0])
        proxy.seen_pids.add(first)
        assert proxy.proc.poll() is None and proxy.lock_owner() == proxy.proc.pid   # it serves on
        # A stop signal during the next reload: the successor is stopped first, then the proxy
        # stops as any stop does (the replica unloaded, supervisord stopped), and exits 0.
        proxy.proc.send_signal(signal.SIGUSR1)
        second = wait_for(lambda: (pids := proxy.log_path.read_text().split("reload: successor pid ")[2:]) and
                          int(pids[0].split()[0]), what="a second successor")
        proxy.seen_pids.add(second)
        wait_for(lambda: f"[successor {second}]" in proxy.log_path.read_text(), what="the successor to start")
        proxy.proc.send_signal(signal.SIGTERM)
    finally:
        os.kill(replica, signal.SIGCONT)
    assert proxy.proc.wait(60) == 0
    log = proxy.log_path.read_text()
    assert f"reload called off by a stop signal: stopping successor pid {second}" in log
    assert log.index("reload called off") < log.index("model sim unloaded (shutdown)")
    assert not pid_alive(second) and not pid_alive(replica)


def test_a_reload_retargets_an_alias_and_fails_no_request(proxies) -> None:
    """docs/routing.md, Aliases and fallbacks: clients that ask for `chat-default` keep asking for it
    while the admin points it at another model; a reload moves it, and no request fails."""
    proxy = ProxyProcess({"old": sim_model(), "new": sim_model()}, engine={"aliases": {"chat-default": "old"}})
    proxies.append(proxy)
    proxy.start()
    for name in ("old", "new"):
        proxy.wait_state(name, "loaded")
    status, headers, _ = http("POST", proxy.url + "/v1/chat/completions", raw=chat("chat-default"))
    assert (status, headers["X-LLM-Pool-Model"]) == (200, "old")
    config = yaml.safe_load(proxy.config_path.read_text())
    config["engine"]["aliases"]["chat-default"] = "new"
    proxy.config_path.write_text(yaml.safe_dump(config))
    with Clients(proxy.port, (chat("chat-default"),)) as clients:
        wait_for(lambda: clients.count() >= 100, what="100 requests before the reload")
        assert proxy.reload() == 0
        reloaded_at = clients.count()
        clients.stop_when = lambda: clients.count() >= reloaded_at + AFTER_RELOAD
        for thread in clients.threads:
            thread.join(120)
    failed = [o for _s, _e, o in clients.done if o != 200]
    assert failed == [], f"{len(failed)} of {len(clients.done)} failed: {sorted(set(map(str, failed)))}"
    status, headers, body = http("POST", proxy.url + "/v1/chat/completions", raw=chat("chat-default"))
    assert (status, headers["X-LLM-Pool-Model"], body["model"]) == (200, "new", "new")
    _, _, listed = http("GET", proxy.url + "/v1/models")
    assert {m["id"]: m.get("alias_of") for m in listed["data"]}["chat-default"] == "new"
