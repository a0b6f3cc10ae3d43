"""Replicas as supervisord programs: their files, their ports, and adding, adopting and removing them.

Each replica is a program of its own (programs/<model prefix>-r<i>.conf, a group of one in
supervisord), so that a live scale adds or removes one without touching the others. Adding writes
the replica's file, has supervisord add it and starts it; a restarted proxy adopts each replica
whose file is unchanged and whose program is running (same process, no reload). Removing stops a
program, waits until it has exited, removes its group, then its file. This is the program kind's
half of the pool (the `Kind` seam, proxy/lifecycle/kinds.py); the pool's monitor reads the same process snapshot.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from launchers import launcher_for
from launchers.spec import Launcher, ProgramSpec, ports_in_file, program_name, render_replica, replica_index
from proxy.config import ModelConfig, Settings
from proxy.errors import Unavailable
from proxy.supervisord.orphans import PidRecord
from proxy.lifecycle.reach import ProgramReach
from proxy.lifecycle.replicas import Replica, ReplicaState
from proxy.lifecycle.runtime import ModelRuntime
from proxy.supervisord.supervisor import (BadName, NotRunning, ProcessInfo, ProcessState, StillRunning,
                                          SupervisorClient, SupervisorError)
from proxy.atomic_file import write_atomic

log = logging.getLogger(__name__)

STOPPED_STATES = (ProcessState.STOPPED, ProcessState.EXITED, ProcessState.FATAL)
# How long past stopwaitsecs (after which supervisord sends SIGKILL) a removal waits for a process.
STOP_GRACE_S = 10.0


class Programs:
    """The supervisord programs of every model's replicas, and the last look at supervisord's table."""

    def __init__(self, settings: Settings, supervisor: SupervisorClient, environ: Mapping[str, str],
                 runtimes: Mapping[str, ModelRuntime], wake: Callable[[], None],
                 pid_record: PidRecord | None = None) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self.environ = environ
        self.runtimes = runtimes      # every model's, for the ports their replicas hold
        self.wake = wake              # the pool's monitor: look again now, a program was started
        self.pid_record = pid_record  # managed mode: what to stop should supervisord die (proxy/supervisord/orphans.py)
        self.processes: dict[str, ProcessInfo] = {}
        self.stop_grace_s = STOP_GRACE_S

    async def snapshot(self) -> dict[str, ProcessInfo]:
        """supervisord's process table now, by full name (kept as `processes` too)."""
        infos = await self.supervisor.all_process_info()
        if self.pid_record is not None:
            self.pid_record.update(infos)
        self.processes = {i.fullname: i for i in infos}
        return self.processes

    def replica_file(self, name: str, index: int) -> Path:
        return self.settings.supervisor.programs_dir / f"{program_name(name, index)}.conf"

    def replica_files(self, name: str) -> dict[int, Path]:
        """The program files of model `name`'s replicas in the programs folder, by replica index."""
        found: dict[int, Path] = {}
        for path in self.settings.supervisor.programs_dir.glob("*.conf"):
            index = replica_index(name, path.stem)
            if index is not None:
                found[index] = path
        return found

    def running(self, program: str) -> ProcessInfo | None:
        """The program's process if it runs: RUNNING, or STARTING with a process (within supervisord's
        startsecs; a replica is checked, and may serve, from the moment its process exists)."""
        info = self.processes.get(f"{program}:{program}")
        return info if info is not None and live(info) else None

    async def start(self, runtime: ModelRuntime, config: ModelConfig, launcher: Launcher) -> None:
        files = self.replica_files(config.name)
        await self.snapshot()
        if config.replicas == runtime.config.replicas:
            # A proxy restarted after a live scale: running replicas past the configured count
            # (their files in place, contiguous) are the model's too, and are adopted with it.
            count = config.replicas
            while count < config.replica_max and count in files and self.running(program_name(config.name, count)):
                count += 1
            if count != config.replicas:
                config = runtime.active = runtime.with_replicas(count)
        stale = [path.stem for index, path in files.items() if index >= config.replicas]
        if stale:
            await self.remove(stale)
        runtime.replicas = []   # those of a failed unload, if any: their programs are judged afresh below
        await self.add(runtime, config, launcher, range(config.replicas), adopt=True)

    async def add(self, runtime: ModelRuntime, config: ModelConfig, launcher: Launcher, indices: range,
                  adopt: bool = False) -> list[Replica]:
        """Write, add and start the programs of replicas `indices` and append them to
        runtime.replicas. With `adopt`, a replica whose file is unchanged and whose program runs is
        taken over as it is."""
        await self.snapshot()
        previous: dict[str, int] = {}
        for path in self.replica_files(config.name).values():
            previous.update(ports_in_file(path.read_text()))
        ports = self._assign_ports(config, launcher, previous)
        log_dir = self.settings.service.state_dir / "logs"
        specs = [launcher.launch(config, i, ports[i], self.settings.supervisor.stopwaitsecs, self.environ)
                 for i in indices]
        added = [Replica(model=config.name, index=i, spec=spec, fullname=f"{spec.program}:{spec.program}",
                         reach=ProgramReach(spec)) for i, spec in zip(indices, specs)]
        runtime.replicas = runtime.replicas + added
        to_start: list[tuple[Replica, ProgramSpec]] = []
        for replica, spec in zip(added, specs):
            text = render_replica(config.name, spec, log_dir)
            path = self.replica_file(config.name, replica.index)
            info = self.running(spec.program)
            if adopt and info is not None and path.exists() and path.read_text() == text:
                log.info("model %s: adopting running replica %d (pid %d)", config.name, replica.index, info.pid)
                replica.pid, replica.alive = info.pid, True
                runtime.set_replica_state(replica, ReplicaState.STARTING)
                continue
            await self.remove_group(spec.program)
            log_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text)
            to_start.append((replica, spec))
        if to_start:
            await self.supervisor.reload_config()
            for replica, spec in to_start:
                await self.supervisor.add_process_group(spec.program)
                runtime.set_replica_state(replica, ReplicaState.STARTING)
                await self.supervisor.start_process(replica.fullname)
        self.wake()
        return added

    def _assign_ports(self, config: ModelConfig, launcher: Launcher, previous: dict[str, int]) -> list[int]:
        """Stable ports: the fixed port if configured, else the one this replica had, else the
        first free one in the range. Ports of other models' programs and ports in use are skipped."""
        fixed = config.get(launcher.PORT_FIELD)
        if fixed:
            return [int(fixed) + i for i in range(config.replicas)]
        taken = self._ports_of_other_groups(config.name)
        lo, hi = self.settings.supervisor.port_range
        ports: list[int] = []
        candidates = iter(range(lo, hi + 1))
        for i in range(config.replicas):
            program = program_name(config.name, i)
            old = previous.get(program)
            ours_running = self.running(program) is not None
            if old and old not in taken and old not in ports and (ours_running or port_free(old)):
                ports.append(old)
                continue
            for port in candidates:
                if port not in taken and port not in ports and port not in previous.values() and port_free(port):
                    ports.append(port)
                    break
            else:
                raise Unavailable(f"no free port left in supervisor.port_range {lo}-{hi}", code="no_free_port")
        return ports

    def _ports_of_other_groups(self, name: str) -> set[int]:
        taken: set[int] = set()
        for path in self.settings.supervisor.programs_dir.glob("*.conf"):
            if replica_index(name, path.stem) is None:
                taken.update(ports_in_file(path.read_text()).values())
        for runtime in self.runtimes.values():
            if runtime.name != name:
                taken.update(r.spec.port for r in runtime.replicas if r.spec is not None)
        return taken

    async def stop(self, name: str) -> None:
        """Stop every replica program of model `name` and remove their groups and files (the
        program kind's stop): those of its runtime and any other file of its in the folder."""
        programs = {r.spec.program for r in self.runtimes[name].replicas if r.spec is not None}
        programs.update(path.stem for path in self.replica_files(name).values())
        await self.remove(sorted(programs))

    async def remove(self, programs: list[str]) -> None:
        """Stop these replica programs together, remove each one's group and file.
        A file is removed only once its program is gone, so that a failed stop is retried."""
        results = await asyncio.gather(*(self.remove_group(p) for p in programs), return_exceptions=True)
        removed = False
        for program, result in zip(programs, results):
            path = self.settings.supervisor.programs_dir / f"{program}.conf"
            if result is None and path.exists():
                path.unlink()
                removed = True
        if removed:
            await self.supervisor.reload_config()
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def remove_group(self, group: str) -> None:
        """Stop every program of `group`, wait until each has exited, then remove the group.

        Judged afresh on every pass, because the table moves under us: a process that crashed
        (EXITED, BACKOFF) may be restarted by autorestart until its group is gone, so anything
        live is asked to stop again, and a group that became live between our look and the
        removal (STILL_RUNNING) is simply another pass. Raises SupervisorError when a process
        outlives stopwaitsecs (supervisord's SIGKILL included) plus `stop_grace_s`."""
        deadline = time.monotonic() + self.settings.supervisor.stopwaitsecs + self.stop_grace_s
        while True:
            members = [i for i in (await self.snapshot()).values() if i.group == group]
            if not members:
                return   # never added, or removed by someone else
            live = [i for i in members if i.state not in STOPPED_STATES]
            if not live:
                try:
                    await self.supervisor.remove_process_group(group)
                    return
                except BadName:
                    return
                except StillRunning:
                    pass   # restarted between our look and the removal: another pass
            for info in live:
                if info.state != ProcessState.STOPPING:
                    try:
                        await self.supervisor.stop_process(info.fullname)
                    except (NotRunning, BadName):
                        pass   # it exited, or went away, between the snapshot and the call
            if time.monotonic() > deadline:
                raise SupervisorError(f"group {group} did not stop: " +
                                      ", ".join(f"{i.fullname} {i.state.name} pid {i.pid}" for i in live))
            await asyncio.sleep(0.05)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on `port` now. SO_REUSEADDR as servers set it: sockets left in
    TIME_WAIT by a replica that exited (an unload) must not make its port look taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _launcher(config: ModelConfig) -> Launcher:
    launcher = launcher_for(config.backend)
    assert launcher is not None, "the program kind serves only backends with a launcher (kinds_for)"
    return launcher


