"""More models than memory (issues 17 and 29): a trace over 4 models with room for 2, replayed
against llm-pool's scheduler and, in the same run, against a plain count-based LRU; then the pool's
own cost of a cold start.

Two scenarios, each replayed against both policies (`--scenario` picks one):

- `kv`: the tiny GGUF served by real llama-server replicas with 2 slots of 262144 tokens each: a
  KV cache of 256 MiB and a compute buffer of 257 MiB (the attention mask over a slot's context),
  an estimate of 530 MiB with the server process, above what it is measured to hold; a CPU budget
  of 1300 MiB holds two. Each model is loaded and unloaded once first, as in a pool that has run a
  while: admission by measurement.
- `demo`: what a new admin hit (issue 29): the demo model as `conf/pool.yaml` ships it (2,048
  tokens, 4 slots: estimated 23.5 MiB, measured about 22 resident) under a CPU budget of
  DEMO_BUDGET_MIB, room for two by the estimate and by the measurement alike, with nothing measured before the trace: the first loads are admitted by the
  estimate, the later ones by what was measured meanwhile. Its footprint is mostly the server
  process itself, the figure that moved with the neighbours while it was PSS.

The trace is open-loop and
seeded: Zipf-like popularity over the 4 models (0.55, 0.25, 0.12, 0.08), Poisson arrivals, and a
few bursts (a dozen requests for one model at once, the rarer models too). Policies:

- `llm-pool`: memory budget (measured footprints), fairness, the swap-aware order (swap_max_wait_s).
- `plain`: what a count-based peer does: load on miss, at most 2 models (max_loaded_models),
  evict the least recently used, FIFO (fairness mode fifo, swap_max_wait_s 0 and min_residence_s 0:
  a request for another model swaps as soon as the running ones finish).

Printed per policy: requests served and failed, loads, evictions, latency p50/p95/max. The tiny
model loads in a fraction of a second, where a real one takes seconds to minutes, which is what
makes a swap expensive: `--load-delay S` starts each replica S seconds late (a wrapper that sleeps,
then runs llama-server), so that a load costs what it would.

The cold-start cost: a request for a cold model (streamed) from its arrival to its first byte,
minus what the engine itself takes: its start-to-healthy time (the same llama-server command line
started directly and polled every 2 ms) and a warm request's time to first byte. Alternated, per load,
with a small KV cache (4096 tokens), so that the engine's own start is short and steady.

    .venv/bin/python tests/bench/bench_lifecycle.py [--scenario kv|demo|both] [--duration 60] [--rate 3]
        [--cold-starts 9]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not an installed one

from helpers import ProxyProcess, free_port, http, wait_for  # noqa: E402
from proxy.setup.demo_model import write_tiny_gguf  # noqa: E402
from proxy.setup.llama_build import build_llama_server  # noqa: E402

MODELS = ("a", "b", "c", "d")
POPULARITY = (0.55, 0.25, 0.12, 0.08)
BIG_CTX = 262144
BUDGET_MIB = 1300
DEMO_BUDGET_MIB = 60     # issue 29's report had 40, two models by their PSS; by resident memory, 60
CHAT = [{"role": "user", "content": "hello"}]


def delayed(binary: Path, delay_s: float, folder: Path) -> Path:
    """llama-server started `delay_s` late: a load that costs what a real model's would."""
    if not delay_s:
        return binary
    wrapper = folder / "delayed-llama-server"
    wrapper.write_text(f"#!/bin/sh\nsleep {delay_s}\nexec {binary} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def model(gguf: Path, binary: Path, scenario: str = "kv") -> dict[str, Any]:
    ctx, slots = (BIG_CTX, 2) if scenario == "kv" else (2048, 4)
    return {"backend": "llama_server", "model_path": str(gguf), "llama_server_binary": str(binary),
            "llama_server_n_ctx": ctx, "llama_server_n_gpu_layers": 0, "target_inflight": slots,
            "load_on_demand": True}


def policies(scenario: str) -> dict[str, dict[str, Any]]:
    budget = BUDGET_MIB if scenario == "kv" else DEMO_BUDGET_MIB
    return {
        "llm-pool": {"lifecycle": {"memory": {"cpu_budget_mib": budget}, "swap_max_wait_s": 5}},
        "plain": {"lifecycle": {"max_loaded_models": 2, "swap_max_wait_s": 0, "min_residence_s": 0},
                  "fairness": {"mode": "fifo"}},
    }


def trace(duration: float, rate: float, seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    out, t = [], 0.0
    while t < duration:
        t += rng.expovariate(rate)
        out.append((t, rng.choices(MODELS, POPULARITY)[0]))
    for _ in range(3):   # bursts: a batch job arrives for one model
        at, name = rng.uniform(0, duration), rng.choice(MODELS)
        out += [(at + i * 0.01, name) for i in range(12)]
    return sorted(out)


async def replay(url: str, events: list[tuple[float, str]], memory_url: str,
                 negative: list[int]) -> list[tuple[str, int | str, float]]:
    """Replay `events`; meanwhile read GET /v1/admin/memory every 50 ms and keep each free_bytes
    below 0 in `negative`."""
    results: list[tuple[str, int | str, float]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                async with session.get(memory_url) as resp:
                    rows = (await resp.json())["devices"]
                negative.extend(r["free_bytes"] for r in rows if r["free_bytes"] is not None and r["free_bytes"] < 0)
                await asyncio.sleep(0.05)

        async def one(at: float, name: str) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter()
            body = {"model": name, "messages": CHAT, "max_tokens": 32, "ignore_eos": True}
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    payload = await resp.json(content_type=None)
                    code: int | str = 200 if resp.status == 200 else payload["error"]["code"]
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
                code = type(exc).__name__
            results.append((name, code, time.perf_counter() - sent))

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(one(at, name) for at, name in events))
        done.set()
        await watcher
    return results


def counts(proxy: ProxyProcess) -> tuple[int, int]:
    _, _, body = http("GET", proxy.url + "/v1/admin/models")
    loads = sum(sum(m["loads"].values()) for m in body["data"])
    evictions = sum(m["evictions"] for m in body["data"])
    return loads, evictions


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))] if values else float("nan")


