"""What relaying one streamed event costs llm-pool, beside a bare aiohttp forwarder, in one run.

The hop is the only process on its core: llm-pool's serve process (and each forwarder) is pinned to
CPU 0, while the stand-in engine (FastUpstream, tests/fakes.py: SSE events one `--gap-ms` apart)
and this client run on the others. K streams at once, each `--events` events long, in rounds
whose order rotates so that drift hits every target alike. Per target: events relayed per second
(the client's count over the round's wall time) and the hop process's CPU per relayed event (from
/proc, all its threads; and of it the kernel's, its socket calls), and the ratio to the forwarder's.

Where the machine has one CPU nothing is pinned and the hop shares it with the engine and the
client: the CPU per event still holds, the events/s do not.

    .venv/bin/python tests/bench/bench_stream_cost.py [--streams 32] [--events 200] [--gap-ms 2] [--rounds 4]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not an installed one

from bench_proxy_overhead import TICKS, at_defaults, cpu_seconds, fast_upstream, forwarder, has_uvloop  # noqa: E402
from helpers import ProxyProcess  # noqa: E402

CHAT = "/v1/chat/completions"
EVENT = b"data:"
HOP_CPU = 0   # the core the hop under test has to itself


@dataclass
class Target:
    name: str
    url: str
    pid: int
    workers: tuple[int, ...] = ()   # service.workers > 1: the workers' PIDs (`pid` is their controller)
    events: int = 0
    streams: int = 0
    wall: float = 0.0
    cpu: float = 0.0      # the hop's: every process of it
    kernel: float = 0.0   # of `cpu`, the system time (clock ticks: coarse, summed over the rounds)
    controller: float = 0.0   # of `cpu`, the controller's, where there are workers

    @property
    def pids(self) -> tuple[int, ...]:
        return (self.pid, *self.workers)


def system_seconds(pid: int) -> float:
    """The system CPU time of `pid` (all its threads) so far: the kernel's share, its socket calls."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(") ", 1)[1].split()[12]) / TICKS


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict) -> int:
    """The events of one streamed answer, counted as they arrive (a read may hold several)."""
    events = 0
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, (url, resp.status, await resp.text())
        async for chunk in resp.content.iter_any():
            events += chunk.count(EVENT)
    return events


async def run_round(session: aiohttp.ClientSession, target: Target, streams: int, body: dict) -> None:
    pids = target.pids
    before, kernel, controller = sum(map(cpu_seconds, pids)), sum(map(system_seconds, pids)), cpu_seconds(target.pid)
    start = time.perf_counter()
    counts = await asyncio.gather(*(one_stream(session, target.url + CHAT, body) for _ in range(streams)))
    target.wall += time.perf_counter() - start
    target.cpu += sum(map(cpu_seconds, pids)) - before
    target.kernel += sum(map(system_seconds, pids)) - kernel
    target.controller += cpu_seconds(target.pid) - controller
    target.events += sum(counts)
    target.streams += streams


