"""Several hosts: placing replicas on other hosts, and a host dying and returning under load.

Three real node supervisords on loopback (`llm-pool node`, each its own inet_http_server port and
password: hosts a, b, c) and the proxy's own managed supervisord (host `local`), driven by one
`llm-pool serve`, all serving sim replicas. Printed:

1. Load time of a replica on this machine (`local`, through the filesystem and the unix socket)
   and on a node (`a`, through the plugin over authenticated XML-RPC), side by side, alternating,
   as the median of --loads admin loads each, and their ratio; then the time to scale a model from
   one replica on host a to two, the second placed on another host.
2. With --clients clients (half of them streaming) sending requests throughout: host b's supervisord and its replicas are
   SIGKILLed. Requests sent, completed and failed (by status and error code, or the client's
   exception) from the kill until b's replica is back, and how many were running on b when it died
   (the ones no proxy can save); how long until the replica left rotation; how long until b,
   started again, has its replica back in rotation (restarted there from the program file the node
   kept).
3. Still under load: host c's supervisord is frozen (SIGSTOP, a partition: its replica runs on),
   until its replica leaves rotation (supervisor.rpc_timeout_s), then thawed: the time until the
   replica is back in rotation, adopted (the same PID, no restart), and the requests failed meanwhile.

No figure is a pass mark: it prints what it measured and fails only when a step does not happen.

    .venv/bin/python tests/bench/bench_hosts.py [--loads 5] [--clients 8]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not tests/proxy

from helpers import Node, ProxyProcess, http, sim_model, wait_for  # noqa: E402

CHAT = [{"role": "user", "content": "Hello"}]
MAX_TOKENS = 32
RPC_TIMEOUT_S = 1.0
DEADLINE_S = 120.0


def replicas_on(proxy: ProxyProcess, model: str, host: str) -> list[dict[str, Any]]:
    return [r for r in proxy.admin_model(model)["replicas"] if r["host"] == host]


def timed_load(proxy: ProxyProcess, model: str) -> float:
    started = time.monotonic()
    status, _, body = http("POST", f"{proxy.url}/v1/admin/models/{model}/load", body={})
    took = time.monotonic() - started
    assert status == 200, body
    status, _, body = http("POST", f"{proxy.url}/v1/admin/models/{model}/unload", body={})
    assert status == 200, body
    proxy.wait_state(model, "unloaded")
    return took


async def one(session: aiohttp.ClientSession, url: str, stream: bool) -> str:
    """'ok', or what the client saw instead: a status and error code, an error event in the stream,
    or the exception's name; prefixed with the kind of request."""
    kind = "streamed" if stream else "plain"
    try:
        async with session.post(url + "/v1/chat/completions",
                                json={"model": "m", "messages": CHAT, "max_tokens": MAX_TOKENS,
                                      "stream": stream}) as resp:
            if resp.status != 200:
                body = await resp.json(content_type=None)
                return f"{kind} {resp.status} {(body.get('error') or {}).get('code')}"
            text = (await resp.read()).decode(errors="replace")
            if stream and ("[DONE]" not in text or "event: error" in text):
                return f"{kind} stream error"
            return "ok"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return f"{kind} {type(exc).__name__}"


