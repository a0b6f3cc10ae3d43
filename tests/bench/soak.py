"""Soak: mixed traffic with faults through the real proxy and supervisord for a long time (30
minutes by default), looking for leaks.

Two sim models (one with a fault rate, one that is loaded, scaled and unloaded by an admin now and
then) take streamed and non-streamed requests on both APIs, some from clients that leave early; a
replica is SIGKILLed every so often. Every `--sample-s` (a minute by default) the proxy's RSS, its
open file descriptors, its asyncio tasks (from /metrics: llm_pool_event_loop_tasks when exported,
else not shown) and supervisord's RSS are sampled. At the end each is fitted with a straight line
against the requests served and printed as growth per thousand requests: a leak shows as a slope
that does not fall towards 0 as the run gets longer.

    .venv/bin/python tests/bench/soak.py [--minutes 30] [--sample-s 60] [--clients 16]
    .venv/bin/python tests/bench/soak.py --minutes 2 --sample-s 15      # a short run
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not tests/proxy

from bench_chaos import error_code, request_for  # noqa: E402
from helpers import ProxyProcess  # noqa: E402

FAULTY, SWAPPED = "chaos", "swapped"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def start() -> ProxyProcess:
    sim = {"max_seqs": 8, "decode_tokens_per_s": 400, "ttft_ms": 5}
    models = {FAULTY: {"backend": "sim", "enabled": True, "replicas": 2, "replica_max": 2, "target_inflight": 8,
                       "sim": {**sim, "fault_rate": 0.03}},
              SWAPPED: {"backend": "sim", "enabled": True, "replicas": 1, "replica_max": 2, "target_inflight": 8,
                        "sim": sim}}
    service = {"log_level": "warning", "first_byte_timeout_s": 10, "stream_idle_timeout_s": 5,
               "health_interval_s": 0.5, "health_timeout_s": 1, "eject_after_failures": 5, "eject_base_s": 5}
    fairness = {"max_queue_wait_s": 15, "max_pending_per_key": 1000, "max_pending_per_executor": 2000}
    proxy = ProxyProcess(models, service=service, engine={"fairness": fairness})
    proxy.start()
    proxy.wait_replicas_ready(FAULTY, 2, timeout=120)
    proxy.wait_replicas_ready(SWAPPED, 1, timeout=120)
    return proxy


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random, outcomes: Counter[str]) -> None:
    path, body, stream = request_for(rng)
    body = {**body, "model": rng.choice([FAULTY, FAULTY, SWAPPED]), "fairness_key": f"k{rng.randint(0, 50)}"}
    leave = rng.random() < 0.05
    try:
        async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            if leave:
                outcomes["left"] += 1
                return
            raw = await resp.read()
            outcomes["ok" if resp.status == 200 else "failed:" + error_code(raw)] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        outcomes[f"failed:connection-{type(exc).__name__}"] += 1


async def admin(proxy: ProxyProcess, session: aiohttp.ClientSession, rng: random.Random, stop: asyncio.Event,
                outcomes: Counter[str]) -> None:
    """Now and then: scale the swapped model, unload and load it again, or SIGKILL a replica."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(5, 15))
            return
        except asyncio.TimeoutError:
            pass
        action = rng.choice(["scale", "reload", "kill"])
        base = f"{proxy.url}/v1/admin/models/{SWAPPED}"
        if action == "scale":
            async with session.post(base + "/scale", json={"replicas": rng.choice([1, 2])}) as resp:
                outcomes[f"admin-scale:{resp.status}"] += 1
        elif action == "reload":
            async with session.post(base + "/unload", json={}) as resp:
                outcomes[f"admin-unload:{resp.status}"] += 1
            async with session.post(base + "/load", json={}) as resp:
                outcomes[f"admin-load:{resp.status}"] += 1
        else:
            async with session.get(proxy.url + "/v1/admin/models") as resp:
                rows = (await resp.json())["data"]
            pids = [r["pid"] for m in rows if m["id"] == FAULTY for r in m["replicas"] if r["pid"]]
            if len(pids) > 1:
                pid = rng.choice(pids)
                proxy.seen_pids.add(pid)
                os.kill(pid, signal.SIGKILL)
                outcomes["replica-sigkill"] += 1


