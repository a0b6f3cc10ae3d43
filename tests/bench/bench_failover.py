"""Failover benchmark: client-visible errors per replica kill, through the real proxy and supervisord.

A llama_server model of two replicas (the tiny GGUF) serves streamed chat requests from 1 and from 4
concurrent clients in a loop. Every few seconds one replica is SIGKILLed (supervisord restarts
it); the next kill waits until both are READY again. Kills alternate between the busier replica
(mid-stream: those requests are lost, they were running there) and the idler one. Printed per
client count: kills, requests, errors seen by clients in all, and errors per kill beyond the
requests that were running on the killed replica (the ones a proxy can save).

    .venv/bin/python tests/bench/bench_failover.py [--kills 6]
"""
from __future__ import annotations

import argparse
import asyncio
import os
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

MODEL = "tiny"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64, "stream": True,
        "ignore_eos": True}


async def one(session: aiohttp.ClientSession, url: str) -> str:
    """'ok', or what the client saw instead (a status and code, or an error event)."""
    try:
        async with session.post(url + "/v1/chat/completions", json=BODY) as resp:
            if resp.status != 200:
                body = await resp.json(content_type=None)
                return f"{resp.status} {body.get('error', {}).get('code')}"
            text = (await resp.read()).decode(errors="replace")
            if "event: error" in text or '"error"' in text:
                return "stream error"
            return "ok" if "[DONE]" in text else "no [DONE]"
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def clients(url: str, count: int, stop: asyncio.Event, outcomes: Counter[str]) -> None:
    async def loop() -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                outcomes[await one(session, url)] += 1
    await asyncio.gather(*(loop() for _ in range(count)))


async def run(proxy: ProxyProcess, count: int, kills: int) -> dict[str, Any]:
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()
    await asyncio.to_thread(proxy.wait_replicas_ready, MODEL, 2, 120)
    task = asyncio.create_task(clients(proxy.url, count, stop, outcomes))
    lost_running = 0
    try:
        for kill in range(kills):
            await asyncio.to_thread(proxy.wait_replicas_ready, MODEL, 2, 120)
            await asyncio.sleep(1.0)   # traffic on both replicas before the next kill
            replicas = (await asyncio.to_thread(proxy.admin_model, MODEL))["replicas"]
            busy = sorted(replicas, key=lambda r: r["inflight"], reverse=kill % 2 == 0)[0]
            lost_running += busy["inflight"]
            os.kill(busy["pid"], signal.SIGKILL)
        await asyncio.to_thread(proxy.wait_replicas_ready, MODEL, 2, 120)
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await task
    errors = sum(n for what, n in outcomes.items() if what != "ok")
    return {"clients": count, "kills": kills, "requests": sum(outcomes.values()), "errors": errors,
            "running_on_killed": lost_running, "outcomes": dict(outcomes)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=6)
    args = parser.parse_args()
    from proxy.setup.demo_model import write_tiny_gguf
    from proxy.setup.llama_build import build_llama_server
    gguf = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="lp-bench-")) / "tiny.gguf")
    model = {"backend": "llama_server", "model_path": str(gguf), "llama_server_binary": str(build_llama_server()),
             "llama_server_n_ctx": 2048, "target_inflight": 4, "replicas": 2, "replica_max": 2, "enabled": True}
    proxy = ProxyProcess({MODEL: model}, service={"log_level": "warning", "health_interval_s": 0.5})
    try:
        proxy.start()
        print(f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}", flush=True)
        for count in (1, 4):
            started = time.monotonic()
            r = asyncio.run(run(proxy, count, args.kills))
            extra = max(0, r["errors"] - r["running_on_killed"])
            print(f"clients {count}: {r['kills']} kills, {r['requests']} requests in {time.monotonic() - started:.0f}s, "
                  f"{r['errors']} errors ({r['errors'] / r['kills']:.2f} per kill); running on the killed replica "
                  f"{r['running_on_killed']}; beyond those {extra} ({extra / r['kills']:.2f} per kill); "
                  f"outcomes {r['outcomes']}", flush=True)
    finally:
        survivors = proxy.cleanup()
        if survivors:
            print(f"killed leftover processes {survivors}", file=sys.stderr)


if __name__ == "__main__":
    main()
