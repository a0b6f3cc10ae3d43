"""Test helpers that start real processes: the proxy (`llm-pool serve`) with its supervisord.

Everything started here is stopped here, by PID: `ProxyProcess.stop` ends the proxy, which
unloads its models and shuts supervisord down, and then checks that every PID it saw is gone,
killing any survivor so that no test leaves a process behind.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import xmlrpc.client
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from proxy.supervisord.managed import pid_alive

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 60.0


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# The tests' ports come from below the kernel's ephemeral range (32768-60999 on Linux) and above
# the shipped supervisor.port_range: a port found free inside the ephemeral range can be taken by
# any outgoing connection, or an engine's own bind to port 0, before the server meant for it binds
# it ("address already in use", seen in CI with vLLM).
TEST_PORTS = (20000, _ephemeral_low())
_PICK = random.Random()


def free_port() -> int:
    """A port that is free now, outside the ephemeral range."""
    return free_port_range(1)[0]


def free_port_range(size: int = 20) -> list[int]:
    """A run of `size` ports that are free now, for one test's model servers: [first, last]."""
    while True:
        start = _PICK.randrange(TEST_PORTS[0], TEST_PORTS[1] - size)
        ports = list(range(start, start + size))
        if all(_bindable(p) for p in ports):
            return [ports[0], ports[-1]]


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for(predicate: Callable[[], Any], timeout: float = DEADLINE_S, what: str = "condition") -> Any:
    """Poll until `predicate()` is truthy and return it; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


async def until_healthy(session: Any, url: str, timeout: float = DEADLINE_S) -> None:
    """Poll a shim's /health until 200, bounded: one that never loads fails the test, not hangs it."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        async with session.get(url + "/health") as resp:
            if resp.status == 200:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} not healthy after {timeout:.0f}s")
        await asyncio.sleep(0.01)


