"""The floor of one admission between a worker and its controller, per transport, in one run.

Issue 41 asks the controller to decide for a request in 100 us of CPU or less. What it does per
leased stream today is the whole HTTP app (docs/workers.md); this bench measures only what the
channel itself costs the controller, with a decision that does nothing, so that a redesign knows
its floor before it starts:

- `http+frames` (today's shape): the worker's HTTP request over the controller's Unix socket, a
  `lease` frame back on the worker's channel, `head` and `end` frames from the worker, then the
  HTTP answer. The controller is an aiohttp app with one route, its channel the asyncio streams
  reader of proxy/serving/leases.py.
- `frames/streams`: an `admit` frame, a `lease` frame back, an `end` frame, on the channel alone,
  read with the streams reader (`read_frame`, one coroutine per frame).
- `frames/protocol`: the same frames read by an asyncio Protocol that parses every whole frame a
  read holds and writes the answers to them in one write.

The controller runs in its own process pinned to CPU 0, the worker (this process) on the others;
K requests in flight at once. Per transport: requests/s and the controller's CPU per request
(from /proc), in rounds whose order rotates.

    .venv/bin/python tests/bench/bench_admission.py [--requests 20000] [--concurrency 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not an installed one

from bench_proxy_overhead import cpu_seconds, has_uvloop  # noqa: E402
from helpers import wait_for  # noqa: E402
from proxy.lease_wire import LENGTHS, frame, read_frame  # noqa: E402

MODES = ("http+frames", "frames/streams", "frames/protocol")
LEASE = {"t": "lease", "url": "http://127.0.0.1:8080/v1/chat/completions", "replica": 0, "slot": 3,
         "first_byte_s": 300.0, "idle_s": 120.0}
ADMIT = {"t": "admit", "model": "m", "key": "interactive-ui", "affinity": "5f1c2a9e", "stream": True,
         "path": "/v1/chat/completions"}
END = {"t": "end", "events": 201, "first_s": 0.004, "last_s": 0.41, "sent_end": True}


class Decisions:
    """The controller's stand-in decision: a ticket per request, released at its end."""

    def __init__(self) -> None:
        self.tickets = itertools.count(1)
        self.held: dict[int, str] = {}

    def admit(self, message: dict[str, Any]) -> dict[str, Any]:
        ticket = next(self.tickets)
        self.held[ticket] = str(message.get("model"))
        return {**LEASE, "req": message.get("req"), "ticket": ticket}

    def end(self, message: dict[str, Any]) -> None:
        self.held.pop(message.get("ticket"), None)   # type: ignore[arg-type]


class FrameProtocol(asyncio.Protocol):
    """Every whole frame a read holds, parsed at once; the answers to them in one write."""

    def __init__(self, decisions: Decisions) -> None:
        self.decisions, self.buffer = decisions, bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        out: list[bytes] = []
        at = 0
        while len(buffer) - at >= LENGTHS.size:
            size, length = LENGTHS.unpack_from(buffer, at)
            end = at + LENGTHS.size + size + length
            if len(buffer) < end:
                break
            message = json.loads(buffer[at + LENGTHS.size:at + LENGTHS.size + size])
            at = end
            if message["t"] == "admit":
                out.append(frame(self.decisions.admit(message)))
            else:
                self.decisions.end(message)
        del buffer[:at]
        if out and self.transport is not None:
            self.transport.write(b"".join(out))


async def serve(mode: str, folder: Path) -> None:
    decisions = Decisions()
    line_path, http_path = str(folder / "line"), str(folder / "http")
    if mode == "frames/protocol":
        await asyncio.get_running_loop().create_unix_server(lambda: FrameProtocol(decisions), line_path)
    else:
        lines: dict[int, asyncio.StreamWriter] = {}
        waiting: dict[tuple[int, str], asyncio.Future[dict[str, Any]]] = {}

        async def line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            lines[0] = writer
            while True:
                try:
                    message, _ = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if message["t"] == "admit":
                    writer.write(frame(decisions.admit(message)))
                elif message["t"] == "end" and mode == "frames/streams":
                    decisions.end(message)
                else:   # http+frames: the head and the end answer the request waiting on them
                    future = waiting.pop((message["req"], message["t"]), None)
                    if future is not None and not future.done():
                        future.set_result(message)
        await asyncio.start_unix_server(line, line_path)
        if mode == "http+frames":
            async def request(request: web.Request) -> web.Response:
                message = await request.json()
                req = message["req"]
                loop = asyncio.get_running_loop()
                head = waiting[(req, "head")] = loop.create_future()
                end = waiting[(req, "end")] = loop.create_future()
                lines[0].write(frame(decisions.admit(message)))
                await head
                reply = await end
                decisions.end(reply)
                return web.Response(status=204, headers={"X-LLM-Pool-Relayed": "1"})
            app = web.Application()
            app.router.add_post("/v1/chat/completions", request)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.UnixSite(runner, http_path).start()
    (folder / "ready").touch()
    await asyncio.Event().wait()


