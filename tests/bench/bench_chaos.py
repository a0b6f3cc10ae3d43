"""Chaos benchmark: mixed load on sim replicas while things go wrong, through the real proxy and supervisord.

Three sim replicas with a fault rate (requests that fail before or during their output) serve
mixed streamed and non-streamed requests on both APIs from concurrent clients; some clients leave
at a random moment, and a random replica is SIGKILLed every few seconds (supervisord restarts it).
Every request is classified by what the client saw:

  completed          200 and a proper end (JSON answer; `[DONE]` or `response.completed`)
  failed (by code)   an OpenAI error, as a status or as an `event: error` in a stream
  hung               no end within --hang-s (must be 0)
  200-then-silent    a 200 stream that ended with neither a proper end nor an error event (must be 0)
  left               the client went away on purpose

and the proxy's RSS is read at the start and at the end.

With `--engine llama-server` the replicas are real llama-servers on the tiny GGUF (no fault rate:
the faults are the chaos): besides SIGKILL, a replica is now and then frozen with SIGSTOP for a few
seconds and thawed with SIGCONT (a stalled engine: the proxy's timeouts and ejection must answer).

    .venv/bin/python tests/bench/bench_chaos.py [--duration 180] [--quick] [--engine sim|llama-server]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not tests/proxy

from helpers import ProxyProcess  # noqa: E402

MODEL = "chaos"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start(replicas: int, fault_rate: float, engine: str = "sim") -> ProxyProcess:
    model: dict[str, Any] = {"enabled": True, "replicas": replicas, "replica_max": replicas, "target_inflight": 8}
    if engine == "sim":
        model |= {"backend": "sim",
                  "sim": {"max_seqs": 8, "decode_tokens_per_s": 200, "ttft_ms": 5, "fault_rate": fault_rate}}
    else:
        from proxy.setup.demo_model import write_tiny_gguf
        from proxy.setup.llama_build import build_llama_server

        gguf = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="chaos-")) / "tiny.gguf")
        model |= {"backend": "llama_server", "model_path": str(gguf), "llama_server_binary": str(build_llama_server()),
                  "llama_server_n_ctx": 8192}
    service = {"log_level": "warning", "first_byte_timeout_s": 10, "stream_idle_timeout_s": 5,
               "health_interval_s": 0.5, "health_timeout_s": 1, "eject_after_failures": 5, "eject_base_s": 5}
    fairness = {"max_queue_wait_s": 15, "max_pending_per_key": 1000, "max_pending_per_executor": 2000}
    proxy = ProxyProcess({MODEL: model}, service=service, engine={"fairness": fairness})
    proxy.start()
    proxy.wait_replicas_ready(MODEL, replicas, timeout=120)
    return proxy


def request_for(rng: random.Random) -> tuple[str, dict[str, Any], bool]:
    stream = rng.random() < 0.5
    tokens = rng.randint(4, 64)
    if rng.random() < 0.5:
        return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "go"}],
                                        "max_tokens": tokens, "stream": stream}, stream
    return "/v1/responses", {"model": MODEL, "input": "go", "stream": stream,
                             "decoding": {"max_tokens": tokens}}, stream


def error_code(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "non-json"


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random, outcomes: Counter[str],
              hang_s: float, leave_rate: float) -> None:
    path, body, stream = request_for(rng)
    leave_after = rng.uniform(0, 0.5) if rng.random() < leave_rate else None
    outcomes["sent"] += 1

    async def run() -> str:
        async with session.post(url + path, json=body) as resp:
            if resp.status != 200:
                return "failed:" + error_code(await resp.read())
            if not stream:
                raw = await resp.read()
                try:
                    json.loads(raw)
                except ValueError:
                    return "200-then-silent"
                return "completed"
            text = (await resp.read()).decode(errors="replace")
            if "event: error" in text:
                marker = text.rsplit("event: error", 1)[1]
                data = marker.split("data:", 1)[1].split("\n", 1)[0] if "data:" in marker else ""
                return "failed:" + error_code(data.encode())
            if "data: [DONE]" in text or "event: response.completed" in text:
                return "completed"
            return "200-then-silent"

    task = asyncio.ensure_future(run())
    try:
        if leave_after is not None:
            done, _ = await asyncio.wait({task}, timeout=leave_after)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                outcomes["left"] += 1
                return
        outcome = await asyncio.wait_for(task, hang_s)
    except asyncio.TimeoutError:
        outcome = "hung"
    except aiohttp.ClientError as exc:
        outcome = f"failed:connection-{type(exc).__name__}"
    outcomes[outcome] += 1


async def killer(proxy: ProxyProcess, session: aiohttp.ClientSession, rng: random.Random, every_s: float,
                 stop: asyncio.Event, kills: list[int], freezes: list[int] | None = None) -> None:
    """SIGKILL a random ready replica every few seconds (while another is ready); with `freezes`,
    every other time SIGSTOP one instead and SIGCONT it a few seconds later."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(0.5, 1.5) * every_s)
            return
        except asyncio.TimeoutError:
            pass
        async with session.get(proxy.url + "/v1/admin/models") as resp:
            (model,) = [m for m in (await resp.json())["data"] if m["id"] == MODEL]
        pids = [r["pid"] for r in model["replicas"] if r["pid"] and r["state"] == "ready"]
        if len(pids) > 1:
            pid = rng.choice(pids)
            proxy.seen_pids.add(pid)
            if freezes is not None and rng.random() < 0.5:
                os.kill(pid, signal.SIGSTOP)
                freezes.append(pid)
                try:
                    await asyncio.wait_for(stop.wait(), rng.uniform(1.0, 6.0))
                except asyncio.TimeoutError:
                    pass
                os.kill(pid, signal.SIGCONT)
                continue
            os.kill(pid, signal.SIGKILL)
            kills.append(pid)