class ProgramKind:
    """Replicas as supervisord programs (`Programs`, above), written by the backend's launcher."""

    def __init__(self, programs: Programs | None) -> None:
        self.programs = programs   # None: for checks only (check-config)

    def check(self, config: ModelConfig) -> list[str]:
        return _launcher(config).check(config)

    async def start(self, runtime: ModelRuntime, config: ModelConfig) -> None:
        assert self.programs is not None
        await self.programs.start(runtime, config, _launcher(config))

    async def stop(self, runtime: ModelRuntime) -> None:
        assert self.programs is not None
        await self.programs.stop(runtime.name)

    async def add(self, runtime: ModelRuntime, config: ModelConfig, indices: range) -> list[Replica]:
        assert self.programs is not None
        return await self.programs.add(runtime, config, _launcher(config), indices)

    async def remove(self, runtime: ModelRuntime, replicas: list[Replica]) -> None:
        assert self.programs is not None
        await self.programs.remove([r.spec.program for r in replicas if r.spec is not None])

    def gate(self, config: ModelConfig, headers: Mapping[str, str], body: Mapping[str, Any]) -> None:
        return None

    def describe(self, config: ModelConfig) -> dict[str, object]:
        return {}


def live(info: ProcessInfo) -> bool:
    return info.state == ProcessState.RUNNING or (info.state == ProcessState.STARTING and info.pid > 0)