class Load:
    """Clients sending requests in a loop; each outcome is kept with the time it was sent."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.clients = clients
        self.outcomes: list[tuple[float, str, float]] = []   # (sent at, outcome, seconds)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        # Half the clients stream: a stream cut mid-way is lost, a request not yet answered may be sent again.
        self._tasks = [asyncio.create_task(self._client(i % 2 == 1)) for i in range(self.clients)]

    async def _client(self, stream: bool) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            while not self._stop.is_set():
                sent = time.monotonic()
                what = await one(session, self.url, stream)
                self.outcomes.append((sent, what, time.monotonic() - sent))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def between(self, start: float, end: float) -> Counter[str]:
        # Every request that was running at some moment of [start, end): sent before its end,
        # answered after its start (those running when a host died included).
        return Counter(what for at, what, took in self.outcomes if at < end and at + took >= start)

    def latency_ms(self, start: float, end: float) -> float:
        return 1000 * statistics.median([s for at, what, s in self.outcomes if at < end and at + s >= start
                                         and what == "ok"]
                                        or [0.0])


def describe(counts: Counter[str]) -> str:
    failed = {k: n for k, n in sorted(counts.items()) if k != "ok"}
    return (f"sent {sum(counts.values())}, completed {counts.get('ok', 0)}, failed {sum(failed.values())}"
            + (f" ({', '.join(f'{k}: {n}' for k, n in failed.items())})" if failed else ""))


async def until(predicate: Any, what: str) -> float:
    """Seconds until `predicate()` (run in a thread: it calls the admin API) holds."""
    started = time.monotonic()
    await asyncio.to_thread(wait_for, predicate, DEADLINE_S, what)
    return time.monotonic() - started


def start_pool(nodes: list[Node]) -> ProxyProcess:
    proxy = ProxyProcess({
        "here": sim_model(hosts=["local"], enabled=False),
        "there": sim_model(hosts=["a"], enabled=False),
        # One replica on a at start; scaled to two below. Three at most, one per node.
        "m": sim_model(hosts=["a", "b", "c"], replica_max=3,
                       sim={"ttft_ms": 5, "decode_tokens_per_s": 200}),
    })
    proxy.config["supervisor"].update(rpc_timeout_s=RPC_TIMEOUT_S, hosts={
        n.name: {"url": n.url, "password_env": f"NODE_{n.name.upper()}_PASSWORD"} for n in nodes})
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.env = {f"NODE_{n.name.upper()}_PASSWORD": n.password for n in nodes}
    return proxy.start()


async def scenario(proxy: ProxyProcess, nodes: dict[str, Node], loads: int, clients: int) -> None:
    # 1. Placing and loading: this machine and a node, alternating.
    here, there = [], []
    for _ in range(loads):
        here.append(await asyncio.to_thread(timed_load, proxy, "here"))
        there.append(await asyncio.to_thread(timed_load, proxy, "there"))
    h, t = statistics.median(here), statistics.median(there)
    print(f"load of one sim replica, median of {loads}: local {h * 1000:.0f} ms, node a {t * 1000:.0f} ms "
          f"(node/local {t / h:.2f}x)")
    await asyncio.to_thread(proxy.wait_replicas_ready, "m", 1, DEADLINE_S)
    (first,) = proxy.admin_model("m")["replicas"]
    started = time.monotonic()
    status, _, body = await asyncio.to_thread(http, "POST", f"{proxy.url}/v1/admin/models/m/scale",
                                              body={"replicas": 3})
    assert status == 200, body
    model = await asyncio.to_thread(proxy.wait_replicas_ready, "m", 3, DEADLINE_S)
    placed = {r["host"] for r in model["replicas"]}
    print(f"scale m from 1 replica (host {first['host']}) to 3: {(time.monotonic() - started) * 1000:.0f} ms, "
          f"placed on hosts {', '.join(sorted(placed))}")
    assert placed == {"a", "b", "c"}, model
    for node in nodes.values():
        node.remember()

    load = Load(proxy.url, clients)
    load.start()
    try:
        began = time.monotonic()
        await asyncio.sleep(2.0)   # traffic on every replica before the kill
        steady = load.between(began, time.monotonic())
        print(f"steady load, {clients} clients on 3 replicas (a, b, c) for 2 s: {describe(steady)}, "
              f"median latency {load.latency_ms(began, time.monotonic()):.0f} ms")
        # 2. Host b dies: its supervisord and its replicas, SIGKILL.
        (on_b,) = replicas_on(proxy, "m", "b")
        running = on_b["inflight"]
        killed = time.monotonic()
        nodes["b"].kill_with_replicas()
        out = await until(lambda: [r["state"] for r in replicas_on(proxy, "m", "b")] != ["ready"],
                          "b's replica to leave rotation")
        await asyncio.sleep(1.0)
        nodes["b"].start()
        back = await until(lambda: [r["state"] for r in replicas_on(proxy, "m", "b")] == ["ready"],
                           "b's replica back in rotation")
        done = time.monotonic()
        (again,) = replicas_on(proxy, "m", "b")
        print(f"host b killed (supervisord and replicas, SIGKILL) under load from {clients} clients: "
              f"{running} request(s) were running on b; its replica left rotation after {out * 1000:.0f} ms")
        print(f"  requests running at the kill or sent until b was back: {describe(load.between(killed, done))}")
        print(f"  b started again: its replica back in rotation {back * 1000:.0f} ms after `llm-pool node` was "
              f"run (restarted from the kept program file: pid {on_b['pid']} -> {again['pid']})")
        await asyncio.sleep(1.0)

        # 3. Host c is partitioned (frozen), then returns: its replica is adopted.
        (on_c,) = replicas_on(proxy, "m", "c")
        node_c = nodes["c"]
        assert node_c.proc is not None
        frozen = time.monotonic()
        os.kill(node_c.proc.pid, signal.SIGSTOP)
        try:
            out = await until(lambda: [r["state"] for r in replicas_on(proxy, "m", "c")] != ["ready"],
                              "c's replica to leave rotation")
        finally:
            os.kill(node_c.proc.pid, signal.SIGCONT)
        back = await until(lambda: [r["state"] for r in replicas_on(proxy, "m", "c")] == ["ready"],
                           "c's replica back in rotation")
        done = time.monotonic()
        (after,) = replicas_on(proxy, "m", "c")
        how = "adopted: same pid, no restart" if after["pid"] == on_c["pid"] and \
            after["restarts"] == on_c["restarts"] else f"restarted: pid {on_c['pid']} -> {after['pid']}"
        print(f"host c frozen (SIGSTOP, rpc_timeout_s {RPC_TIMEOUT_S:g}): its replica left rotation after "
              f"{out * 1000:.0f} ms; thawed, back in rotation after {back * 1000:.0f} ms ({how})")
        print(f"  requests running at the freeze or sent until c was back: {describe(load.between(frozen, done))}")
    finally:
        await load.stop()
    print(f"all requests: {describe(load.between(0.0, time.monotonic()))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", type=int, default=5, help="admin loads per host for the load-time medians")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients during the host failures")
    args = parser.parse_args()
    nodes = {name: Node(name, f"bench-{name}-password") for name in ("a", "b", "c")}
    proxy: ProxyProcess | None = None
    try:
        for node in nodes.values():
            node.start()
        proxy = start_pool(list(nodes.values()))
        asyncio.run(scenario(proxy, nodes, args.loads, args.clients))
    finally:
        if proxy is not None:
            proxy.stop()
            proxy.cleanup()
        for node in nodes.values():
            node.stop()


if __name__ == "__main__":
    main()
