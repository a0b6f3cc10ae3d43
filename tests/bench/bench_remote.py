"""What llm-pool adds to a remote (`openai_remote`) call, measured side by side in one run.

Starts the FAKE provider of tests/fakes.py in a process of its own and `llm-pool serve` with an
`openai_remote` model pointing at it, then alternates rounds straight to the provider and through
the proxy (the order flips every round so drift hits both alike), non-streamed and streamed, at
concurrency 1 and 8. Prints p50/p99 of each, what the proxy adds, and the proxy's CPU time per
request (from /proc, over the proxy rounds only). A stream's latency is until its last byte.

    .venv/bin/python tests/bench/bench_remote.py [--rounds 4] [--requests 200]
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not tests/proxy

from bench_proxy_overhead import cpu_seconds, pct  # noqa: E402
from helpers import REPO, ProxyProcess  # noqa: E402

KEY = "sk-bench-not-a-real-key"
UPSTREAM = "bench-upstream"
FAKE = ("import sys; sys.path.insert(0, 'tests'); from fakes import FakeProvider; "
        f"p = FakeProvider({KEY!r}, ({UPSTREAM!r},)).start(); print(p.port, flush=True); sys.stdin.read(); p.stop()")


async def timed(session: aiohttp.ClientSession, url: str, body: dict, headers: dict, n: int,
                concurrency: int) -> list[float]:
    latencies: list[float] = []
    todo = iter(range(n))
    loop = asyncio.get_running_loop()

    async def worker() -> None:
        for _ in todo:
            start = loop.time()
            async with session.post(url, json=body, headers=headers) as resp:
                await resp.read()
                assert resp.status == 200, (resp.status, await resp.text())
            latencies.append(loop.time() - start)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def bench(proxy: ProxyProcess, provider: str, rounds: int, n: int) -> None:
    assert proxy.proc is not None
    pid = proxy.proc.pid
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    paths = {"direct": (provider + "/chat/completions", {"model": UPSTREAM}, {"Authorization": f"Bearer {KEY}"}),
             "proxy": (proxy.url + "/v1/chat/completions", {"model": "remote", "allow_remote": True}, {})}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for url, extra, headers in paths.values():   # warm both paths
            await timed(session, url, {**base, **extra}, headers, 20, 4)
        print(f"{'mode':<12}{'conc':>5}{'p50 direct':>12}{'p50 proxy':>11}{'added':>9}"
              f"{'p99 direct':>12}{'p99 proxy':>11}{'added':>9}{'proxy CPU/req':>15}")
        for stream in (False, True):
            for concurrency in (1, 8):
                lat: dict[str, list[float]] = {"direct": [], "proxy": []}
                cpu = 0.0
                for r in range(rounds):
                    for mode in (("direct", "proxy") if r % 2 == 0 else ("proxy", "direct")):
                        url, extra, headers = paths[mode]
                        before = cpu_seconds(pid)
                        lat[mode] += await timed(session, url, {**base, **extra, "stream": stream}, headers,
                                                 n, concurrency)
                        if mode == "proxy":
                            cpu += cpu_seconds(pid) - before
                d50, p50 = pct(lat["direct"], 0.5) * 1e3, pct(lat["proxy"], 0.5) * 1e3
                d99, p99 = pct(lat["direct"], 0.99) * 1e3, pct(lat["proxy"], 0.99) * 1e3
                print(f"{'stream' if stream else 'json':<12}{concurrency:>5}{d50:>10.2f}ms{p50:>9.2f}ms"
                      f"{p50 - d50:>7.2f}ms{d99:>10.2f}ms{p99:>9.2f}ms{p99 - d99:>7.2f}ms"
                      f"{cpu / (rounds * n) * 1e3:>12.3f}ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=200, help="requests per round and mode")
    args = parser.parse_args()
    fake = subprocess.Popen([sys.executable, "-c", FAKE], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    proxy = None
    try:
        assert fake.stdout is not None
        provider = f"http://127.0.0.1:{int(fake.stdout.readline())}/v1"
        model = {"backend": "openai_remote", "remote_base_url": provider, "remote_model": UPSTREAM,
                 "remote_api_key_env": "BENCH_PROVIDER_KEY", "remote_timeout_s": 30, "target_inflight": 16,
                 "enabled": True}
        proxy = ProxyProcess({"remote": model}, service={"log_level": "warning"})
        proxy.env = {"BENCH_PROVIDER_KEY": KEY}
        proxy.start()
        proxy.wait_state("remote", "loaded")
        asyncio.run(bench(proxy, provider, args.rounds, args.requests))
    finally:
        if proxy is not None:
            survivors = proxy.cleanup()
            if survivors:
                print(f"killed leftover processes {survivors}", file=sys.stderr)
        fake.communicate("", timeout=30)


if __name__ == "__main__":
    main()
