"""Model-server processes left running by a supervisord that died.

supervisord starts each program in a process group of its own; when supervisord is killed (kill -9,
OOM killer) its programs keep running, holding their ports and GPU memory, and a new supervisord
knows nothing of them. So the pool records the processes supervisord runs, with each one's command
line and start time, in the state folder; before a managed `serve` starts a new supervisord, every
recorded process that is still the same process (same command line, same start time: a PID the
system has since given to something else is left alone) is stopped with its process group.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from proxy.supervisord.supervisor import ProcessInfo, ProcessState
from proxy.atomic_file import write_atomic

log = logging.getLogger(__name__)

RECORD_NAME = "replica-pids.json"


@dataclass(frozen=True)
class Identity:
    cmdline: list[str]
    start: int          # clock ticks after boot (/proc/<pid>/stat field 22): tells a reused PID apart


def identity(pid: int) -> Identity | None:
    """Who process `pid` is, or None when there is no such (live) process."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(") ", 1)[1].split()
    # Between fork and exec (measured: right after Popen returns, now and then) the command line
    # reads empty: recorded so, it would never match the process again. It is read again later.
    if fields[0] == "Z" or not cmdline:
        return None
    return Identity(cmdline=[a.decode(errors="replace") for a in cmdline.split(b"\0") if a], start=int(fields[19]))


class PidRecord:
    """The processes supervisord runs, kept in `<state_dir>/replica-pids.json` (rewritten on change).

    A STARTING process is recorded too (a replica serves from its first passed health check, which
    may come before supervisord's startsecs are over), but read again on every update until it is
    RUNNING: just after the fork it may not have reached its exec yet and still carry supervisord's
    command line, which would never match it again."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / RECORD_NAME
        self._known: dict[int, dict[str, object]] = {}
        self._written: list[dict[str, object]] | None = None
        self._starting: set[int] = set()     # PIDs last seen STARTING: their identity is read again

    def update(self, infos: Iterable[ProcessInfo]) -> None:
        live = {i.pid: i for i in infos if i.pid > 0 and i.state in (ProcessState.STARTING, ProcessState.RUNNING,
                                                                     ProcessState.STOPPING)}
        known = {}
        for pid, info in live.items():
            entry = self._known.get(pid)
            if entry is None or pid in self._starting:
                who = identity(pid)
                if who is None:
                    continue
                entry = {"program": info.fullname, "pid": pid, "cmdline": who.cmdline, "start": who.start}
            known[pid] = entry
        self._starting = {pid for pid, info in live.items() if info.state == ProcessState.STARTING}
        self._known = known
        entries = [known[p] for p in sorted(known)]
        if entries == self._written:
            return
        try:
            write_atomic(self.path, json.dumps(entries, indent=1))
        except OSError as exc:   # a record we cannot write must not stop the pool; it is tried again
            log.warning("cannot record model-server PIDs in %s: %s", self.path, exc.strerror)
            return
        self._written = entries


async def stop_orphans(state_dir: Path, timeout_s: float = 10.0) -> list[int]:
    """Stop every recorded process that is still the one recorded (SIGTERM to its process group,
    SIGKILL after `timeout_s`); returns their PIDs. Call only when supervisord is known dead."""
    path = state_dir / RECORD_NAME
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    orphans = []
    for entry in entries:
        try:
            pid, recorded = int(entry["pid"]), Identity(list(entry["cmdline"]), int(entry["start"]))
        except (KeyError, TypeError, ValueError):
            continue
        if identity(pid) == recorded:
            log.warning("stopping %s (pid %d): its supervisord died and left it running", entry["program"], pid)
            orphans.append(pid)
            _signal_group(pid, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    # Processes that are not our children: nothing signals their exit, so it is polled.
    while any(identity(p) is not None for p in orphans) and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    for pid in orphans:
        if identity(pid) is not None:
            log.warning("pid %d ignored SIGTERM for %.0fs: SIGKILL", pid, timeout_s)
            _signal_group(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)
    return orphans


def _signal_group(pid: int, sig: signal.Signals) -> None:
    # supervisord made each program the leader of its own group: the group takes its children too.
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
