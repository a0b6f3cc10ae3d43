"""A reload without downtime, the predecessor's side: SIGUSR1 makes the running proxy start its
successor itself and hand it the service.

The successor is the same `llm-pool serve` command (so the code and settings on disk now are the
ones it runs), given this process's listening sockets, the state folder's lock, a control socket
and this process's stdout and stderr (proxy/serving/handover.py). Meanwhile this process serves
as before. The successor adopts every running replica, starts accepting on the shared sockets and
writes `ready`; only then does this process answer `go` (with its counters, and the events journal
becomes the successor's, so that the record goes on: proxy/serving/carried.py, proxy/events.py),
tell systemd the main PID changed, and stop accepting (serve, in proxy/serving/app.py: it stops
its lifecycle decisions, answers what still comes on its open connections with `Connection:
close`, lets its requests finish, sends its last counters, and exits 0 leaving supervisord and
the models running).

A successor that exits first (a settings mistake: exit 2), or is not ready within
service.reload_timeout_s, or is overtaken by a stop signal, is stopped; this process logs why
with the successor's last lines and goes on serving as if nothing happened. A reload with a
broken config changes nothing, and a later SIGUSR1 tries again.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from functools import partial
from typing import IO, Sequence

from aiohttp import web

from proxy.events import RELOAD, Event
from proxy.serving.handover import ABORT, COUNTERS, EVENT, GO, READY, handover_environ, message
from proxy.serving.keys import METRICS, POOL, SETTINGS
from proxy.serving.sd_notify import monotonic_usec, notify
from proxy.serving.shutdown import SHUTDOWN

log = logging.getLogger(__name__)
TAIL_LINES = 20
# A successor told to stop before it took over leaves everything as it is; it gets this long.
STOP_WAIT_S = 30.0
# Its output may still be in the pipe when it has exited.
TAIL_WAIT_S = 2.0
EXIT_POLL_S = 0.05


def successor_argv() -> list[str]:
    """This process's command line, run again by the same interpreter: `llm-pool serve` or
    `python -m proxy.cli serve`, with every option as given."""
    return [sys.executable, *sys.orig_argv[1:]]


class Reloader:
    """Starts a successor on SIGUSR1 and hands it the service; one reload at a time."""

    def __init__(self, app: web.Application, socks: Sequence[socket.socket], lock: IO[str]) -> None:
        self.app = app
        self.settings = app[SETTINGS]
        self.socks = socks
        self.lock = lock
        self.shutdown = app[SHUTDOWN]
        self.serving = False   # set once it serves: a reload during the startup would hand over half a start
        self.task: asyncio.Task[None] | None = None
        self.successor: int | None = None
        # Kept open until this process exits: the successor learns of the exit by its closing.
        self._control: asyncio.StreamWriter | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._relay: asyncio.Task[None] | None = None

    def request(self) -> None:
        """SIGUSR1."""
        if self.shutdown.handed_over:
            log.warning("SIGUSR1 ignored: this process already handed over to pid %s and is finishing its "
                        "requests", self.successor)
            return
        if self.shutdown.started:
            log.warning("SIGUSR1 ignored: shutting down")
            return
        if not self.serving:
            log.warning("SIGUSR1 ignored: still starting; send it again once the proxy serves")
            return
        if self.task is not None and not self.task.done():
            log.warning("SIGUSR1 ignored: a reload is under way (successor pid %s)", self.successor)
            return
        self.task = asyncio.create_task(self._reload(), name="llm-pool reload")

    async def cancel(self) -> None:
        """A stop signal came during a reload: the successor is stopped (it leaves the models as
        they are) before this process goes on to stop."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _reload(self) -> None:
        log.info("SIGUSR1: reloading: starting a successor (this process, pid %d, serves meanwhile)", os.getpid())
        notify("RELOADING=1", monotonic_usec(), "STATUS=reloading: starting a successor")
        try:
            handed = await self._attempt()
        except asyncio.CancelledError:
            notify("READY=1", "STATUS=reload called off: stopping")
            raise
        except Exception as exc:   # e.g. the command cannot be started: nothing changed
            log.exception("reload failed: %s; this process (pid %d) goes on serving", exc, os.getpid())
            handed = False
        if not handed:
            notify("READY=1", "STATUS=reload failed (see the log); serving as before")

    async def _attempt(self) -> bool:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out, err = os.dup(1), os.dup(2)
        listeners = [s.fileno() for s in self.socks]
        try:
            passed = (*listeners, theirs.fileno(), self.lock.fileno(), out, err)
            env = handover_environ(os.environ, listeners, os.getpid(), theirs.fileno(), self.lock.fileno(), out, err)
            # subprocess, not asyncio's: an asyncio subprocess transport kills its process when it
            # is closed, and the successor must outlive this process's event loop.
            proc = subprocess.Popen(successor_argv(), pass_fds=passed, env=env,  # noqa: ASYNC220
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
            os.close(out)
            os.close(err)
        self.successor = proc.pid
        self._proc = proc
        log.info("reload: successor pid %d started (%s); waiting up to %gs (service.reload_timeout_s) for it "
                 "to adopt the replicas", proc.pid, " ".join(successor_argv()[1:]),
                 self.settings.service.reload_timeout_s)
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        assert proc.stdout is not None
        output = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(output), proc.stdout)
        self._relay = relay = asyncio.create_task(_relay(output, proc.pid, tail))
        reader, writer = await asyncio.open_unix_connection(sock=mine)
        ready = asyncio.create_task(reader.readline())
        exited = asyncio.create_task(_exit_of(proc))
        try:
            await asyncio.wait((ready, exited), timeout=self.settings.service.reload_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if ready.done() and not ready.cancelled() and ready.exception() is None and ready.result() == READY \
                    and proc.poll() is None:
                self._commit(proc.pid, writer)
                return True
            if ready.done():
                # The control socket closed without `ready`: it is exiting. Its status says why.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(exited), TAIL_WAIT_S)
            why = (f"exited with {proc.returncode} before it was ready" if proc.poll() is not None else
                   f"was not ready within service.reload_timeout_s ({self.settings.service.reload_timeout_s:g}s)")
        except asyncio.CancelledError:
            log.warning("reload called off by a stop signal: stopping successor pid %d", proc.pid)
            await _stop(proc, writer)
            raise
        finally:
            ready.cancel()
            exited.cancel()
        await _stop(proc, writer)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(relay), TAIL_WAIT_S)
        self.app[POOL].events.record(
            RELOAD, f"reload failed: successor pid {proc.pid} {why}; nothing changed, this process (pid "
            f"{os.getpid()}) goes on serving and a later SIGUSR1 tries again", reason="failed", level=logging.ERROR)
        lines = "\n".join(f"  {line}" for line in tail) or "  (it wrote nothing)"
        log.error("reload: the last lines of successor pid %d:\n%s", proc.pid, lines)
        return False

    def _commit(self, pid: int, control: asyncio.StreamWriter) -> None:
        """The successor accepts on the shared sockets: it is the proxy from now on."""
        notify(f"MAINPID={pid}", "READY=1", f"STATUS=serving (pid {pid}, took over from {os.getpid()})")
        # The record goes with the service: the events journal is the successor's to write from now
        # on (this process's later events go to it on the control socket), and the counters go with
        # `go`, in the same write, so the successor never shows fewer than this process did.
        self.app[POOL].events.hand_over(partial(_send_event, control))
        control.write(GO + message(COUNTERS, self.app[METRICS].snapshot()))
        self._control = control
        log.info("reload: handing over to pid %d; this process (pid %d) stops accepting, makes no more "
                 "lifecycle decisions, finishes its requests and exits, leaving supervisord and the models running",
                 pid, os.getpid())
        self.shutdown.hand_over()

    async def finish(self) -> None:
        """A handed-over process about to exit: its final counters, for the successor to go on from
        (what it counted while it drained)."""
        if self._control is None:
            return
        with contextlib.suppress(OSError):
            self._control.write(message(COUNTERS, self.app[METRICS].snapshot()))
            await self._control.drain()


