"""Affinity benchmark: multi-turn sessions through the real proxy to llama-server replicas, routed
least_loaded and affinity side by side in one run.

Models on the tiny GGUF, the same but for routing (least_loaded; affinity with its defaults; affinity
with affinity_max_wait_s 0, the rule before the wait; and with the earlier default bound): three
llama-server replicas each, 2 slots and one thread each. Rounds alternate between them; a round runs SESSIONS concurrent multi-turn sessions (streamed
chat, each turn the whole history so far plus a new question), every session with a system prompt
of its own (long: about 1,100 tokens, 1,100 to 1,900 with the history; short: a few words). Printed
per prompt length and policy: the fraction of prompt tokens served from the engines' prefix cache
(turns 2 on, where any router could hit; and all turns), time to first token p50/p95 at the client,
total time, requests per replica (balance), and for affinity the spills (a key's replica full or
too busy, sent elsewhere) and waits (a request that waited for its key's full replica).

Each replica's host-memory prompt cache (llama-server's --cache-ram) is bounded, as a deployment's
is: the default 8 GiB holds about 10,000 of these tiny-model conversations (0.8 MiB each), every
conversation the benchmark has, so any replica that saw a conversation once serves its later turns
from cache whatever the router did. A deployment's cache holds a few conversations per replica
(an 8B model's 2,000-token conversation is about 256 MiB of KV), not all the pool serves: with the
default 4 MiB a replica keeps its 2 slots' prompts and about 4 more, roughly its share of the
sessions under affinity and a third of them under least_loaded. --cache-mib 0 leaves only the slots
(as vLLM's cache is its KV blocks); more sessions than slots then miss under any router.

One thread per replica (--threads 1): llama.cpp's default is a thread per core, and several
replicas' spinning thread pools on one machine's few cores then spend most of the CPU waiting on
each other (measured: every turn 5 times slower under both policies), which is nothing a GPU
deployment, one device per replica, pays.

    .venv/bin/python tests/bench/bench_affinity.py [--sessions 8] [--turns 8] [--rounds 3] \
        [--replicas 3] [--cache-mib 4] [--threads 1]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not tests/proxy

from chat_stream import read_stream  # noqa: E402
from helpers import ProxyProcess  # noqa: E402

WORDS = ("archive ledger harbor signal meadow copper lantern orbit valley cipher summit ember quartz "
         "river falcon marble glacier tundra beacon violet anchor prism").split()
# Model name: its routing fields. affinity-wait0 is affinity with the rule before
# affinity_max_wait_s (a full home spills at once), for the difference the wait makes; affinity-half
# has the earlier default bound (half of target_inflight: 1 request here) for the difference the
# default target_inflight makes.
POLICIES: dict[str, dict[str, Any]] = {
    "least_loaded": {"routing": "least_loaded"},
    "affinity-wait0": {"routing": "affinity", "affinity_max_wait_s": 0},
    "affinity-half": {"routing": "affinity", "affinity_max_imbalance": 1},
    "affinity": {"routing": "affinity"},
}


def system_prompt(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)


async def turn(session: aiohttp.ClientSession, url: str, model: str,
               messages: list[dict[str, str]]) -> dict[str, Any]:
    """One streamed turn: time to first content, the usage, the replica, the answer's text."""
    body = {"model": model, "messages": messages, "max_tokens": 8, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        replica = resp.headers["X-Replica"]
        got = await read_stream(resp)
    details = got.usage.get("prompt_tokens_details") or {}
    return {"ttft": (got.first or time.perf_counter()) - started, "prompt": got.usage.get("prompt_tokens", 0),
            "cached": details.get("cached_tokens", 0), "replica": replica, "text": got.text or "-"}


async def one_session(url: str, model: str, system: str, turns: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": system}]
    out = []
    async with aiohttp.ClientSession() as session:
        for i in range(turns):
            messages.append({"role": "user", "content": f"Question {i}: " + system_prompt(rng, 30)})
            result = await turn(session, url, model, messages)
            result["turn"] = i
            out.append(result)
            messages.append({"role": "assistant", "content": result["text"]})
    return out


async def one_round(url: str, model: str, sessions: int, turns: int, chars: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    systems = [system_prompt(rng, chars) for _ in range(sessions)]   # distinct per session and round
    started = time.perf_counter()
    results = await asyncio.gather(*(one_session(url, model, s, turns, seed * 100 + i)
                                     for i, s in enumerate(systems)))
    return {"elapsed": time.perf_counter() - started, "turns": [t for r in results for t in r]}


def routing_counts(proxy: ProxyProcess, model: str) -> Counter[str]:
    """The model's affinity picks, spills and waits so far, over its replicas (admin view)."""
    totals: Counter[str] = Counter()
    for replica in proxy.admin_model(model)["replicas"]:
        for field in ("affinity_picks", "affinity_spills", "affinity_waits"):
            totals[field] += replica.get(field, 0)
    return totals


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    turns = [t for r in rounds for t in r["turns"]]
    later = [t for t in turns if t["turn"] > 0]
    ttfts = sorted(t["ttft"] for t in turns)
    return {
        "cached_later": sum(t["cached"] for t in later) / max(1, sum(t["prompt"] for t in later)),
        "cached_all": sum(t["cached"] for t in turns) / max(1, sum(t["prompt"] for t in turns)),
        "ttft_p50": statistics.median(ttfts) * 1000,
        "ttft_p95": ttfts[int(0.95 * (len(ttfts) - 1))] * 1000,
        "ttft_later_p50": statistics.median(t["ttft"] for t in later) * 1000,
        "total": sum(r["elapsed"] for r in rounds),
        "per_replica": dict(sorted(Counter(t["replica"] for t in turns).items())),
        "prompt_tokens": statistics.mean(t["prompt"] for t in turns),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per policy and prompt length, alternated")
    parser.add_argument("--replicas", type=int, default=3, help="replicas per policy, 2 slots each")
    parser.add_argument("--cache-mib", type=int, default=4,
                        help="each replica's host prompt cache (llama-server --cache-ram, MiB; 0: only its slots)")
    parser.add_argument("--threads", type=int, default=1,
                        help="llama-server --threads per replica (0: its default, every core)")
    parser.add_argument("--only", choices=("long", "short"), help="one prompt length only")
    args = parser.parse_args()
    from proxy.setup.demo_model import write_tiny_gguf
    from proxy.setup.llama_build import build_llama_server
    gguf = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="lp-bench-")) / "tiny.gguf")
    base = {"backend": "llama_server", "model_path": str(gguf), "llama_server_binary": str(build_llama_server()),
            "llama_server_n_ctx": 2048, "target_inflight": 2, "replicas": args.replicas,
            "replica_max": args.replicas, "enabled": True,
            "llama_server_extra_args": ["--cache-ram", str(args.cache_mib),
                                        *(["--threads", str(args.threads)] if args.threads else [])]}
    proxy = ProxyProcess({p: {**base, **fields} for p, fields in POLICIES.items()}, service={"log_level": "warning"})
    try:
        proxy.start()
        for p in POLICIES:
            proxy.wait_replicas_ready(p, args.replicas, timeout=120)
        print(f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}; {args.sessions} sessions x {args.turns} turns, "
              f"{args.replicas} replicas x 2 slots per policy, --cache-ram {args.cache_mib} MiB and "
              f"--threads {args.threads or 'default'} each, "
              f"{args.rounds} round(s) each, alternated", flush=True)
        print(f"{'prompts':<7} {'policy':<16} {'tokens':>6} {'cached 2+':>9} {'cached':>7} {'ttft p50':>9} "
              f"{'ttft p95':>9} {'ttft 2+':>9} {'total s':>8}  requests per replica; affinity: picks/spills/waits")
        seed = 1
        lengths = [(label, chars) for label, chars in (("long", 1100), ("short", 24)) if args.only in (None, label)]
        for label, chars in lengths:
            rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
            before = {p: routing_counts(proxy, p) for p in POLICIES}
            for _ in range(args.rounds):
                for policy in POLICIES:
                    rounds[policy].append(asyncio.run(one_round(proxy.url, policy, args.sessions, args.turns,
                                                                chars, seed)))
                    seed += 1
            counts = {p: routing_counts(proxy, p) - before[p] for p in POLICIES}
            figures = {p: summary(rounds[p]) for p in POLICIES}
            for policy, s in figures.items():
                c = counts[policy]
                extra = "" if POLICIES[policy]["routing"] != "affinity" else \
                    f"  {c['affinity_picks']}/{c['affinity_spills']}/{c['affinity_waits']}"
                print(f"{label:<7} {policy:<16} {s['prompt_tokens']:>6.0f} {s['cached_later']:>9.3f} "
                      f"{s['cached_all']:>7.3f} {s['ttft_p50']:>7.1f}ms {s['ttft_p95']:>7.1f}ms {s['ttft_later_p50']:>7.1f}ms "
                      f"{s['total']:>8.2f}  "
                      f"{s['per_replica']}{extra}", flush=True)
            ll = figures["least_loaded"]
            for policy in (p for p in POLICIES if p != "least_loaded"):
                aff = figures[policy]
                print(f"{label:<7} {policy} / least_loaded: ttft p50 {ll['ttft_p50'] / aff['ttft_p50']:.2f}x better, "
                      f"p95 {ll['ttft_p95'] / aff['ttft_p95']:.2f}x, turns 2+ p50 {ll['ttft_later_p50'] / aff['ttft_later_p50']:.2f}x, "
                      f"total time {ll['total'] / aff['total']:.2f}x",
                      flush=True)
    finally:
        survivors = proxy.cleanup()
        if survivors:
            print(f"killed leftover processes {survivors}", file=sys.stderr)


if __name__ == "__main__":
    main()
