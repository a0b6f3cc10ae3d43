"""What a batch costs interactive traffic, and how much of the idle capacity it uses (issue 44).

One proxy, one simulated model (`--slots` sequences at once, `--decode` tokens a second each, no
slowdown from batching: a GPU engine's continuous batching within its batch size). An interactive
client streams `--tokens`-token answers at `--rate` requests a second (Poisson arrivals, the same
seeded schedule in both runs), first alone, then beside a `--lines`-line batch on the same model
(OpenAI's Batch API through the SDK). Printed, side by side from the one run:

- the interactive time to first token, p50 and p95, alone and beside the batch, and their ratio
  (goal: p95 <= 1.1x);
- the batch's slot-seconds over the slot-seconds the interactive traffic left free while the batch
  ran (sampled from the admin view's per-class running counts every 50 ms; goal >= 0.80).

    .venv/bin/python tests/bench/bench_batches.py [--quick] [--slots 32] [--reserve 3] [--rate 3]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not an installed copy

from helpers import ProxyProcess  # noqa: E402

SAMPLE_S = 0.05


SENT: list[tuple[float, float]] = []   # (when, TTFT) of every interactive request, for --verbose


async def first_token(session: aiohttp.ClientSession, url: str, tokens: int) -> float:
    body = {"model": "sim", "messages": [{"role": "user", "content": "go"}], "max_tokens": tokens, "stream": True}
    start = time.perf_counter()
    ttft = await _first_token(session, url, body, start)
    SENT.append((start, ttft))
    return ttft


async def _first_token(session: aiohttp.ClientSession, url: str, body: dict[str, Any], start: float) -> float:
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"interactive request: HTTP {resp.status}: {await resp.text()}")
        ttft = None
        async for chunk in resp.content.iter_any():
            if ttft is None and b'"content"' in chunk:
                ttft = time.perf_counter() - start
        return ttft if ttft is not None else time.perf_counter() - start


async def interactive(url: str, rate: float, tokens: int, until: Any, seed: int) -> list[float]:
    """Requests at Poisson arrivals of `rate` a second until `until()` is true; each one's TTFT."""
    rng = random.Random(seed)
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        while not until():
            tasks.append(asyncio.create_task(first_token(session, url, tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


async def sample(url: str, slots: int, stop: asyncio.Event, out: dict[str, float]) -> None:
    """Integrate the batch class's running slots and the slots the others left free."""
    async with aiohttp.ClientSession() as session:
        last = time.perf_counter()
        while not stop.is_set():
            async with session.get(url + "/v1/admin/models") as resp:
                models = (await resp.json())["data"]
            classes = next(m for m in models if m["id"] == "sim")["classes"]
            now = time.perf_counter()
            dt, last = now - last, now
            others = sum(c["running"] for name, c in classes.items() if name != "batch")
            out["batch"] += classes["batch"]["running"] * dt
            out["free"] += max(0, slots - others) * dt
            await asyncio.sleep(SAMPLE_S)


def lines(count: int, tokens: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "sim", "max_tokens": tokens,
                                        "messages": [{"role": "user", "content": f"item {i}"}]}}) + "\n"
                   for i in range(count)).encode()


async def run(args: argparse.Namespace, proxy: ProxyProcess) -> None:
    # Alone: for about as long as the batch will take (measured by the batch run's own length below).
    alone_s = args.alone_s
    t0 = time.perf_counter()
    # The admin view is read as often in both runs: what reading it costs the proxy is in both.
    quiet = asyncio.Event()
    idle = asyncio.create_task(sample(proxy.url, args.slots, quiet, {"batch": 0.0, "free": 0.0}))
    alone = await interactive(proxy.url, args.rate, args.tokens, lambda: time.perf_counter() - t0 > alone_s, 7)
    quiet.set()
    await idle

    sdk = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    upload = await sdk.files.create(file=("lines.jsonl", io.BytesIO(lines(args.lines, args.tokens))), purpose="batch")
    batch = await sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = asyncio.Event()
    usage = {"batch": 0.0, "free": 0.0}
    sampler = asyncio.create_task(sample(proxy.url, args.slots, done, usage))
    started = time.perf_counter()

    async def watch() -> Any:
        while True:
            current = await sdk.batches.retrieve(batch.id)
            if current.status in ("completed", "failed", "expired", "cancelled"):
                done.set()
                return current
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    beside = await interactive(proxy.url, args.rate, args.tokens, done.is_set, 7)
    final = await watcher
    took = time.perf_counter() - started
    await sampler

    def q(values: list[float], p: float) -> float:
        return statistics.quantiles(values, n=100)[p - 1] * 1000 if len(values) > 1 else values[0] * 1000

    print(f"\n{args.slots} slots (reserve_slots {args.reserve}), {args.decode:g} tokens/s a sequence; interactive "
          f"{args.rate:g}/s x {args.tokens} tokens; batch {args.lines} lines x {args.tokens} tokens")
    print(f"  batch: {final.status}, {final.request_counts.completed} completed, {final.request_counts.failed} "
          f"failed in {took:.1f} s ({args.lines / took:.1f} lines/s)")
    print(f"  {'interactive TTFT':<24}{'requests':>10}{'p50 ms':>10}{'p95 ms':>10}")
    print(f"  {'alone':<24}{len(alone):>10}{q(alone, 50):>10.1f}{q(alone, 95):>10.1f}")
    print(f"  {'beside the batch':<24}{len(beside):>10}{q(beside, 50):>10.1f}{q(beside, 95):>10.1f}")
    if args.verbose:
        print("  slowest beside (s after the batch began, ms):",
              [(round(w - started, 2), round(v * 1000)) for w, v in sorted(SENT, key=lambda x: x[1])[-6:]])
    print(f"  p95 beside / alone: {q(beside, 95) / q(alone, 95):.2f}x (goal <= 1.1x)")
    share = usage["batch"] / usage["free"] if usage["free"] else 0.0
    print(f"  slots the batch used / slots interactive traffic left free: {usage['batch']:.0f} / {usage['free']:.0f} "
          f"slot-seconds = {share:.2f} (goal >= 0.80)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--reserve", type=int, default=3, help="engine.batches.reserve_slots")
    parser.add_argument("--decode", type=float, default=50.0, help="tokens a second a sequence")
    parser.add_argument("--rate", type=float, default=3.0, help="interactive requests a second")
    parser.add_argument("--tokens", type=int, default=32, help="tokens an answer (interactive and batch)")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--alone-s", type=float, default=30.0, help="how long the interactive client runs alone")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--quick", action="store_true", help="200 lines, 10 s alone: the same table, noisier")
    args = parser.parse_args()
    if args.quick:
        args.lines, args.alone_s = 200, 10.0
    model = {"backend": "sim", "enabled": True, "target_inflight": args.slots,
             "sim": {"max_seqs": args.slots, "decode_tokens_per_s": args.decode, "ttft_ms": 20, "prefix_cache": False}}
    proxy = ProxyProcess({"sim": model}, service={"log_level": "warning"},
                         engine={"batches": {"reserve_slots": args.reserve}})
    try:
        proxy.start()
        proxy.wait_state("sim", "loaded")
        asyncio.run(run(args, proxy))
    finally:
        survivors = proxy.cleanup()
        if survivors:
            print(f"killed leftover processes {survivors}", file=sys.stderr)


if __name__ == "__main__":
    main()