async def drive(proxy: ProxyProcess, duration: float, clients: int, hang_s: float, leave_rate: float,
                kill_every_s: float, seed: int, freezes: list[int] | None = None) -> tuple[Counter[str], list[int]]:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()
    kills: list[int] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(i: int) -> None:
            mine = random.Random(seed * 1000 + i)
            while not stop.is_set():
                await one(session, proxy.url, mine, outcomes, hang_s, leave_rate)

        chaos = asyncio.create_task(killer(proxy, session, rng, kill_every_s, stop, kills, freezes))
        workers = [asyncio.create_task(client(i)) for i in range(clients)]
        await asyncio.sleep(duration)
        stop.set()
        await asyncio.gather(chaos, *workers)
    return outcomes, kills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    parser.add_argument("--quick", action="store_true", help="30 seconds")
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--fault-rate", type=float, default=0.03)
    parser.add_argument("--leave-rate", type=float, default=0.1, help="share of clients that leave mid-request")
    parser.add_argument("--kill-every-s", type=float, default=8.0)
    parser.add_argument("--hang-s", type=float, default=60.0, help="a request longer than this is hung")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--engine", choices=("sim", "llama-server"), default="sim",
                        help="replicas: sim with a fault rate, or real llama-servers on the tiny GGUF (+ SIGSTOP/SIGCONT)")
    args = parser.parse_args()
    duration = 30.0 if args.quick else args.duration
    proxy = start(args.replicas, args.fault_rate, args.engine)
    freezes: list[int] | None = [] if args.engine == "llama-server" else None
    try:
        assert proxy.proc is not None
        rss_start = rss_mb(proxy.proc.pid)
        began = time.monotonic()
        outcomes, kills = asyncio.run(drive(proxy, duration, args.clients, args.hang_s, args.leave_rate,
                                            args.kill_every_s, args.seed, freezes))
        elapsed = time.monotonic() - began
        rss_end = rss_mb(proxy.proc.pid)
        states = [r["state"] for r in proxy.admin_model(MODEL)["replicas"]]
    finally:
        survivors = proxy.cleanup()
    failed = {k.split(":", 1)[1]: v for k, v in outcomes.items() if k.startswith("failed:")}
    faults = f"fault rate {args.fault_rate}" if args.engine == "sim" else f"{len(freezes or [])} SIGSTOP/SIGCONT"
    print(f"chaos: {elapsed:.0f} s, {args.clients} clients, {args.replicas} {args.engine} replicas, {faults}, "
          f"clients leaving {args.leave_rate}, {len(kills)} replica SIGKILLs")
    print(f"  requests sent     {outcomes['sent']}")
    print(f"  completed         {outcomes['completed']}")
    print(f"  failed with error {sum(failed.values())}  {dict(sorted(failed.items()))}")
    print(f"  clients left      {outcomes['left']}")
    print(f"  hung              {outcomes['hung']}   (must be 0)")
    print(f"  200-then-silent   {outcomes['200-then-silent']}   (must be 0)")
    print(f"  proxy RSS         {rss_start:.1f} MB at start, {rss_end:.1f} MB at end")
    print(f"  replica states at the end: {states}; processes left behind: {survivors or 'none'}")
    if outcomes["hung"] or outcomes["200-then-silent"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
