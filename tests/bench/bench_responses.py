"""/v1/responses vs /v1/chat/completions through the proxy, for the same request, side by side.

The same small generation (8 tokens, llama-server on the tiny GGUF) is sent both ways in
alternating rounds; prints p50/p99 of each, the overhead ratio and the proxy's CPU per request.

    .venv/bin/python tests/bench/bench_responses.py [--rounds 6] [--requests 150]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not tests/proxy
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy_overhead import cpu_seconds, pct, run_round  # noqa: E402
from helpers import ProxyProcess  # noqa: E402
from proxy.setup.demo_model import write_tiny_gguf  # noqa: E402
from proxy.setup.llama_build import build_llama_server  # noqa: E402

CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 8, "temperature": 0}
RESPONSES = {"model": "tiny", "instructions": "Be brief.", "input": "Hi", "decoding": {"max_tokens": 8, "temperature": 0}}
PATHS = {"chat": ("/v1/chat/completions", CHAT), "responses": ("/v1/responses", RESPONSES)}


async def bench(proxy: ProxyProcess, rounds: int, n: int) -> None:
    assert proxy.proc is not None
    async with aiohttp.ClientSession() as session:
        for path, body in PATHS.values():
            await run_round(session, proxy.url + path, 20, 2, body)
        for concurrency in (1, 8):
            lat: dict[str, list[float]] = {"chat": [], "responses": []}
            cpu = {"chat": 0.0, "responses": 0.0}
            for r in range(rounds):
                for mode in (("chat", "responses") if r % 2 == 0 else ("responses", "chat")):
                    path, body = PATHS[mode]
                    before = cpu_seconds(proxy.proc.pid)
                    lat[mode] += (await run_round(session, proxy.url + path, n, concurrency, body))[0]
                    cpu[mode] += cpu_seconds(proxy.proc.pid) - before
            total = rounds * n
            c50, r50 = pct(lat["chat"], .5), pct(lat["responses"], .5)
            c99, r99 = pct(lat["chat"], .99), pct(lat["responses"], .99)
            print(f"concurrency {concurrency}: {total} requests each way")
            print(f"  p50 chat {c50 * 1e3:.2f} ms  responses {r50 * 1e3:.2f} ms  ratio {r50 / c50:.3f}")
            print(f"  p99 chat {c99 * 1e3:.2f} ms  responses {r99 * 1e3:.2f} ms  ratio {r99 / c99:.3f}")
            print(f"  mean ratio {sum(lat['responses']) / sum(lat['chat']):.3f}   proxy CPU per request: chat "
                  f"{cpu['chat'] / total * 1e3:.3f} ms, responses {cpu['responses'] / total * 1e3:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=150)
    args = parser.parse_args()
    gguf = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="lp-bench-")) / "tiny.gguf")
    proxy = ProxyProcess({"tiny": {"backend": "llama_server", "model_path": str(gguf), "target_inflight": 8,
                                   "llama_server_binary": str(build_llama_server()), "llama_server_n_ctx": 8192,
                                   "enabled": True}}, service={"log_level": "warning"})
    try:
        proxy.start()
        proxy.wait_state("tiny", "loaded")
        asyncio.run(bench(proxy, args.rounds, args.requests))
    finally:
        proxy.cleanup()


if __name__ == "__main__":
    main()
