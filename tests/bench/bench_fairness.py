"""Fairness benchmarks through the real proxy, supervisord and the simulated engine.

Two proxies run side by side, one with the fairness scheduler and one with plain FIFO
(`engine.fairness.mode: fifo`), each with its own sim replica; only one is driven at a time.

(a) two saturating keys with weights 1:1 and 2:1: each key's share of running time;
(b) the interactive case (one sim replica, 32 sequences, target_inflight 32, 50 tokens/s per
    sequence; `batch` keeps 500 requests of 256 tokens outstanding; `ui` sends 32-token requests one
    after another): ui p99 under the flood / ui p99 idle, with the scheduler (with and without
    `anticipation_ms`) and with FIFO;
(c) a lone key's throughput with the scheduler vs FIFO, alternating rounds;
(d) the scheduler alone (no processes): cost of one scheduling event with 1, 100, 1,000 and
    10,000 active keys.

    .venv/bin/python tests/bench/bench_fairness.py [--quick] [--scheduler-only]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not an installed copy

from helpers import ProxyProcess  # noqa: E402

from proxy.fairness import FairnessPolicy, FairScheduler  # noqa: E402


def sim(max_seqs: int, decode: float) -> dict[str, Any]:
    return {"backend": "sim", "target_inflight": max_seqs, "enabled": True,
            "sim": {"max_seqs": max_seqs, "decode_tokens_per_s": decode, "ttft_ms": 5, "prefix_cache": False}}


def start(models: dict[str, Any], mode: str, weights: dict[str, float] | None = None,
          anticipation_ms: float = 0) -> ProxyProcess:
    fairness = {"mode": mode, "max_pending_per_key": 1000, "max_pending_per_executor": 2000,
                "soft_max_inflight_per_key": 1, "weights": weights or {}, "anticipation_ms": anticipation_ms}
    proxy = ProxyProcess(models, service={"log_level": "warning"}, engine={"fairness": fairness})
    proxy.start()
    for name in models:
        proxy.wait_state(name, "loaded")
    return proxy


async def call(session: aiohttp.ClientSession, url: str, model: str, key: str, tokens: int) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": tokens,
            "fairness_key": key}
    start = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{key}: HTTP {resp.status}")
    return time.perf_counter() - start


async def closed_loop(session: aiohttp.ClientSession, url: str, model: str, key: str, tokens: int,
                      workers: int, stop: asyncio.Event, done: list[float]) -> None:
    async def worker() -> None:
        while not stop.is_set():
            await call(session, url, model, key, tokens)
            done.append(time.perf_counter())
    await asyncio.gather(*(worker() for _ in range(workers)))


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def shares(proxy: ProxyProcess, seconds: float) -> dict[str, float]:
    """(a) Completions of identical requests in a window after warm-up: the running-time share."""
    stop = asyncio.Event()
    done: dict[str, list[float]] = {"a": [], "b": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        loops = [asyncio.create_task(closed_loop(session, proxy.url, "sim", k, 40, 24, stop, done[k])) for k in done]
        await asyncio.sleep(2)
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        t1 = time.perf_counter()
        stop.set()
        await asyncio.gather(*loops)
    counted = {k: sum(1 for t in v if t0 <= t < t1) for k, v in done.items()}
    total = sum(counted.values())
    return {k: n / total for k, n in counted.items()}


async def interactive(proxy: ProxyProcess, ui_requests: int, flood: bool) -> list[float]:
    """(b) ui latencies, one request after another, optionally under the batch flood."""
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        loop = asyncio.create_task(closed_loop(session, proxy.url, "big", "batch", 256, 500, stop, [])) if flood else None
        if flood:
            while proxy.admin_model("big")["waiting"] < 400:
                await asyncio.sleep(0.2)
        latencies = [await call(session, proxy.url, "big", "ui", 32) for _ in range(ui_requests)]
        stop.set()
        if loop is not None:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
    return latencies


async def throughput(proxy: ProxyProcess, seconds: float) -> float:
    """(c) Requests per second of one saturating key."""
    stop = asyncio.Event()
    done: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        loop = asyncio.create_task(closed_loop(session, proxy.url, "sim", "solo", 20, 16, stop, done))
        await asyncio.sleep(1)
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        t1 = time.perf_counter()
        stop.set()
        await loop
    return sum(1 for t in done if t0 <= t < t1) / (t1 - t0)


def scheduler_event_cost(keys: int, scheduler: type = FairScheduler, policy: type = FairnessPolicy,
                         budget_s: float = 0.5) -> tuple[float, float]:
    """(d) Microseconds per event (a `done` that starts the next request, then the `submit` that keeps
    its key active) with `keys` active keys, each with two requests in, 64 slots; and the setup time."""
    now = [1000.0]
    sched = scheduler(policy(max_pending_per_key=10, max_pending_per_executor=10**7), lambda: now[0])
    sched.set_capacity(64)
    t0 = time.perf_counter()
    running: list[Any] = []
    for i in range(keys):
        for j in range(2):
            running += sched.submit((i, j), f"key-{i}")
    setup = time.perf_counter() - t0
    events, n = 0, 2
    head = 0
    t0 = time.perf_counter()
    while True:
        for _ in range(100):
            now[0] += 0.001
            finished = running[head]
            head += 1
            running += sched.done(finished)
            running += sched.submit((finished[0], n), f"key-{finished[0]}")
            n += 1
        events += 200
        spent = time.perf_counter() - t0
        if spent >= budget_s:
            return spent / events * 1e6, setup


def scheduler_costs(key_counts: tuple[int, ...] = (1, 100, 1000, 10_000)) -> None:
    print("(d) scheduler cost per event (done + submit, 64 slots, 2 requests per key), pure Python, no I/O")
    for keys in key_counts:
        cost, setup = scheduler_event_cost(keys)
        print(f"  {keys:>6} active keys: {cost:8.2f} us/event   (setup {setup:.2f}s)")


async def main(quick: bool) -> None:
    window = 8 if quick else 20
    print("(a) two saturating keys, share of running time (identical requests, capacity 8)")
    for weights in ({"a": 1.0, "b": 1.0}, {"a": 2.0, "b": 1.0}):
        proxy = start({"sim": sim(8, 200)}, "fair", weights)
        try:
            got = await shares(proxy, window)
        finally:
            proxy.cleanup()
        target = weights["a"] / (weights["a"] + weights["b"])
        print(f"  weights a:b = {weights['a']:g}:{weights['b']:g}  a {got['a']:.1%}  b {got['b']:.1%}  "
              f"(target a {target:.1%}, off by {abs(got['a'] - target) * 100:.1f} points)")

    models = {"big": sim(32, 50), "sim": sim(8, 1000)}
    fair, fifo = start(models, "fair"), start(models, "fifo")
    anticipating = start({"big": sim(32, 50)}, "fair", anticipation_ms=50)
    try:
        print("(b) ui p99 under a 500-request batch flood / ui p99 idle (32 seqs, 50 tok/s, 256 vs 32 tokens)")
        n = 20 if quick else 120
        idle = await interactive(fair, n, flood=False)
        print(f"  idle: {len(idle)} ui requests, p50 {pct(idle, .5):.3f}s p99 {pct(idle, .99):.3f}s")
        for label, proxy, count in (("fair, anticipation 50 ms", anticipating, n),
                                    ("fair (seed semantics)", fair, 10 if quick else 20),
                                    ("fifo", fifo, 2 if quick else 3)):
            loaded = await interactive(proxy, count, flood=True)
            print(f"  {label}: {len(loaded)} ui requests under the flood, p50 {pct(loaded, .5):.3f}s "
                  f"p99 {pct(loaded, .99):.3f}s max {max(loaded):.3f}s  ratio p99/idle p99 "
                  f"{pct(loaded, .99) / pct(idle, .99):.2f}")

        print("(c) lone key throughput, scheduler vs FIFO (alternating rounds)")
        rates: dict[str, list[float]] = {"fair": [], "fifo": []}
        for r in range(4 if quick else 6):
            for mode in (("fair", "fifo") if r % 2 == 0 else ("fifo", "fair")):
                rates[mode].append(await throughput(fair if mode == "fair" else fifo, 3 if quick else 5))
        f, o = sum(rates["fair"]) / len(rates["fair"]), sum(rates["fifo"]) / len(rates["fifo"])
        print(f"  fair {f:.1f} req/s  fifo {o:.1f} req/s  ratio {f / o:.3f}")
    finally:
        for proxy in (fair, fifo, anticipating):
            proxy.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scheduler-only", action="store_true", help="only (d), which starts no process")
    args = parser.parse_args()
    if not args.scheduler_only:
        asyncio.run(main(args.quick))
    scheduler_costs()
