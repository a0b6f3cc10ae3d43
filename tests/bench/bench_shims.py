"""Engines behind shims vs the same engine called in-process by its library, side by side in one run.

For CT2 (tiny decoder) and llama-cpp-python (tiny GGUF): tokens/s and time to first token through
`llm-pool serve` + supervisord + the shim (streamed /v1/completions, the proxy's path) and straight to
the shim, against the library generating the same tokens in this process, at concurrency 1 and at the
model's `target_inflight`. Rounds alternate their order so drift hits all alike. The target is a
ratio of at least 0.9 (proxy+shim tokens/s over library tokens/s).

    .venv/bin/python tests/bench/bench_shims.py [--tokens 512] [--rounds 3] [--ct2-inflight 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not an installed one

from helpers import ProxyProcess  # noqa: E402

PROMPT = "The weather is pleasant today, and I would like to take a walk"


class Run:
    """One request's first-token delay and token count."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.tokens = 0

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.start
        self.tokens += 1


def concurrent(fn: Callable[[Run], None], n: int) -> tuple[list[Run], float]:
    """`n` library calls in parallel threads (as the shim's executor runs them): runs and wall time."""
    runs = [Run() for _ in range(n)]
    start = time.perf_counter()
    threads = [threading.Thread(target=fn, args=(run,)) for run in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return runs, time.perf_counter() - start


# -- the libraries, in-process ------------------------------------------------------------------

def ct2_library(path: Path, workers: int, tokens: int) -> Callable[[Run], None]:
    import ctranslate2
    from tokenizers import Tokenizer

    intra = max(1, (os.cpu_count() or 1) // workers)   # as the shim sizes its workers
    gen = ctranslate2.Generator(str(path), device="cpu", compute_type="int8", inter_threads=workers,
                                intra_threads=intra)
    prompt = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).tokens

    def call(run: Run) -> None:
        run.start = time.perf_counter()
        gen.generate_batch([prompt], max_length=tokens, sampling_topk=1, end_token=[],
                           include_prompt_in_result=False, callback=lambda step: run.token() or False)
    return call


def llama_library(path: Path, tokens: int) -> Callable[[Run], None]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=4096, verbose=False)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    lock = threading.Lock()   # one Llama, one request at a time: as the shim runs it

    def call(run: Run) -> None:
        with lock:
            run.start = time.perf_counter()
            for _ in llm.generate(prompt, temp=0.0, top_k=40, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                llm.detokenize([_])
                run.token()
                if run.tokens >= tokens:
                    break
    return call


# -- through the proxy -----------------------------------------------------------------------------

async def proxy_round(url: str, n: int, tokens: int) -> tuple[list[Run], float]:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def one(session: aiohttp.ClientSession) -> Run:
        run = Run()
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        run.tokens = chunk["usage"]["completion_tokens"]
                    elif run.first is None and chunk["choices"][0]["text"]:
                        run.first = time.perf_counter() - run.start
        return run

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        runs = await asyncio.gather(*(one(session) for _ in range(n)))
        return list(runs), time.perf_counter() - start


def report(name: str, concurrency: int, rounds: dict[str, list[tuple[list[Run], float]]]) -> None:
    def rate(mode: str) -> float:
        return sum(r.tokens for runs, _ in rounds[mode] for r in runs) / sum(wall for _, wall in rounds[mode])

    def ttft(mode: str) -> float:
        return statistics.median(r.first for runs, _ in rounds[mode] for r in runs if r.first is not None) * 1e3

    lib = rate("library")
    print(f"{name:10s} concurrency {concurrency}: tokens/s library {lib:7.0f}  shim {rate('shim'):7.0f} "
          f"(x{rate('shim') / lib:.3f})  proxy+shim {rate('proxy'):7.0f} (x{rate('proxy') / lib:.3f})  |  "
          f"TTFT p50 library {ttft('library'):6.2f} ms  shim {ttft('shim'):6.2f} ms  "
          f"proxy+shim {ttft('proxy'):6.2f} ms",
          flush=True)


def bench(name: str, model: dict[str, Any], library: Callable[[Run], None], inflight: int, rounds: int,
          tokens: int) -> None:
    proxy = ProxyProcess({"m": model}, service={"log_level": "warning"})
    try:
        proxy.start()
        replica = proxy.wait_state("m", "loaded", timeout=300)["replicas"][0]
        shim_url = f"http://127.0.0.1:{replica['port']}"
        asyncio.run(proxy_round(proxy.url, 1, 16))    # warm every path
        asyncio.run(proxy_round(shim_url, 1, 16))
        concurrent(library, 1)
        for concurrency in sorted({1, inflight}):
            got: dict[str, list[tuple[list[Run], float]]] = {"library": [], "shim": [], "proxy": []}
            for r in range(rounds):
                modes = ("library", "shim", "proxy")
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    if mode == "library":
                        got[mode].append(concurrent(library, concurrency))
                    else:
                        url = shim_url if mode == "shim" else proxy.url
                        got[mode].append(asyncio.run(proxy_round(url, concurrency, tokens)))
            report(name, concurrency, got)
    finally:
        survivors = proxy.cleanup()
        if survivors:
            print(f"killed leftover processes {survivors}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ct2-inflight", type=int, default=2, help="target_inflight of the CT2 model")
    parser.add_argument("--only", choices=("ct2", "llama_cpp"))
    args = parser.parse_args()
    print(f"{args.tokens} tokens per request, {args.rounds} alternating rounds, {os.cpu_count()} CPUs", flush=True)
    if args.only in (None, "ct2"):
        from proxy.setup.tiny_ct2 import cached_tiny_ct2

        path = cached_tiny_ct2()["decoder"]
        model = {"backend": "ct2", "model_path": str(path), "device": "cpu", "compute_type": "int8",
                 "target_inflight": args.ct2_inflight, "enabled": True}
        bench("ct2", model, ct2_library(path, args.ct2_inflight, args.tokens), args.ct2_inflight, args.rounds,
              args.tokens)
    if args.only in (None, "llama_cpp"):
        import tempfile

        from proxy.setup.demo_model import write_tiny_gguf
        from proxy.setup.llama_cpp_wheel import ensure_llama_cpp_python

        ensure_llama_cpp_python()
        gguf = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="lp-bench-")) / "tiny.gguf")
        model = {"backend": "llama_cpp", "model_path": str(gguf), "gguf_n_ctx": 4096, "target_inflight": 1,
                 "enabled": True}
        bench("llama_cpp", model, llama_library(gguf, args.tokens), 1, args.rounds, args.tokens)


if __name__ == "__main__":
    main()
