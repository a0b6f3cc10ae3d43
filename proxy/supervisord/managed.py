"""Managed mode: llm-pool's own supervisord in the state directory.

supervisord runs as a daemon, not as a child of the proxy, so the proxy can stop, restart or be
upgraded while every model keeps running; a restarted proxy finds it by its socket.
"""
from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import tempfile
import sys
from pathlib import Path
from typing import IO

from proxy.config.settings import Settings
from proxy.supervisord.environment import model_server_environ
from proxy.supervisord.orphans import identity, stop_orphans
from proxy.supervisord.supervisor import SupervisorClient, SupervisorError
from proxy.atomic_file import write_atomic

START_TIMEOUT_S = 15.0


def supervisord_sections(state: Path) -> list[str]:
    """supervisord's own sections for a state folder (its logs, PID file and folder there) and its
    standard RPC interface: the same for `serve`'s managed supervisord and `llm-pool node`'s."""
    return [
        "[supervisord]",
        f"logfile={state / 'logs' / 'supervisord.log'}",
        "logfile_maxbytes=10MB",
        "logfile_backups=3",
        f"pidfile={state / 'supervisord.pid'}",
        f"childlogdir={state / 'logs'}",
        f"directory={state}",
        "",
        "[rpcinterface:supervisor]",
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "",
    ]


def supervisord_conf(settings: Settings) -> str:
    state = settings.service.state_dir
    return "\n".join([
        "; written by llm-pool serve; rewritten on every start",
        "[unix_http_server]",
        f"file={settings.socket_path}",
        # Only this user may drive supervisord: it can start arbitrary programs.
        "chmod=0700",
        "",
        *supervisord_sections(state),
        "[supervisorctl]",
        f"serverurl=unix://{settings.socket_path}",
        "",
        "[include]",
        f"files={settings.supervisor.programs_dir}/*.conf",
        "",
    ])


class StateDirBusy(Exception):
    """Another `llm-pool serve` holds this state folder."""


def claim_state_dir(state_dir: Path) -> IO[str]:
    """Hold an exclusive lock on the state folder for this process's life (close the file to let go).

    One proxy per state folder: two would both drive the same replicas, and whichever stopped
    first would unload the other's models.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = open(state_dir / "serve.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip() or "another process"
        lock.close()
        raise StateDirBusy(f"{state_dir} is in use by llm-pool serve (pid {owner}); stop it first, or give "
                           "this one another service.state_dir") from None
    record_owner(lock)
    return lock


def inherited_lock(state_dir: Path, fd: int) -> IO[str] | None:
    """The state folder's lock as a reloading predecessor handed it over (`fd`: its open file, whose
    flock both processes share, so the lock is never free in between), or None when `fd` is not
    this folder's lock file (the settings moved service.state_dir: the caller claims the new one).
    Once the predecessor exits, this process alone holds it."""
    path = state_dir / "serve.lock"
    try:
        mine, theirs = os.stat(path), os.fstat(fd)
    except OSError:
        return None
    if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
        return None
    lock = open(fd, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)   # already ours (the same open file): at once
    except BlockingIOError:
        lock.close()
        raise StateDirBusy(f"{state_dir}: the lock handed over is not held by the process that handed it") from None
    return lock


def record_owner(lock: IO[str]) -> None:
    """Write this process's PID into the lock file: whom a second `serve` names."""
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()


def conf_path(settings: Settings) -> Path:
    return settings.service.state_dir / "supervisord.conf"


def prepare_state_dir(settings: Settings) -> Path:
    state = settings.service.state_dir
    for sub in (state, state / "logs", settings.supervisor.programs_dir):
        sub.mkdir(parents=True, exist_ok=True)
    os.chmod(state, 0o700)
    path = conf_path(settings)
    text = supervisord_conf(settings)
    if not path.exists() or path.read_text() != text:
        write_atomic(path, text)
    return path


async def ensure_supervisord(settings: Settings, client: SupervisorClient) -> bool:
    """Start supervisord unless its socket already answers; True when this call started it."""
    if await client.ping():
        return False
    path = prepare_state_dir(settings)
    await _stop_orphans_of_a_dead_supervisord(settings)
    # A socket file left by a supervisord that died would make the new one refuse to start.
    settings.socket_path.unlink(missing_ok=True)
    # supervisord passes its environment on to every model server: it gets only what those may see.
    # Its stderr goes to a file, not a pipe: a pipe's end of file waits for every holder of its write
    # end, and on uvloop the daemonized supervisord still held one (measured: the proxy never started).
    with tempfile.TemporaryFile() as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "supervisor.supervisord", "-c", str(path),
            stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
            env=model_server_environ(settings, os.environ))
        # supervisord daemonizes: this parent returns at once; a non-zero exit means it refused to start.
        if await proc.wait() != 0:
            stderr.seek(0)
            raise SupervisorError(f"supervisord failed to start (exit {proc.returncode}): "
                                  f"{stderr.read().decode(errors='replace').strip()}")
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    while not await client.ping():
        if asyncio.get_running_loop().time() > deadline:
            raise SupervisorError(f"supervisord did not answer on {settings.socket_path} "
                                  f"within {START_TIMEOUT_S:.0f}s; see {settings.service.state_dir / 'logs'}")
        await asyncio.sleep(0.05)
    return True


def running_supervisord(pidfile: Path) -> int:
    """The PID of the supervisord a pidfile names, if that process is alive and is a supervisord
    (by its command line: a PID reused by another process after a reboot or a kill -9 is not it);
    else 0."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return 0
    who = identity(pid) if pid > 0 else None
    return pid if who is not None and any("supervisord" in a for a in who.cmdline) else 0


def supervisord_dead(settings: Settings) -> bool:
    """Whether the supervisord of the pidfile is gone, not merely slow to answer: one that is alive
    still owns its programs."""
    return not running_supervisord(settings.service.state_dir / "supervisord.pid")


async def _stop_orphans_of_a_dead_supervisord(settings: Settings) -> None:
    # Only when the supervisord of the pidfile is really gone: the programs of one that is alive
    # but not answering are not orphans.
    if supervisord_dead(settings):
        await stop_orphans(settings.service.state_dir)


class ManagedSupervisord:
    """The proxy's own supervisord, which the pool's monitor starts again should it die (kill -9,
    the OOM killer): what the dead one left running is stopped by its recorded PIDs (orphans.py)
    and a new one is started; the monitor then starts the replicas again."""

    def __init__(self, settings: Settings, client: SupervisorClient) -> None:
        self.settings = settings
        self.client = client

    def dead(self) -> bool:
        return supervisord_dead(self.settings)

    async def start_again(self) -> None:
        await ensure_supervisord(self.settings, self.client)


async def stop_orphans_if_dead(settings: Settings) -> list[int]:
    """At shutdown: should supervisord be dead (and not started again), stop the model servers it
    left running, so that Ctrl-C leaves nothing behind."""
    return await stop_orphans(settings.service.state_dir) if supervisord_dead(settings) else []


async def stop_supervisord(client: SupervisorClient, timeout_s: float = 60.0) -> None:
    """Shut supervisord down (it stops every program first) and wait for its process to exit."""
    try:
        pid = await client.get_pid()
        await client.shutdown()
    except SupervisorError:
        return
    deadline = asyncio.get_running_loop().time() + timeout_s
    while pid_alive(pid):
        if asyncio.get_running_loop().time() > deadline:
            raise SupervisorError(f"supervisord (pid {pid}) still running {timeout_s:.0f}s after shutdown")
        await asyncio.sleep(0.05)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie awaiting its reaper has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0) but has exited; it is gone once its parent reaps it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
