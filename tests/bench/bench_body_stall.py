"""Does one big body stall the proxy? GET /health and a small chat request, timed while a worst-case
body of the allowed size (service.max_body_bytes) is posted, one shape at a time (issue 28, item 6).

`llm-pool serve` runs as a user runs it, in front of a managed `sim` replica whose interpreter is a
wrapper that starts FastUpstream (tests/fakes.py), an upstream that costs next to nothing. For each
shape the bench posts the body once and, until its answer is back, sends GET /health every 10 ms and
a small chat completion every 50 ms, one at a time each: the longest of them is how long the event
loop was held. Shapes: `{},` objects as messages, arrays nested 100 deep (within the depth bound),
small strings, numbers, one huge string (as it came, and re-encoded: a `fairness_key` makes the
proxy rewrite the body), text full of brackets (counted again outside strings), a large image data
URL, /v1/responses input items, and the largest bodies that pass the bounds (strict_json.py,
responses.py).

`--baseline DIR` runs the same shapes, in the same run, against the proxy of another source tree (a
`git archive` of the commit before a change): side by side, before and after. It prints figures and
never fails on them.

    .venv/bin/python tests/bench/bench_body_stall.py [--mib 32] [--baseline DIR] [--shapes NAME ...]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy_overhead import FAST_UPSTREAM, at_defaults, pct  # noqa: E402
from helpers import ProxyProcess  # noqa: E402
from proxy.config.settings import DEFAULT_SERVICE  # noqa: E402
from proxy.serving.responses import MAX_CONTENT_ITEMS, MAX_CONTENT_ITEMS_TOTAL  # noqa: E402
from proxy.edge.strict_json import MAX_CONTAINERS, MAX_VALUES  # noqa: E402

CHAT = "/v1/chat/completions"
SMALL = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
HEAD = b'{"model": "m", "max_tokens": 4, "messages": ['
USER = b'{"role": "user", "content": "Hi"}'
HEALTH_EVERY_S, CHAT_EVERY_S = 0.01, 0.05


def repeat(unit: bytes, room: int) -> bytes:
    return b",".join([unit] * max(1, room // (len(unit) + 1)))


def extra(items: bytes) -> bytes:
    """A small chat request with `items` in an unknown field (the backend's to ignore)."""
    return HEAD + USER + b'], "x": [' + items + b"]}"


def text(content: str, **fields: str) -> bytes:
    return json.dumps({**SMALL, "messages": [{"role": "user", "content": content}], **fields},
                      ensure_ascii=False).encode()


def image(size: int) -> bytes:
    data = base64.b64encode(os.urandom(size * 3 // 4 - 200)).decode()
    return json.dumps({**SMALL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]}]}).encode()