def pin(pid: int, cpus: set[int]) -> None:
    """`pid` and all its threads on `cpus` (a thread started before the call keeps its own mask)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cpus)


async def bench(args: argparse.Namespace, targets: list[Target]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": args.events,
            "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for t in targets:   # warm every path
            await run_round(session, Target(t.name, t.url, t.pid, t.workers), 4, body)
        for r in range(args.rounds):
            for t in targets[r % len(targets):] + targets[:r % len(targets)]:
                await run_round(session, t, args.streams, body)
    offered = args.streams * 1000 / args.gap_ms
    print(f"\n{args.streams} streams x {args.events + 1} events ({args.gap_ms:g} ms apart upstream: "
          f"{offered:,.0f} events/s offered), {args.rounds} rounds per target")
    print(f"  {'target':<14}{'events/s':>10}{'CPU/event us':>14}{'of it kernel':>14}{'vs forwarder':>14}")
    base = next(t for t in targets if t.name == "forwarder")
    for t in targets:
        per_event = t.cpu / t.events * 1e6
        ratio = per_event / (base.cpu / base.events * 1e6)
        print(f"  {t.name:<14}{t.events / t.wall:>10,.0f}{per_event:>14.1f}{t.kernel / t.events * 1e6:>14.1f}"
              f"{ratio:>13.2f}x")
    ours = next(t for t in targets if t.name == "llm-pool")
    print(f"\nllm-pool / forwarder, CPU per relayed event: {ours.cpu / ours.events / (base.cpu / base.events):.2f}x "
          f"(goal from issue 41: <= 0.4x); one core relays at most about "
          f"{ours.events / ours.cpu:,.0f} events/s through llm-pool, {base.events / base.cpu:,.0f} through the forwarder")
    for t in targets:
        if t.workers:
            relay = (t.cpu - t.controller) / t.events * 1e6
            per_stream = t.controller / t.streams * 1e6
            print(f"{t.name}: the workers' CPU per relayed event {relay:.1f} us ({relay / (ours.cpu / ours.events * 1e6):.2f}x "
                  f"one process's); the controller's CPU per stream {per_stream:.0f} us (one controller decides for "
                  f"about {1e6 / per_stream:,.0f} streams/s); each added core relays about "
                  f"{t.events / (t.cpu - t.controller):,.0f} events/s (a worker's core, busy)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=32, help="streams at once (K)")
    parser.add_argument("--events", type=int, default=200, help="content events per stream")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="time between two events of a stream upstream")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 50-event streams: the same table, noisier")
    parser.add_argument("--workers", type=int, default=2, help="one more target: llm-pool with service.workers "
                        "this many (all its processes on the hop's core; below 2: none)")
    parser.add_argument("--baseline", type=Path, help="another llm-pool source tree (a `git worktree` of the "
                        "commit before a change) whose proxy runs as one more target, for A/B figures")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.events = 2, 50
    wrapper = fast_upstream(args.events, args.gap_ms)
    cpus = os.sched_getaffinity(0)
    pinned = len(cpus) > 1
    if pinned:
        os.sched_setaffinity(0, cpus - {HOP_CPU})   # the client, and what it starts, off the hop's core
    models = {"m": {"backend": "sim", "target_inflight": 4096, "enabled": True, "sim": {"python": str(wrapper)}}}
    proxy = at_defaults(ProxyProcess(models, service={"log_level": "warning"}))
    baseline = None
    extra: list[ProxyProcess] = []
    procs = []
    try:
        proxy.start()
        assert proxy.proc is not None
        direct = f"http://127.0.0.1:{proxy.wait_state('m', 'loaded')['replicas'][0]['port']}"
        targets = [Target("llm-pool", proxy.url, proxy.proc.pid)]
        if args.baseline is not None:
            baseline = at_defaults(ProxyProcess(models, service={"log_level": "warning"}))
            baseline.cwd = args.baseline.resolve()
            baseline.start()
            assert baseline.proc is not None
            baseline.wait_state("m", "loaded")
            targets.append(Target("llm-pool@base", baseline.url, baseline.proc.pid))
        if args.workers > 1:
            split = at_defaults(ProxyProcess(models, service={"log_level": "warning", "workers": args.workers}))
            extra.append(split)
            split.start()
            assert split.proc is not None
            split.wait_state("m", "loaded")
            workers = split.worker_pids()
            targets.append(Target(f"llm-pool w{args.workers}", split.url, split.proc.pid, workers))
        for name, on_uvloop in (("forwarder", False), ("fwd-uvloop", True)):
            if on_uvloop and not has_uvloop():
                continue
            proc, url = forwarder(direct, on_uvloop)
            procs.append(proc)
            targets.append(Target(name, url, proc.pid))
        if pinned:
            for t in targets:
                for pid in t.pids:
                    pin(pid, {HOP_CPU})
        print(f"upstream: FastUpstream; {os.cpu_count()} CPUs; hop pinned to CPU {HOP_CPU}: "
              f"{'yes' if pinned else 'no (one CPU)'}; load {os.getloadavg()[0]:.2f}; "
              f"llm-pool's event loop: {'uvloop' if has_uvloop() else 'asyncio'}", flush=True)
        asyncio.run(bench(args, targets))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        for each in (proxy, baseline, *extra):
            survivors = each.cleanup() if each is not None else []
            if survivors:
                print(f"killed leftover processes {survivors}", file=sys.stderr)


if __name__ == "__main__":
    main()