class WorkerSide:
    """This process: the worker's end, K requests in flight on one channel (and HTTP connections)."""

    def __init__(self, mode: str, folder: Path) -> None:
        self.mode, self.folder = mode, folder
        self.refs = itertools.count(1)
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.writer: asyncio.StreamWriter | None = None
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        reader, self.writer = await asyncio.open_unix_connection(str(self.folder / "line"))
        asyncio.ensure_future(self._read(reader))
        if self.mode == "http+frames":
            self.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(str(self.folder / "http"), limit=0))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                message, _ = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            future = self.waiting.pop(message["req"], None)
            if future is not None:
                future.set_result(message)

    async def one(self) -> None:
        assert self.writer is not None
        req = next(self.refs)
        future = self.waiting[req] = asyncio.get_running_loop().create_future()
        if self.mode == "http+frames":
            assert self.session is not None
            # The controller answers once the stream ended: the request waits while its lease runs.
            answer = asyncio.ensure_future(self.session.post("http://controller/v1/chat/completions",
                                                             json={**ADMIT, "req": req}))
            lease = await future
            self.writer.write(frame({"t": "head", "req": req, "status": 200}))
            self.writer.write(frame({**END, "req": req, "ticket": lease["ticket"]}))
            async with await answer as resp:
                await resp.read()
                assert resp.status == 204
            return
        self.writer.write(frame({**ADMIT, "req": req}))
        lease = await future
        self.writer.write(frame({**END, "req": req, "ticket": lease["ticket"]}))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.writer is not None:
            self.writer.close()


async def run(worker: WorkerSide, n: int, concurrency: int) -> float:
    left = n

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await worker.one()
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - start


def start_controller(mode: str) -> tuple[subprocess.Popen[bytes], Path]:
    folder = Path(tempfile.mkdtemp(prefix="lp-admit-"))
    proc = subprocess.Popen([sys.executable, __file__, "--serve", mode, "--folder", str(folder)])
    wait_for(lambda: (folder / "ready").exists() or proc.poll() is not None, what=f"the {mode} controller")
    if proc.poll() is not None:
        raise SystemExit(f"{mode}: the controller exited with {proc.returncode}")
    if len(os.sched_getaffinity(0)) > 1:
        for task in os.listdir(f"/proc/{proc.pid}/task"):
            os.sched_setaffinity(int(task), {0})
    return proc, folder


async def bench(args: argparse.Namespace, controllers: dict[str, subprocess.Popen[bytes]],
                folders: dict[str, Path]) -> None:
    workers = {mode: WorkerSide(mode, folders[mode]) for mode in MODES}
    figures = {mode: {"cpu": 0.0, "wall": 0.0, "n": 0} for mode in MODES}
    for worker in workers.values():
        await worker.open()
        await run(worker, 500, args.concurrency)   # warm
    for r in range(args.rounds):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            pid = controllers[mode].pid
            before = cpu_seconds(pid)
            figures[mode]["wall"] += await run(workers[mode], args.requests, args.concurrency)
            figures[mode]["cpu"] += cpu_seconds(pid) - before
            figures[mode]["n"] += args.requests
    for worker in workers.values():
        await worker.close()
    print(f"\n{args.requests} requests x {args.rounds} rounds per transport, {args.concurrency} in flight; "
          f"the controller pinned to CPU 0 ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"{'uvloop' if has_uvloop() else 'asyncio'})")
    print(f"  {'transport':<18}{'requests/s':>12}{'controller CPU/request us':>28}{'vs today':>10}")
    today = figures["http+frames"]["cpu"] / figures["http+frames"]["n"]
    for mode, f in figures.items():
        per = f["cpu"] / f["n"]
        print(f"  {mode:<18}{f['n'] / f['wall']:>12,.0f}{per * 1e6:>28.1f}{per / today:>9.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if has_uvloop():
        import uvloop
        loop_factory = uvloop.new_event_loop
    if args.serve is not None:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(args.serve, args.folder))
        return
    controllers: dict[str, subprocess.Popen[bytes]] = {}
    folders: dict[str, Path] = {}
    cpus = os.sched_getaffinity(0)
    try:
        for mode in MODES:
            controllers[mode], folders[mode] = start_controller(mode)
        if len(cpus) > 1:
            os.sched_setaffinity(0, cpus - {0})   # the worker's side off the controller's core
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(bench(args, controllers, folders))
    finally:
        for proc in controllers.values():
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