def _send_event(control: asyncio.StreamWriter, event: Event) -> None:
    if not control.is_closing():
        control.write(message(EVENT, event.to_json()))


async def _relay(stream: asyncio.StreamReader, pid: int, tail: collections.deque[str]) -> None:
    """The successor's output, until it took over: into this process's stderr (the journal), each
    line marked with its PID, the last ones kept to say why a reload failed."""
    pending = b""
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            tail.append(line)
            print(f"[successor {pid}] {line}", file=sys.stderr, flush=True)
        pending = pending[-65536:]
    if pending:
        tail.append(pending.decode(errors="replace"))


async def _exit_of(proc: "subprocess.Popen[bytes]") -> int:
    """Its exit status once it exits. Polled: a thread blocked in waitpid would hold this process's
    exit until the successor's, and the event loop's child watchers only wait for their own."""
    while (code := proc.poll()) is None:  # noqa: ASYNC110
        await asyncio.sleep(EXIT_POLL_S)
    return code


async def _stop(proc: "subprocess.Popen[bytes]", control: asyncio.StreamWriter) -> None:
    """Stop a successor that did not take over: `abort` first (so that one which wrote `ready` just
    now knows it was not handed anything), then SIGTERM, SIGKILL if it lingers."""
    with contextlib.suppress(OSError):
        control.write(ABORT)
    control.close()
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(_exit_of(proc), STOP_WAIT_S)
        except asyncio.TimeoutError:
            log.error("reload: successor pid %d did not stop within %gs of SIGTERM: SIGKILL", proc.pid, STOP_WAIT_S)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await _exit_of(proc)