def run_policy(name: str, scenario: str, models: dict[str, Any],
               events: list[tuple[float, str]]) -> dict[str, Any]:
    proxy = ProxyProcess(models, engine=policies(scenario)[name])
    proxy.start()
    negative: list[int] = []
    try:
        if scenario == "kv":
            # Measure each model once first, as a pool that has run a while has: admission by measurement.
            for m in MODELS:
                assert http("POST", proxy.url + f"/v1/admin/models/{m}/load")[0] == 200
                assert http("POST", proxy.url + f"/v1/admin/models/{m}/unload")[0] == 200
        base_loads, base_evictions = counts(proxy)
        results = asyncio.run(replay(proxy.url, events, proxy.url + "/v1/admin/memory", negative))
        loads, evictions = counts(proxy)
        footprints = {m["id"]: m["footprint"] for m in http("GET", proxy.url + "/v1/admin/models")[2]["data"]}
    finally:
        survivors = proxy.cleanup()
        assert not survivors, survivors
    ok = [lat for _, code, lat in results if code == 200]
    failed: dict[str, int] = {}
    for _, code, _ in results:
        if code != 200:
            failed[str(code)] = failed.get(str(code), 0) + 1
    return {"served": len(ok), "failed": failed, "loads": loads - base_loads, "evictions": evictions - base_evictions,
            "p50": pct(ok, 50), "p95": pct(ok, 95), "max": max(ok, default=float("nan")),
            "negative_free": len(negative), "footprints": footprints}