def http(method: str, url: str, body: Any = None, raw: bytes | None = None,
         headers: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, dict[str, str], Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            payload = resp.read()
            status, hdrs = resp.status, dict(resp.headers)
    except urllib.error.HTTPError as err:
        payload, status, hdrs = err.read(), err.code, dict(err.headers)
    try:
        return status, hdrs, json.loads(payload)
    except ValueError:
        return status, hdrs, payload


class ProxyProcess:
    """`llm-pool serve` on loopback with a config of the test's making, in its own state dir."""

    def __init__(self, models: dict[str, dict[str, Any]], service: dict[str, Any] | None = None,
                 state_dir: Path | None = None, engine: dict[str, Any] | None = None) -> None:
        # Short folder: the supervisord socket lives in it and unix socket paths are limited.
        self.state_dir = state_dir or Path(tempfile.mkdtemp(prefix="lp-", dir="/tmp"))
        self.port = free_port()
        self.config_path = self.state_dir / "pool.yaml"
        self.config = {
            "service": {"host": "127.0.0.1", "port": self.port, "state_dir": str(self.state_dir),
                        "log_level": "info", **(service or {})},
            "supervisor": {"port_range": free_port_range(), "poll_interval_s": 0.1, "stopwaitsecs": 5},
            "engine": {"models": models, **(engine or {})},
        }
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.proc: subprocess.Popen[bytes] | None = None
        # After a reload (SIGUSR1), the process that took over: not a child of the test's.
        self.successor: int | None = None
        self.env: dict[str, str] = {}   # extra environment for the proxy process
        self.admin_headers: dict[str, str] = {}   # the admin token, where service.admin_token_env sets one
        self.seen_pids: set[int] = set()
        self.log_path = self.state_dir / "proxy.log"
        self.cwd = REPO   # the source tree whose proxy runs (a benchmark may run another's beside it)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        """Where the admin API answers: service.admin_port's listener where one is set."""
        service = self.config["service"]
        if service.get("admin_port"):
            return f"http://{service.get('admin_host') or service['host']}:{service['admin_port']}"
        return self.url

    @property
    def supervisord_conf(self) -> Path:
        return self.state_dir / "supervisord.conf"

    def start(self, keep_models: bool = False, serve_args: tuple[str, ...] = ()) -> "ProxyProcess":
        """`serve_args`: more of `serve`'s options (`--port N`)."""
        argv = [sys.executable, "-m", "proxy.cli", "--config", str(self.config_path), "serve", *serve_args]
        if keep_models:
            argv.append("--keep-models")
        env = {**os.environ, "LLM_POOL_LOCAL_SETTINGS_PATH": str(self.state_dir / "no-local.yaml"), **self.env}
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        wait_for(self._answers, what=f"the proxy on {self.url} (log: {self.log_path})")
        self._remember_supervisord()
        self._remember_workers()
        return self

    def with_tenants(self, tenants: dict[str, Any], env: dict[str, str], admin_token: str) -> "ProxyProcess":
        """Before `start`: `tenants`, their keys' variables in `env`, and an admin token (which the
        admin API then asks for: `admin_headers`)."""
        self.config["service"]["admin_token_env"] = "ADMIN_TOKEN_VAR"
        self.config["tenants"] = tenants
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.env = {**self.env, **env, "ADMIN_TOKEN_VAR": admin_token}
        self.admin_headers = {"Authorization": f"Bearer {admin_token}"}
        return self

    def start_loaded(self, *models: str) -> "ProxyProcess":
        """`start`, then wait until each of `models` is loaded; stopped again if either fails."""
        try:
            self.start()
            for name in models:
                self.wait_state(name, "loaded")
        except BaseException:
            self.cleanup()
            raise
        return self

    def processes(self) -> list[dict[str, Any]]:
        """GET /v1/admin/processes: the serving process and its workers."""
        status, _, body = http("GET", self.admin_url + "/v1/admin/processes", headers=self.admin_headers)
        assert status == 200, body
        return list(body["data"])

    def worker_pids(self) -> tuple[int, ...]:
        """service.workers > 1: the PIDs of the workers serving now."""
        return tuple(p["pid"] for p in self.processes() if p["role"] == "worker" and p["pid"] is not None)

    def _remember_workers(self) -> None:
        """service.workers > 1: the workers' PIDs, for cleanup to check (their controller stops them)."""
        if self.config["service"].get("workers", 1) > 1:
            with contextlib.suppress(OSError, AssertionError):
                self.seen_pids.update(self.worker_pids())

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"proxy exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
        try:
            return http("GET", self.url + "/health")[0] == 200
        except OSError:
            return False

    def _remember_supervisord(self) -> None:
        pidfile = self.state_dir / "supervisord.pid"
        if pidfile.exists():
            self.seen_pids.add(int(pidfile.read_text().strip()))

    def admin_model(self, name: str) -> dict[str, Any]:
        status, _, body = http("GET", self.admin_url + "/v1/admin/models", headers=self.admin_headers)
        assert status == 200, body
        (model,) = [m for m in body["data"] if m["id"] == name]
        for replica in model["replicas"]:
            if replica["pid"]:
                self.seen_pids.add(replica["pid"])
        return model

    def wait_state(self, name: str, state: str, timeout: float = DEADLINE_S) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            model = self.admin_model(name)
            if model["state"] == "failed" and state != "failed":
                raise AssertionError(f"{name} failed: {model['last_error']}")
            return model if model["state"] == state else None
        return wait_for(reached, timeout, what=f"{name} to be {state}")

    def wait_replicas_ready(self, name: str, count: int, timeout: float = DEADLINE_S) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            model = self.admin_model(name)
            n = sum(1 for r in model["replicas"] if r["state"] == "ready")
            return model if model["state"] == "loaded" and n == count else None
        try:
            return wait_for(ready, timeout, what=f"{count} ready replica(s) of {name}")
        except AssertionError as exc:
            # What each replica was doing instead is what a failure here needs to be understood.
            replicas = [(r["index"], r["state"], r.get("last_error")) for r in self.admin_model(name)["replicas"]]
            raise AssertionError(f"{exc}; replicas (index, state, last error): {replicas}") from None

    def supervisorctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c", str(self.supervisord_conf),
                               *args], capture_output=True, text=True, timeout=60)

    @property
    def serving_pid(self) -> int:
        """The PID of the process that serves now: the one started, or its successor after a reload."""
        if self.successor is not None:
            return self.successor
        assert self.proc is not None
        return self.proc.pid

    def lock_owner(self) -> int | None:
        """The PID the state folder's lock file names (the proxy that holds it writes its own)."""
        try:
            return int((self.state_dir / "serve.lock").read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def reload(self, timeout: float = DEADLINE_S) -> int | None:
        """SIGUSR1 to the serving process; return once its successor took over (the lock names it)
        and the old process has exited, with the old one's exit status when it is this test's child."""
        old = self.serving_pid
        os.kill(old, signal.SIGUSR1)
        new = wait_for(lambda: (owner := self.lock_owner()) not in (None, old) and owner, timeout,
                       what=f"a successor to take over from pid {old} (log: {self.log_path})")
        self.seen_pids.add(new)
        code = None
        if self.proc is not None and self.proc.pid == old:
            code = self.proc.wait(timeout)
        else:
            wait_for(lambda: not pid_alive(old), timeout, what=f"pid {old} to exit after its reload")
        self.successor = new
        return code

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM the proxy and wait for it; it stops its models and supervisord unless kept."""
        self._remember_supervisord()
        if self.successor is not None or (self.proc is not None and self.proc.poll() is None):
            self._remember_workers()   # a successor's too: it started its own
        if self.successor is not None:
            # Not our child: waited for by its PID.
            pid, self.successor = self.successor, None
            if pid_alive(pid):
                os.kill(pid, signal.SIGTERM)
                try:
                    wait_for(lambda: not pid_alive(pid), timeout, what=f"pid {pid} to stop")
                except AssertionError:
                    os.kill(pid, signal.SIGKILL)
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.proc = None

    def cleanup(self) -> list[int]:
        """Stop everything this proxy started, by PID; return the PIDs that had survived."""
        self.stop()
        self._remember_supervisord()
        survivors = [pid for pid in self.seen_pids if pid_alive(pid)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        return survivors


def supervisord_shows_running(status: Callable[[], str], program: str) -> str:
    """supervisorctl's status text once it shows `program` RUNNING. A replica serves as soon as its
    health check passes, which may be before supervisord's startsecs are over (STARTING until then)."""
    def shown() -> str | None:
        text = status()
        line = next((row for row in text.splitlines() if row.split()[:1] == [program]), "")
        return text if "RUNNING" in line else None
    return wait_for(shown, what=f"supervisorctl to show {program} RUNNING")


def gauge(text: str, name: str) -> float:
    """The value of metric `name` (one model label) in Prometheus text; fails the test if absent."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


async def metrics(session: Any, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


async def wait_metric(session: Any, url: str, name: str, want: Callable[[float], Any],
                      timeout: float = DEADLINE_S) -> str:
    """Poll `url`/metrics until `want(value of name)`, and return that text; bounded by `timeout`."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        text = await metrics(session, url)
        if want(gauge(text, name)):
            return text
        assert time.monotonic() < deadline, f"{name} never met the condition: {text}"
        await asyncio.sleep(0.01)


def ready_runtime(config: Any, count: int) -> Any:
    """A model runtime with `count` READY sim replicas and no processes behind them (ports 18000 +
    index, never contacted), for the decisions that only read replica states."""
    from launchers import sim
    from proxy.upstream.reach import ProgramReach
    from proxy.lifecycle.state.replicas import Replica, ReplicaState
    from proxy.lifecycle.state.runtime import ModelRuntime

    runtime = ModelRuntime(config=config)
    for i in range(count):
        spec = sim.launch(config, i, 18000 + i, 5, {})
        replica = Replica(model=config.name, index=i, spec=spec, fullname=f"g:r{i}", reach=ProgramReach(spec))
        runtime.replicas.append(replica)
        runtime.set_replica_state(replica, ReplicaState.STARTING)
        runtime.set_replica_state(replica, ReplicaState.READY)
    return runtime


class Load:
    """Client threads sending requests one after another until stopped; every outcome is kept."""

    def __init__(self, proxy: ProxyProcess, model: str, threads: int = 3, max_tokens: int = 20) -> None:
        self.proxy, self.model, self.max_tokens = proxy, model, max_tokens
        self.stopping = threading.Event()
        self.ok = 0
        self.failures: list[tuple[int, Any]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                status, _, body = http("POST", self.proxy.url + "/v1/chat/completions",
                                       {"model": self.model, "max_tokens": self.max_tokens,
                                        "messages": [{"role": "user", "content": "hi"}]})
            except OSError as exc:
                status, body = 0, repr(exc)
            with self.lock:
                if status == 200:
                    self.ok += 1
                else:
                    self.failures.append((status, body))

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        wait_for(lambda: self.ok >= 3 or self.failures, what="the first answers")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(120)

    def answered(self) -> int:
        with self.lock:
            return self.ok


def scale(proxy: ProxyProcess, name: str, replicas: Any) -> tuple[int, Any, float]:
    started = time.monotonic()
    status, _, body = http("POST", proxy.url + f"/v1/admin/models/{name}/scale", {"replicas": replicas})
    return status, body, time.monotonic() - started


def pids(model: dict[str, Any]) -> list[int]:
    return [r["pid"] for r in model["replicas"]]


def program_files(proxy: ProxyProcess) -> list[str]:
    return sorted(p.name for p in (proxy.state_dir / "programs").glob("*.conf"))


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

    def kill_with_replicas(self) -> None:
        """The whole host dies: its supervisord and every process it runs, SIGKILL."""
        running = [p["pid"] for p in self.rpc().supervisor.getAllProcessInfo() if p["pid"]]
        self.pids.update(running)
        self.kill()
        for pid in running:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)

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


def node_pool(nodes: list["Node"], models: dict[str, Any], budgets: dict[str, float] | None = None,
              **supervisor: Any) -> ProxyProcess:
    """One `llm-pool serve` in mode hosts over these nodes (each password in its own variable);
    `supervisor`: more of its supervisor settings (rpc_timeout_s, say)."""
    proxy = ProxyProcess(models)
    proxy.config["supervisor"].update(supervisor, mode="hosts", hosts={
        n.name: {"url": n.url, "password_env": f"NODE_{n.name.upper()}_PASSWORD",
                 **({"cpu_budget_mib": budgets[n.name]} if budgets and n.name in budgets else {})} for n in nodes})
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.env = {f"NODE_{n.name.upper()}_PASSWORD": n.password for n in nodes}
    return proxy


def sim_model(**fields: Any) -> dict[str, Any]:
    """A fast simulated model (backend sim) with these settings."""
    return {"backend": "sim", "enabled": True, "target_inflight": 4, "sim": {"ttft_ms": 1, "decode_tokens_per_s": 2000},
            **fields}


@contextlib.contextmanager
def status_page(browser: Any, url: str, width: int, height: int) -> Iterator[Any]:
    """A tab on the status page at `url` in a window of that size; the test fails after it if the
    page's script threw."""
    context = browser.new_context(viewport={"width": width, "height": height})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.goto(url + "/ui")
    yield tab
    context.close()
    assert not errors, f"the page's script failed: {errors}"


def tiny_png(width: int = 8, height: int = 8) -> bytes:
    """An RGB PNG of a colour gradient, written by hand (8-bit truecolour, no filter)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + b"".join(bytes((x * 32 % 256, y * 32 % 256, 128)) for x in range(width))
                    for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
