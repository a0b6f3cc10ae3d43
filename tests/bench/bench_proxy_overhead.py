"""What one llm-pool hop costs next to a bare aiohttp forwarder's hop, side by side in one run.

The upstream is fast and cheap by default: the sim engine (shims/sim.py) with no prefill, no
time to first token and a million tokens/s, under supervisord as llm-pool runs it, so that an
engine's own CPU on the same cores neither hides nor inflates the hop. Each round sends the same
requests straight to the replica, through a bare aiohttp forwarder (tests/bench/forwarder.py, its
own process) and through `llm-pool serve`, in an order that rotates every round so drift hits all
alike, at concurrency 1 and 16, non-streamed and streamed. It prints what each hop adds to p50 and
p99, the CPU time per request of the forwarder's and the proxy's process (from /proc), and the
ratios proxy/forwarder. `--upstream llama-server` puts the tiny GGUF on llama-server behind both.

    .venv/bin/python tests/bench/bench_proxy_overhead.py [--rounds 6] [--requests 200] [--upstream sim]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not an installed one

from helpers import ProxyProcess, free_port, wait_for  # noqa: E402

MESSAGES = [{"role": "user", "content": "Hi"}]
BODIES = {"json": {"model": "m", "messages": MESSAGES, "max_tokens": 4, "temperature": 0},
          "stream": {"model": "m", "messages": MESSAGES, "max_tokens": 16, "temperature": 0, "stream": True}}
MODES = ("direct", "forwarder", "proxy")
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().split(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def run_round(session: aiohttp.ClientSession, url: str, n: int, concurrency: int,
                    body: dict = BODIES["json"]) -> tuple[list[float], float]:
    """`n` requests of `body` to `url` by `concurrency` workers, each read to its end: each latency,
    and the wall time (bench_remote, bench_responses and bench_vllm use it too)."""
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


async def bench(urls: dict[str, str], pids: dict[str, int], rounds: int, n: int) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for url in urls.values():  # warm every path
            for body in BODIES.values():
                await run_round(session, url + "/v1/chat/completions", 20, 4, body)
        for kind, body in BODIES.items():
            for concurrency in (1, 16):
                lat: dict[str, list[float]] = {m: [] for m in MODES}
                cpu = {m: 0.0 for m in pids}
                for r in range(rounds):
                    order = MODES[r % 3:] + MODES[:r % 3]
                    for mode in order:
                        before = {m: cpu_seconds(pid) for m, pid in pids.items()}
                        lat[mode] += (await run_round(session, urls[mode] + "/v1/chat/completions", n, concurrency,
                                                      body))[0]
                        if mode in pids:
                            cpu[mode] += cpu_seconds(pids[mode]) - before[mode]
                total = rounds * n
                p50 = {m: pct(lat[m], 0.5) * 1e3 for m in MODES}
                p99 = {m: pct(lat[m], 0.99) * 1e3 for m in MODES}
                per = {m: cpu[m] / total * 1e3 for m in pids}
                print(f"{kind:6s} concurrency {concurrency:>2}: {total} requests each way, {rounds} rotating rounds")
                print(f"  p50  direct {p50['direct']:6.2f} ms  forwarder +{p50['forwarder'] - p50['direct']:5.2f} ms  "
                      f"proxy +{p50['proxy'] - p50['direct']:5.2f} ms")
                print(f"  p99  direct {p99['direct']:6.2f} ms  forwarder +{p99['forwarder'] - p99['direct']:5.2f} ms  "
                      f"proxy +{p99['proxy'] - p99['direct']:5.2f} ms")
                added_f, added_p = p50["forwarder"] - p50["direct"], p50["proxy"] - p50["direct"]
                ratio = f"{added_p / added_f:.2f}" if added_f > 0 else "n/a"
                print(f"  CPU per request  forwarder {per['forwarder']:.3f} ms  proxy {per['proxy']:.3f} ms  "
                      f"(proxy/forwarder: CPU {per['proxy'] / per['forwarder']:.2f}, p50 added {ratio})",
                      flush=True)


def start_forwarder(upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forwarder.py")), "--port", str(port),
                             "--upstream", upstream])
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _listening(port) or proc.poll() is not None, what="the forwarder to listen")
    if proc.poll() is not None:
        raise SystemExit(f"the forwarder exited with {proc.returncode}")
    return proc, url


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def upstream_model(kind: str) -> dict:
    if kind == "sim":
        return {"backend": "sim", "target_inflight": 16, "enabled": True,
                "sim": {"max_seqs": 16, "decode_tokens_per_s": 1e6, "prefill_tokens_per_s": 1e9, "ttft_ms": 0}}
    import tempfile

    from proxy.setup.demo_model import write_tiny_gguf
    from proxy.setup.llama_build import build_llama_server
    gguf = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="lp-bench-")) / "tiny.gguf")
    return {"backend": "llama_server", "model_path": str(gguf), "llama_server_binary": str(build_llama_server()),
            "llama_server_n_ctx": 8192, "target_inflight": 16, "enabled": True}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=200, help="requests per round and mode")
    parser.add_argument("--upstream", choices=("sim", "llama-server"), default="sim")
    args = parser.parse_args()
    proxy = ProxyProcess({"m": upstream_model(args.upstream)}, service={"log_level": "warning"})
    forwarder: subprocess.Popen[bytes] | None = None
    try:
        proxy.start()
        assert proxy.proc is not None
        direct = f"http://127.0.0.1:{proxy.wait_state('m', 'loaded')['replicas'][0]['port']}"
        forwarder, forwarder_url = start_forwarder(direct)
        print(f"upstream: {args.upstream}; {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}", flush=True)
        asyncio.run(bench({"direct": direct, "forwarder": forwarder_url, "proxy": proxy.url},
                          {"forwarder": forwarder.pid, "proxy": proxy.proc.pid}, args.rounds, args.requests))
    finally:
        if forwarder is not None:
            forwarder.terminate()
            forwarder.wait(30)
        survivors = proxy.cleanup()
        if survivors:
            print(f"killed leftover processes {survivors}", file=sys.stderr)


if __name__ == "__main__":
    main()