def first_byte(url: str, name: str) -> float:
    body = json.dumps({"model": name, "messages": CHAT, "max_tokens": 4, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.readline()
        took = time.perf_counter() - sent
        resp.read()
    return took


def engine_start_to_healthy(argv: list[str], port: int) -> float:
    """The engine alone: spawn to /health 200, polled every 2 ms."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - started
            except OSError:
                pass
            time.sleep(0.002)
    finally:
        proc.kill()   # only its start is measured
        proc.wait(30)


def cold_starts(models: dict[str, Any], rounds: int) -> list[dict[str, float]]:
    # A small KV cache: the engine's own start is short and steady, so what is left is the pool's.
    proxy = ProxyProcess({"a": {**models["a"], "llama_server_n_ctx": 4096}})
    proxy.start()
    out = []
    try:
        for _ in range(rounds):
            wait_for(lambda: proxy.admin_model("a")["state"] == "unloaded", what="a unloaded")
            cold = first_byte(proxy.url, "a")
            warm = first_byte(proxy.url, "a")
            program = next(proxy.state_dir.glob("programs/*.conf")).read_text()
            command = next(line for line in program.splitlines() if line.startswith("command="))
            argv = shlex.split(command[len("command="):].replace("%%", "%"))
            assert http("POST", proxy.url + "/v1/admin/models/a/unload")[0] == 200
            port = free_port()
            argv[argv.index("--port") + 1] = str(port)
            healthy = engine_start_to_healthy(argv, port)
            out.append({"cold_ms": cold * 1000, "engine_start_ms": healthy * 1000, "warm_ms": warm * 1000,
                        "pool_ms": (cold - healthy - warm) * 1000})
    finally:
        survivors = proxy.cleanup()
        assert not survivors, survivors
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    parser.add_argument("--cold-starts", type=int, default=9)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--load-delay", type=float, default=2.0, help="seconds added to every load")
    parser.add_argument("--scenario", choices=("kv", "demo", "both"), default="both")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="lp-bench-"))
    gguf = write_tiny_gguf(folder / "tiny.gguf")
    events = trace(args.duration, args.rate, args.seed)
    print(f"trace: {len(events)} requests over {args.duration:g}s, 4 models, room for 2, seed {args.seed}, "
          f"each load {args.load_delay:g}s longer than the tiny model's")
    for scenario in ("kv", "demo") if args.scenario == "both" else (args.scenario,):
        models = {m: model(gguf, delayed(build_llama_server(), args.load_delay, folder), scenario) for m in MODELS}
        budget = BUDGET_MIB if scenario == "kv" else DEMO_BUDGET_MIB
        print(f"\nscenario {scenario}: llm-pool with cpu_budget_mib {budget}, plain with max_loaded_models 2")
        print(f"{'policy':<10} {'served':>6} {'failed':>16} {'loads':>5} {'evict':>5} {'p50 s':>7} {'p95 s':>7} "
              f"{'max s':>7} {'free<0':>6}")
        for name in policies(scenario):
            r = run_policy(name, scenario, models, events)
            failed = ",".join(f"{k}:{v}" for k, v in r["failed"].items()) or "0"
            print(f"{name:<10} {r['served']:>6} {failed:>16} {r['loads']:>5} {r['evictions']:>5} "
                  f"{r['p50']:>7.2f} {r['p95']:>7.2f} {r['max']:>7.2f} {r['negative_free']:>6}")
            if name == "llm-pool":
                f = r["footprints"]["a"]
                print(f"           model a: estimated {f['estimated_mib_per_replica']} MiB, measured "
                      f"{f['measured_mib_per_replica']} ({f['measured_samples']} samples), admitted by "
                      f"{f['admitted_by']}")
    if not args.cold_starts:
        return
    rows = cold_starts({m: model(gguf, build_llama_server()) for m in MODELS}, args.cold_starts)
    print("\ncold start, per load (ms): arrival to first byte = engine start-to-healthy + warm first byte + pool")
    for row in rows:
        print(f"  cold {row['cold_ms']:7.1f}  engine start {row['engine_start_ms']:7.1f}  warm {row['warm_ms']:5.1f}"
              f"  pool {row['pool_ms']:6.1f}")
    print(f"  pool's own cost: median {statistics.median(r['pool_ms'] for r in rows):.1f} ms, "
          f"max {max(r['pool_ms'] for r in rows):.1f} ms (goal: under 50)")


if __name__ == "__main__":
    main()
