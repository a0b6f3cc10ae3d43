"""How many streamed requests fail through `llm-pool serve` to a real llama-server (issue 16, item 2).

The pinned llama-server closes the TCP connection after every streamed response although it answers
`Keep-Alive: timeout=5, max=100`; a client pool that reuses such a connection fails its next request
before any byte comes back. This sends `--requests` streamed chat completions (prompts of about
`--prompt-tokens` random tokens, `--max-tokens` output tokens, EOS ignored) at each concurrency,
through the proxy to the demo-like model (the tiny GGUF, per-request context 2048, target_inflight 4),
and, with `--direct`, straight to the replica with the same plain aiohttp client (whose own pool then
meets llama-server's closes). A request failed when it was not a 200 event stream ending in
`data: [DONE]` without an error event. It prints the failed share per concurrency, why they failed,
how many requests the proxy sent again on a new connection (from its log), the rate, and the p50 and
max time of the streams that arrived whole.

    .venv/bin/python tests/bench/bench_keepalive.py [--requests 300] [--concurrency 1,4,16] [--direct]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not an installed one

from helpers import ProxyProcess  # noqa: E402

WORDS = "hello world model pool tiny demo weather park walk lunch today".split()


def prompt(rng: random.Random, tokens: int) -> str:
    # Measured with llama-server's /tokenize: about 5.7 tokens a word of these in the demo vocabulary.
    return " ".join(rng.choice(WORDS) for _ in range(tokens * 10 // 57))


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> str | None:
    """None when the stream arrived whole; else why it failed."""
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                text = await resp.text()
                try:
                    return f"HTTP {resp.status}: {json.loads(text)['error']['message']}"
                except (ValueError, KeyError, TypeError):
                    return f"HTTP {resp.status}: {text[:120]}"
            done = False
            async for line in resp.content:
                if line.startswith(b"event: error") or line.startswith(b'data: {"error"'):
                    return f"error event: {line[:160].decode(errors='replace').strip()}"
                if line.strip() == b"data: [DONE]":
                    done = True
            return None if done else "stream ended without [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return f"client: {type(exc).__name__}"


async def level(url: str, model: str, n: int, concurrency: int, prompt_tokens: int, max_tokens: int,
                seed: int) -> tuple[list[str | None], list[float], float]:
    rng = random.Random(seed)
    bodies = [{"model": model, "messages": [{"role": "user", "content": prompt(rng, prompt_tokens)}],
               "max_tokens": max_tokens, "ignore_eos": True, "stream": True} for _ in range(n)]
    todo = iter(bodies)
    outcomes: list[str | None] = []
    latencies: list[float] = []   # of the streams that arrived whole
    # One plain pooled client, as a benchmark client has (vllm bench serve's is aiohttp too).
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def worker() -> None:
            for body in todo:
                sent = time.perf_counter()
                outcomes.append(await one(session, url + "/v1/chat/completions", body))
                if outcomes[-1] is None:
                    latencies.append(time.perf_counter() - sent)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return outcomes, latencies, time.perf_counter() - start


def resent(proxy: ProxyProcess) -> int:
    """Requests the proxy sent again on a new connection so far (proxy/serving/forward.py logs each)."""
    return proxy.log_path.read_text(errors="replace").count("sending it again on a new one")


def report(target: str, concurrency: int, outcomes: list[str | None], latencies: list[float], wall: float,
           resends: int | None) -> None:
    failed = [o for o in outcomes if o is not None]
    again = f", {resends} sent again on a new connection" if resends is not None else ""
    ordered = sorted(latencies) or [float("nan")]
    print(f"{target:6} concurrency {concurrency:2}: {len(failed):3} of {len(outcomes)} streams failed "
          f"({100 * len(failed) / len(outcomes):.1f}%){again}; {len(outcomes) / wall:.1f} req/s, whole streams "
          f"p50 {1000 * ordered[len(ordered) // 2]:.0f} ms, max {1000 * ordered[-1]:.0f} ms", flush=True)
    for reason, count in collections.Counter(failed).most_common(4):
        print(f"    {count:3} x {reason}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300, help="streams per concurrency and target")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--direct", action="store_true", help="also straight to the replica, for comparison")
    args = parser.parse_args()
    # A timeout's SIGTERM still stops the proxy, its supervisord and llama-server (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))

    from proxy.setup.demo_model import write_tiny_gguf
    from proxy.setup.llama_build import build_llama_server
    gguf = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="lp-bench-")) / "demo.gguf")
    model = {"backend": "llama_server", "model_path": str(gguf), "llama_server_binary": str(build_llama_server()),
             "llama_server_n_ctx": 2048, "target_inflight": 4, "enabled": True}
    proxy = ProxyProcess({"demo": model}, service={"log_level": "info"})
    try:
        proxy.start()
        replica = f"http://127.0.0.1:{proxy.wait_state('demo', 'loaded')['replicas'][0]['port']}"
        print(f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}; {args.requests} streams per line, "
              f"~{args.prompt_tokens} prompt tokens, {args.max_tokens} output tokens", flush=True)
        targets = {"proxy": proxy.url, **({"direct": replica} if args.direct else {})}
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for target, url in targets.items():
                before = resent(proxy)
                outcomes, latencies, wall = asyncio.run(level(url, "demo", args.requests, concurrency,
                                                              args.prompt_tokens, args.max_tokens, seed=concurrency))
                report(target, concurrency, outcomes, latencies, wall,
                       resent(proxy) - before if target == "proxy" else None)
    finally:
        survivors = proxy.cleanup()
        if survivors:
            print(f"killed leftover processes {survivors}", file=sys.stderr)


if __name__ == "__main__":
    main()
