"""The controller's worker processes (service.workers > 1; docs/workers.md): started with the
service's public listening socket, started again when one exits unexpectedly, and stopped by PID.

A worker that dies loses only the requests it was relaying: its channel's end releases their leases
(proxy/serving/leases.py) and its requests here end as their clients' would when they leave.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.events import WORKER, Events
from proxy.serving.leases import LeaseDesk, private_dir, remove_private_dir

log = logging.getLogger(__name__)

# A worker that exits this soon after its start is started again only after a pause that doubles.
RESTART_BASE_S = 0.5
RESTART_MAX_S = 30.0
STARTUP_TIMEOUT_S = 30.0
ASK_TIMEOUT_S = 1.0


@dataclass
class WorkerProcess:
    index: int
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    restarts: int = 0
    watch: asyncio.Task[None] | None = field(default=None, repr=False)


class Workers:
    """N worker processes over the listening socket `fds`, each told the controller's sockets."""

    def __init__(self, count: int, fds: list[int], desk: LeaseDesk, http_socket: Path, channel_socket: Path,
                 log_level: str, loop_name: str, drain_s: float, events: Events | None = None) -> None:
        self.fds, self.desk, self.events = fds, desk, events
        self.args = ["--controller", str(http_socket), "--channel", str(channel_socket), "--log-level", log_level,
                     "--loop", loop_name, "--drain-s", str(drain_s), *(a for fd in fds for a in ("--fd", str(fd)))]
        self.drain_s = drain_s
        self.procs = [WorkerProcess(i) for i in range(count)]
        self.stopping = False
        # A reload's successor starts its workers while its own output still goes through its
        # predecessor, which exits soon: theirs goes where the predecessor's went (the journal).
        self.output: tuple[int, int] | None = None

    async def start(self) -> None:
        """Every worker started and connected to the channel (or RuntimeError after STARTUP_TIMEOUT_S)."""
        for proc in self.procs:
            await self._spawn(proc)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not all(p.index in self.desk.lines for p in self.procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(self.procs) - len(self.desk.lines)} worker(s) did not connect within "
                                   f"{STARTUP_TIMEOUT_S:g}s")
            self.desk.connected.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.desk.connected.wait(), 0.5)
        log.info("workers: %d serving (pids %s)", len(self.procs),
                 ", ".join(str(p.process.pid) for p in self.procs if p.process is not None))

    async def _spawn(self, proc: WorkerProcess) -> None:
        out, err = self.output or (None, None)
        proc.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy.worker", "--index", str(proc.index), *self.args, pass_fds=self.fds,
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err)
        proc.started = time.monotonic()
        proc.watch = asyncio.create_task(self._watch(proc), name=f"worker {proc.index}")

    async def _watch(self, proc: WorkerProcess) -> None:
        assert proc.process is not None
        code = await proc.process.wait()
        if self.stopping:
            return
        # A worker's death costs the requests it relayed; the service goes on with a new one.
        pause = min(RESTART_MAX_S, RESTART_BASE_S * 2 ** min(proc.restarts, 10)) \
            if time.monotonic() - proc.started < 10 else 0.0
        why = f"worker {proc.index} (pid {proc.process.pid}) exited with {_exit(code)}; starting another"
        log.error("%s%s", why, f" in {pause:g}s" if pause else "")
        if self.events is not None:
            self.events.record(WORKER, why, reason="exited")
        proc.restarts += 1
        if pause:
            await asyncio.sleep(pause)
        if not self.stopping:
            await self._spawn(proc)

    def stop_accepting(self) -> None:
        """SIGTERM to every worker: each stops accepting, finishes what it relays, and exits."""
        self.stopping = True
        for proc in self.procs:
            if proc.process is not None and proc.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.process.send_signal(signal.SIGTERM)

    async def stop(self) -> None:
        """Every worker stopped, by PID: asked, then killed past its drain."""
        self.stop_accepting()
        for proc in self.procs:
            process = proc.process
            if process is None:
                continue
            try:
                await asyncio.wait_for(process.wait(), self.drain_s + 5)
            except TimeoutError:
                log.warning("worker %d (pid %d) did not exit; killing it", proc.index, process.pid)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
            if proc.watch is not None:
                proc.watch.cancel()

    async def view(self) -> list[dict[str, Any]]:
        """Each worker's role, index, PID and what it says of its clients (None where it does not answer)."""
        lines = self.desk.lines
        stats = await asyncio.gather(*(lines[p.index].ask(ASK_TIMEOUT_S) if p.index in lines else _none()
                                       for p in self.procs))
        rows = []
        for proc, said in zip(self.procs, stats):
            process = proc.process
            alive = process is not None and process.returncode is None
            rows.append({"role": "worker", "index": proc.index, "pid": process.pid if process is not None else None,
                         "state": "running" if alive and proc.index in lines else "starting" if alive else "exited",
                         "connections": said.get("connections") if said else None,
                         "requests": said.get("requests") if said else None,
                         "leases": len(lines[proc.index].leases) if proc.index in lines else 0,
                         "restarts": proc.restarts})
        return rows


async def _none() -> None:
    return None


def _exit(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"status {code}"


class Plane:
    """The data plane in workers: the controller's two private sockets (its HTTP app, for what the
    workers pass on, and the channel), and the workers on the public listener."""

    def __init__(self, count: int, desk: LeaseDesk) -> None:
        self.count, self.desk = count, desk
        self.dir: Path | None = None
        self.channel: asyncio.Server | None = None
        self.workers: Workers | None = None

    async def start(self, runner: web.AppRunner, public: list[socket.socket], log_level: str, loop_name: str,
                    drain_s: float, events: Events | None, output: tuple[int, int] | None = None) -> None:
        """`output`: a reload successor's predecessor's stdout and stderr, until `output_switched`."""
        self.dir = private_dir()
        http_socket, channel_socket = self.dir / "http.sock", self.dir / "channel.sock"
        self.channel = await self.desk.serve(channel_socket)
        await web.UnixSite(runner, str(http_socket)).start()
        self.workers = Workers(self.count, [sock.fileno() for sock in public], self.desk, http_socket,
                               channel_socket, log_level, loop_name, drain_s, events)
        self.workers.output = output
        await self.workers.start()

    def output_switched(self) -> None:
        """This process writes to its predecessor's output itself now (handover.Succession): a
        worker started from now on inherits it."""
        if self.workers is not None:
            self.workers.output = None

    def stop_accepting(self) -> None:
        if self.workers is not None:
            self.workers.stop_accepting()

    async def stop(self) -> None:
        """The workers stopped (their requests are done: the controller drained first), then the sockets."""
        if self.workers is not None:
            await self.workers.stop()
        if self.channel is not None:
            self.channel.close()
        if self.dir is not None:
            remove_private_dir(self.dir)


class Processes:
    """What `GET /v1/admin/processes` shows: this process and its workers. Filled in by `serve`."""

    def __init__(self) -> None:
        self.server: web.Server | None = None
        self.plane: Plane | None = None

    async def view(self, inflight: int) -> list[dict[str, Any]]:
        plane = self.plane
        leases = sum(len(line.leases) for line in plane.desk.lines.values()) if plane is not None else 0
        rows: list[dict[str, Any]] = [{
            "role": "controller" if plane is not None else "single", "index": None, "pid": os.getpid(),
            "state": "running", "connections": len(self.server.connections) if self.server is not None else 0,
            "requests": inflight, "leases": leases, "restarts": 0}]
        if plane is not None and plane.workers is not None:
            rows.extend(await plane.workers.view())
        return rows


PROCESSES = web.AppKey("processes", Processes)
