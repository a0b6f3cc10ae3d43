"""What the proxy adds to a small non-streamed chat request, measured side by side in one run.

Starts `llm-pool serve` with llama-server on the tiny GGUF, then alternates rounds straight to the
replica and through the proxy (the order flips every round so drift hits both alike), at
concurrency 1 and 16. Prints added p50/p99 latency, requests/s of each and the proxy's CPU time
per request (from /proc, over the proxy rounds only).

    .venv/bin/python tests/bench/bench_proxy_overhead.py [--rounds 6] [--requests 200]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers import ProxyProcess  # noqa: E402
from proxy.demo_model import write_tiny_gguf  # noqa: E402
from proxy.llama_build import build_llama_server  # noqa: E402

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().split(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def run_round(session: aiohttp.ClientSession, url: str, n: int, concurrency: int,
                    body: dict = BODY) -> tuple[list[float], float]:
    """`n` requests of `body` to `url` by `concurrency` workers: each latency, and the wall time."""
    latencies: list[float] = []
    todo = iter(range(n))

    async def worker() -> None:
        for _ in todo:
            start = time.perf_counter()
            async with session.post(url, json=body) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def bench(proxy: ProxyProcess, direct_url: str, rounds: int, n: int) -> None:
    assert proxy.proc is not None
    proxy_pid = proxy.proc.pid
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for url in (direct_url, proxy.url):  # warm both paths
            await run_round(session, url + "/v1/chat/completions", 20, 4)
        for concurrency in (1, 16):
            lat = {"direct": [], "proxy": []}
            wall = {"direct": 0.0, "proxy": 0.0}
            cpu = 0.0
            for r in range(rounds):
                order = ("direct", "proxy") if r % 2 == 0 else ("proxy", "direct")
                for mode in order:
                    url = (direct_url if mode == "direct" else proxy.url) + "/v1/chat/completions"
                    before = cpu_seconds(proxy_pid)
                    got, elapsed = await run_round(session, url, n, concurrency)
                    if mode == "proxy":
                        cpu += cpu_seconds(proxy_pid) - before
                    lat[mode] += got
                    wall[mode] += elapsed
            total = rounds * n
            d50, p50 = pct(lat["direct"], 0.5), pct(lat["proxy"], 0.5)
            d99, p99 = pct(lat["direct"], 0.99), pct(lat["proxy"], 0.99)
            print(f"concurrency {concurrency:>2}: {total} requests each way, {rounds} alternating rounds")
            print(f"  p50  direct {d50 * 1e3:7.2f} ms  proxy {p50 * 1e3:7.2f} ms  added {(p50 - d50) * 1e3:6.2f} ms")
            print(f"  p99  direct {d99 * 1e3:7.2f} ms  proxy {p99 * 1e3:7.2f} ms  added {(p99 - d99) * 1e3:6.2f} ms")
            print(f"  mean direct {statistics.mean(lat['direct']) * 1e3:7.2f} ms  "
                  f"proxy {statistics.mean(lat['proxy']) * 1e3:7.2f} ms")
            print(f"  req/s direct {total / wall['direct']:7.1f}  proxy {total / wall['proxy']:7.1f}  "
                  f"ratio {wall['direct'] / wall['proxy']:.3f}")
            print(f"  proxy CPU per request {cpu / total * 1e3:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=200, help="requests per round and mode")
    args = parser.parse_args()
    import tempfile
    gguf = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="lp-bench-")) / "tiny.gguf")
    model = {"backend": "llama_server", "model_path": str(gguf), "llama_server_binary": str(build_llama_server()),
             "llama_server_n_ctx": 8192, "target_inflight": 16, "enabled": True}
    proxy = ProxyProcess({"tiny": model}, service={"log_level": "warning"})
    try:
        proxy.start()
        replica = proxy.wait_state("tiny", "loaded")["replicas"][0]
        asyncio.run(bench(proxy, f"http://127.0.0.1:{replica['port']}", args.rounds, args.requests))
    finally:
        survivors = proxy.cleanup()
        if survivors:
            print(f"killed leftover processes {survivors}", file=sys.stderr)


if __name__ == "__main__":
    main()
