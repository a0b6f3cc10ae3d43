"""KV cache across swaps (issue 33): the turn after an eviction, with the slot store and without,
beside the same turn on a model that was never evicted; real llama-servers of the tiny GGUF, one
run, the modes side by side.

Two models on the tiny GGUF, room for one (max_loaded_models 1). Per mode: SESSIONS conversations
with histories of 1.5-2k tokens (about a token a character) on A, each answered once; a request for
B evicts A; an admin load brings A back (its load time is not a turn's); then each conversation's
next turn, one at a time. Measured per turn: the prompt tokens llama-server processed
(`timings.prompt_n`, and its `prompt_ms`) and the time to first token at the client (streamed). The baseline is the same
kind of turn on A before anything was evicted (every conversation in its slot, in memory).
Goal (the issue): at least 10x fewer prompt tokens than with the store off, and time to first token
within 1.5x of the never-evicted turn.

    .venv/bin/python tests/bench/bench_kv_swap.py [--sessions 4] [--chars 1700] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not tests/proxy

from chat_stream import read_stream  # noqa: E402
from helpers import ProxyProcess, http, wait_for  # noqa: E402

WORDS = ("archive ledger harbor signal meadow copper lantern orbit valley cipher summit ember quartz "
         "river falcon marble glacier tundra beacon violet anchor prism").split()


def words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)


async def turn(session: aiohttp.ClientSession, url: str, model: str, key: str,
               messages: list[dict[str, str]]) -> dict[str, Any]:
    """One streamed turn: time to first content, the prompt tokens processed, the answer's text."""
    # llama-server's timings come on the usage chunk, which the proxy relays only to a client that asks.
    body = {"model": model, "messages": messages, "max_tokens": 4, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": key}) as resp:
        assert resp.status == 200, await resp.text()
        got = await read_stream(resp)
    return {"ttft": (got.first or time.perf_counter()) - started, "prompt_n": got.timings.get("prompt_n", 0),
            "prompt_ms": got.timings.get("prompt_ms", 0.0), "text": got.text or "-"}


async def first_turns(url: str, model: str, keys: list[str], rng: random.Random,
                      chars: int) -> dict[str, list[dict[str, str]]]:
    """Each conversation's history, answered once: what its next turn repeats."""
    histories = {}
    async with aiohttp.ClientSession() as session:
        for key in keys:
            messages = [{"role": "system", "content": f"{key}: " + words(rng, chars)},
                        {"role": "user", "content": "Where were we?"}]
            answer = await turn(session, url, model, key, messages)
            histories[key] = [*messages, {"role": "assistant", "content": answer["text"]}]
    return histories


async def next_turns(url: str, model: str, histories: dict[str, list[dict[str, str]]]) -> list[dict[str, Any]]:
    out = []
    async with aiohttp.ClientSession() as session:
        for key, messages in histories.items():
            out.append(await turn(session, url, model, key, [*messages, {"role": "user", "content": "And then?"}]))
    return out


def run_mode(base: dict[str, Any], kv_store_mib: float, sessions: int, chars: int, seed: int) -> dict[str, Any]:
    proxy = ProxyProcess({"a": base, "b": base}, service={"log_level": "warning"},
                         engine={"lifecycle": {"max_loaded_models": 1, "min_residence_s": 0,
                                               "kv_store_mib": kv_store_mib}})
    try:
        proxy.start()
        rng = random.Random(seed)
        http("POST", proxy.url + "/v1/admin/models/a/load", body={})
        # Never evicted: a conversation's next turn with its slot in memory.
        warm = asyncio.run(first_turns(proxy.url, "a", [f"warm{i}" for i in range(sessions)], rng, chars))
        never = asyncio.run(next_turns(proxy.url, "a", warm))
        # The measured ones: answered once, then A is evicted for B and loaded again.
        histories = asyncio.run(first_turns(proxy.url, "a", [f"s{seed}-{i}" for i in range(sessions)], rng, chars))
        history_tokens = [len(m[0]["content"]) for m in histories.values()]
        status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                               body={"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert status == 200, body
        wait_for(lambda: proxy.admin_model("a")["state"] == "unloaded", what="a evicted")
        status, _, body = http("POST", proxy.url + "/v1/admin/models/a/load", body={})
        assert status == 200, body
        after = asyncio.run(next_turns(proxy.url, "a", histories))
        return {"never": never, "after": after, "kv": proxy.admin_model("a").get("kv_store"),
                "history_chars": history_tokens}
    finally:
        survivors = proxy.cleanup()
        if survivors:
            print(f"killed leftover processes {survivors}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=4, help="conversations per mode (one slot each)")
    parser.add_argument("--chars", type=int, default=1700, help="history per conversation (about a token each)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both modes, alternated")
    args = parser.parse_args()
    from proxy.setup.demo_model import write_tiny_gguf
    from proxy.setup.llama_build import build_llama_server
    gguf = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="lp-bench-")) / "tiny.gguf")
    base = {"backend": "llama_server", "model_path": str(gguf), "llama_server_binary": str(build_llama_server()),
            "llama_server_n_ctx": 4096, "target_inflight": args.sessions, "enabled": False,
            "load_on_demand": True, "llama_server_extra_args": ["--threads", "1"]}
    results: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for mode, mib in (("on", 256.0), ("off", 0.0)):
            results[mode].append(run_mode(base, mib, args.sessions, args.chars, seed=r * 10 + (mode == "on")))

    def stat(mode: str, which: str, field: str) -> float:
        return statistics.median(t[field] for res in results[mode] for t in res[which])

    print(f"{args.sessions} conversations x {args.rounds} rounds per mode, histories of about {args.chars} tokens; "
          "the turn after A was evicted for B and loaded again", flush=True)
    print(f"{'mode':<26} {'prompt tokens processed':>24} {'prefill (engine)':>17} {'ttft p50':>10}")
    rows = [("store on, after eviction", "on", "after"), ("store off, after eviction", "off", "after"),
            ("never evicted", "on", "never")]
    for label, mode, which in rows:
        print(f"{label:<26} {stat(mode, which, 'prompt_n'):>24.0f} {stat(mode, which, 'prompt_ms'):>15.1f}ms "
              f"{stat(mode, which, 'ttft') * 1000:>8.1f}ms")
    on_tokens, off_tokens = stat("on", "after", "prompt_n"), stat("off", "after", "prompt_n")
    print(f"prompt tokens reprocessed: store off / on = {off_tokens / max(on_tokens, 1):.1f}x fewer (goal >= 10x)")
    print(f"ttft after eviction, store on / never evicted = "
          f"{stat('on', 'after', 'ttft') / stat('on', 'never', 'ttft'):.2f}x (goal <= 1.5x); "
          f"store off / never evicted = {stat('off', 'after', 'ttft') / stat('on', 'never', 'ttft'):.2f}x")
    print(f"store: {results['on'][-1]['kv']}")


if __name__ == "__main__":
    main()