def supervisord_pid(proxy: ProxyProcess) -> int | None:
    pidfile = proxy.state_dir / "supervisord.pid"
    return int(pidfile.read_text().strip()) if pidfile.exists() else None


async def tasks_of(session: aiohttp.ClientSession, url: str) -> float | None:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("llm_pool_event_loop_tasks "):
            return float(line.split()[1])
    return None


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares growth of ys per unit of xs."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


async def soak(proxy: ProxyProcess, minutes: float, sample_s: float, clients: int, seed: int) -> None:
    assert proxy.proc is not None
    proxy_pid, sup_pid = proxy.proc.pid, supervisord_pid(proxy)
    outcomes: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while not stop.is_set():
                await one(session, proxy.url, rng, outcomes)

        async def sample() -> None:
            samples.append({"t": time.monotonic(), "requests": sum(v for k, v in outcomes.items()
                                                                   if k == "ok" or k.startswith("failed:")),
                            "rss": rss_mb(proxy_pid), "fds": open_fds(proxy_pid),
                            "tasks": await tasks_of(session, proxy.url),
                            "sup_rss": rss_mb(sup_pid) if sup_pid else 0.0})
            s = samples[-1]
            print(f"  {s['t'] - samples[0]['t']:6.0f} s  {s['requests']:7d} requests  proxy RSS {s['rss']:6.1f} MB  "
                  f"fds {s['fds']:4d}  tasks {s['tasks'] if s['tasks'] is not None else '-'}  "
                  f"supervisord RSS {s['sup_rss']:5.1f} MB", flush=True)

        await sample()
        workers = [asyncio.create_task(client(i)) for i in range(clients)]
        chaos = asyncio.create_task(admin(proxy, session, random.Random(seed), stop, outcomes))
        deadline = time.monotonic() + minutes * 60
        while time.monotonic() < deadline:
            await asyncio.sleep(min(sample_s, max(0.0, deadline - time.monotonic())))
            await sample()
        stop.set()
        await asyncio.gather(chaos, *workers)
    # The first sample is before any traffic: warm-up growth (caches, pools) is not a leak.
    steady = samples[1:] if len(samples) > 2 else samples
    per_k = [s["requests"] / 1000 for s in steady]
    failed = {k.split(":", 1)[1]: v for k, v in outcomes.items() if k.startswith("failed:")}
    print(f"soak: {minutes:g} min, {clients} clients, {samples[-1]['requests']} requests: ok {outcomes['ok']}, "
          f"failed {sum(failed.values())} {dict(sorted(failed.items()))}, left {outcomes['left']}")
    print("  admin/faults: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())
                                         if k.startswith(("admin", "replica"))))
    for name, unit in (("rss", "MB"), ("fds", "fds"), ("tasks", "tasks"), ("sup_rss", "MB")):
        ys = [s[name] for s in steady]
        if any(y is None for y in ys):
            continue
        label = {"rss": "proxy RSS", "fds": "proxy open fds", "tasks": "proxy asyncio tasks",
                 "sup_rss": "supervisord RSS"}[name]
        print(f"  {label:20s} {ys[0]:8.1f} -> {ys[-1]:8.1f} {unit}; slope {slope(per_k, ys):+.3f} {unit} per 1000 "
              "requests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long (default 30)")
    parser.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples (default 60)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    proxy = start()
    try:
        asyncio.run(soak(proxy, args.minutes, args.sample_s, args.clients, args.seed))
    finally:
        survivors = proxy.cleanup()
    print(f"  processes left behind: {survivors or 'none'}")


if __name__ == "__main__":
    main()