def responses_items(count: int) -> bytes:
    per = MAX_CONTENT_ITEMS
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}] * per}] * max(1, count // per)
    return json.dumps({"model": "m", "messages": messages, "decoding": {"max_tokens": 4}}).encode()


# name: (path, the body for a size in bytes)
SHAPES: dict[str, tuple[str, Callable[[int], bytes]]] = {
    "objects": (CHAT, lambda n: HEAD + repeat(b"{}", n - 60) + b"]}"),
    "nested 100": (CHAT, lambda n: extra(repeat(b"[" * 100 + b"]" * 100, n - 100))),
    "strings": (CHAT, lambda n: extra(repeat(b'"a"', n - 100))),
    "numbers": (CHAT, lambda n: extra(repeat(b"1.5", n - 100))),
    "one string": (CHAT, lambda n: text("a" * (n - 100))),
    "one string, rewritten": (CHAT, lambda n: text("\u00e9" * ((n - 100) // 2), fairness_key="k")),
    "brackets in text": (CHAT, lambda n: text("f([{a, b}], c) " * ((n - 100) // 15))),
    "image data URL": (CHAT, image),
    # Fewer objects than their bound: what jsonschema walked (~0.15 ms an item) before any maxItems.
    "responses 40k items": ("/v1/responses", lambda n: json.dumps(
        {"model": "m", "input": [{"type": "text", "text": "x"}] * min(40_000, n // 32)}).encode()),
    # The largest that pass the bounds, whatever the size: what an accepted body can cost.
    "bound: objects": (CHAT, lambda n: HEAD + b",".join([USER] * (MAX_CONTAINERS - 10)) + b"]}"),
    "bound: numbers": (CHAT, lambda n: extra(b",".join([b"1.5"] * (MAX_VALUES - 10)))),
    "bound: responses": ("/v1/responses", lambda n: responses_items(MAX_CONTENT_ITEMS_TOTAL)),
}


@dataclass
class Row:
    status: str
    post_s: float
    health_max: float
    health_p50: float
    chat_max: float
    peak_rss_mb: float


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def probe(session: aiohttp.ClientSession, url: str, every: float, done: asyncio.Event,
                body: dict | None = None) -> list[float]:
    """Latencies of one request after another, `every` s apart, until `done`."""
    latencies: list[float] = []
    while not done.is_set():
        start = time.perf_counter()
        if body is None:
            async with session.get(url) as resp:
                await resp.read()
        else:
            async with session.post(url, json=body) as resp:
                await resp.read()
        latencies.append(time.perf_counter() - start)
        try:
            await asyncio.wait_for(done.wait(), every)
        except asyncio.TimeoutError:
            pass
    return latencies


async def idle_health(session: aiohttp.ClientSession, url: str, n: int = 100) -> float:
    latencies = []
    for _ in range(n):
        start = time.perf_counter()
        async with session.get(url + "/health") as resp:
            await resp.read()
        latencies.append(time.perf_counter() - start)
    return pct(latencies, 0.5)


async def measure(session: aiohttp.ClientSession, proxy: ProxyProcess, path: str, raw: bytes) -> Row:
    assert proxy.proc is not None
    done = asyncio.Event()
    health = asyncio.create_task(probe(session, proxy.url + "/health", HEALTH_EVERY_S, done))
    chat = asyncio.create_task(probe(session, proxy.url + CHAT, CHAT_EVERY_S, done, SMALL))
    await asyncio.sleep(0.1)   # both probes running before the body goes
    start = time.perf_counter()
    async with session.post(proxy.url + path, data=raw, headers={"Content-Type": "application/json"}) as resp:
        answer = await resp.read()
        status = str(resp.status)
    post_s = time.perf_counter() - start
    if status != "200":
        try:
            status += " " + json.loads(answer)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            pass
    await asyncio.sleep(0.1)   # a stall that outlasts the answer (freeing the parsed body) counts too
    done.set()
    health_lat, chat_lat = await health, await chat
    return Row(status, post_s, max(health_lat), pct(health_lat, 0.5), max(chat_lat), peak_rss_mb(proxy.proc.pid))


def start_proxy(wrapper: Path, cwd: Path | None) -> ProxyProcess:
    models = {"m": {"backend": "sim", "target_inflight": 8, "enabled": True, "sim": {"python": str(wrapper)}}}
    proxy = at_defaults(ProxyProcess(models, service={"log_level": "warning"}))
    if cwd is not None:
        proxy.cwd = cwd
    proxy.start()
    proxy.wait_state("m", "loaded")
    return proxy


async def bench(args: argparse.Namespace, proxies: dict[str, ProxyProcess]) -> None:
    size = int(args.mib * 1024 * 1024)
    print(f"bodies of {args.mib} MiB (service.max_body_bytes default: {DEFAULT_SERVICE['max_body_bytes'] // 2**20} "
          f"MiB); {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}; bounds: {MAX_CONTAINERS} objects and "
          f"arrays, {MAX_VALUES} values", flush=True)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        idle = {name: await idle_health(session, p.url) for name, p in proxies.items()}
        for name, value in idle.items():
            print(f"{name}: idle GET /health p50 {value * 1e3:.2f} ms")
        print(f"\n{'shape':<24}{'proxy':<10}{'MiB':>6} {'answer':<20}{'post s':>8}{'/health max ms':>15}"
              f"{'p50':>7}{'chat max ms':>12}{'max/idle':>10}{'peak RSS MB':>12}")
        for shape in args.shapes:
            path, make = SHAPES[shape]
            raw = make(size)
            for name, proxy in proxies.items():
                row = await measure(session, proxy, path, raw)
                print(f"{shape:<24}{name:<10}{len(raw) / 2**20:>6.1f} {row.status:<20}{row.post_s:>8.2f}"
                      f"{row.health_max * 1e3:>15.1f}{row.health_p50 * 1e3:>7.1f}{row.chat_max * 1e3:>12.1f}"
                      f"{row.health_max / idle[name]:>10.0f}{row.peak_rss_mb:>12.0f}", flush=True)
            del raw


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=DEFAULT_SERVICE["max_body_bytes"] / 2**20,
                        help="body size (default: service.max_body_bytes' default)")
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=tuple(SHAPES))
    parser.add_argument("--baseline", type=Path, help="another llm-pool source tree whose proxy runs the same "
                        "shapes beside this one's (before/after)")
    args = parser.parse_args()
    wrapper = Path(tempfile.mkdtemp(prefix="lp-bench-")) / "fast-upstream"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(FAST_UPSTREAM)} \"$@\"\n")
    wrapper.chmod(0o755)
    proxies: dict[str, ProxyProcess] = {}
    try:
        proxies["this"] = start_proxy(wrapper, None)
        if args.baseline is not None:
            proxies["baseline"] = start_proxy(wrapper, args.baseline.resolve())
        asyncio.run(bench(args, proxies))
    finally:
        for proxy in proxies.values():
            survivors = proxy.cleanup()
            if survivors:
                print(f"killed leftover processes {survivors}", file=sys.stderr)


if __name__ == "__main__":
    main()
