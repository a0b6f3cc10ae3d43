"""Replicas as supervisord programs: their files, their ports, and adding, adopting and removing them.

Each replica is a program of its own (programs/<model prefix>-r<i>.conf, a group of one in
supervisord), so that a live scale adds or removes one without touching the others. Adding writes
the replica's file, has supervisord add it and starts it; a restarted proxy adopts each replica
whose file is unchanged and whose program is running (same process, no reload). Removing stops a
program, waits until it has exited, removes its group, then its file. This is the program kind's
half of the pool (the `Kind` seam, proxy/lifecycle/state/kind.py; its adapter is ProgramKind,
proxy/lifecycle/kinds/program_kind.py). Ports are chosen by ports.py; supervisord's process table,
which the pool's monitor reads too, is process_table.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from launchers.spec import (Launcher, ProgramSpec, UnsafeProgramValue, ports_in_file, program_name, render_replica,
                            replica_index)
from proxy.atomic_file import PRIVATE_MODE, write_atomic
from proxy.config.model import ModelConfig
from proxy.config.settings import LOCAL_HOST, Settings
from proxy.events import Events
from proxy.lifecycle.kinds.ports import assign_ports, ports_of_other_groups
from proxy.lifecycle.kinds.process_table import ProcessTable, process_key
from proxy.lifecycle.state.outdated import outdated_reason, what_changed
from proxy.lifecycle.state.replicas import Replica, ReplicaState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.lifecycle.state.indices import free_indices
from proxy.supervisord.hosts import Host
from proxy.supervisord.orphans import PidRecord
from proxy.supervisord.supervisor import (BadName, NotRunning, ProcessInfo, ProcessState, StillRunning,
                                          SupervisorClient, SupervisorError, SupervisorFault)
from proxy.upstream.reach import ProgramReach

log = logging.getLogger(__name__)

STOPPED_STATES = (ProcessState.STOPPED, ProcessState.EXITED, ProcessState.FATAL)
# How long past stopwaitsecs (after which supervisord sends SIGKILL) a removal waits for a process.
STOP_GRACE_S = 10.0
# Chooses the host of each new replica: (model settings, replica indices, the hosts that hold a
# program file of each index now) -> a host per index. The placer's (placer.Placer.hosts_for).
HostChooser = Callable[[ModelConfig, list[int], Mapping[int, str]], Mapping[int, str]]
# What the pool adds to a replica's program beyond its launcher's (the KV store's --slot-save-path):
# (settings, spec, whether it runs on this machine) -> the spec to run.
LaunchHook = Callable[[ModelConfig, ProgramSpec, bool], ProgramSpec]


async def start_replica(client: SupervisorClient, replica: Replica) -> None:
    """Start a replica's program and take its PID at once. supervisord has spawned the process
    when startProcess returns, and a quick server passes its health check (READY) before the
    monitor's next poll would read the PID: the admin view showed a READY replica with none. (The
    PID record for orphans is still written from the monitor's polls.)

    A start supervisord refuses (SPAWN_ERROR) carries the program's log tail, as an exit during the
    start does (watch/monitor.py): a server that exits at once is one or the other by the machine's
    timing (on a busy machine, often the refusal), and only its log says why."""
    try:
        await client.start_process(replica.fullname)
    except SupervisorFault as exc:
        try:
            tail = (await client.tail_log(replica.fullname, 2000)).strip()
        except SupervisorError:
            tail = ""
        if not tail:
            raise
        raise type(exc)(exc.code, f"{exc.text}; log tail:\n{tail}") from exc
    info = await client.process_info(replica.fullname)
    if info.pid:
        replica.pid, replica.alive = info.pid, True


class Programs:
    """The supervisord programs of every model's replicas, and the last look at supervisord's table."""

    def __init__(self, settings: Settings, supervisor: SupervisorClient, environ: Mapping[str, str],
                 runtimes: Mapping[str, ModelRuntime], wake: Callable[[], None],
                 pid_record: PidRecord | None = None, hosts: Mapping[str, Host] | None = None,
                 choose: HostChooser | None = None, *, events: Events, launch_hook: LaunchHook | None = None) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self.hosts: dict[str, Host] = dict(hosts) if hosts is not None else \
            {LOCAL_HOST: Host(LOCAL_HOST, supervisor, settings.service.state_dir / "logs")}
        self.choose = choose
        self.launch_hook = launch_hook
        self.environ = environ
        self.runtimes = runtimes      # every model's, for the ports their replicas hold
        self.wake = wake              # the pool's monitor: look again now, a program was started
        # Every host's processes; a host that stops answering, and answers again, is an event.
        self.table = ProcessTable(self.hosts, events, pid_record)
        self.stop_grace_s = STOP_GRACE_S

    @property
    def processes(self) -> dict[str, ProcessInfo]:
        """Every host's processes at the last look, by process_key (ProcessTable)."""
        return self.table.processes

    async def snapshot(self, patience_s: float | None = None, only: str | None = None) -> dict[str, ProcessInfo]:
        """Every host's process table now (ProcessTable.snapshot)."""
        return await self.table.snapshot(patience_s, only)

    async def close(self) -> None:
        """Cancel the polls still in flight (a frozen host's)."""
        await self.table.close()

    def host_of(self, replica: Replica) -> Host:
        return self.hosts[replica.host]

    def down_hosts(self) -> set[str]:
        return self.table.down_hosts()

    async def texts(self) -> dict[str, dict[str, str]]:
        """Every answering host's llm-pool program files, by host and program name."""
        hosts = [h for h in self.hosts.values() if h.down_since is None]
        found = await asyncio.gather(*(h.texts(self.settings.supervisor.programs_dir) for h in hosts))
        return {h.name: t for h, t in zip(hosts, found)}

    async def replica_texts(self, name: str, texts: Mapping[str, Mapping[str, str]] | None = None
                            ) -> dict[int, tuple[str, str]]:
        """Model `name`'s program files on every host: (host, text) by replica index. `texts`: what
        `texts()` just read, so that no host is asked twice."""
        out: dict[int, tuple[str, str]] = {}
        for host, by_name in (texts if texts is not None else await self.texts()).items():
            for stem, text in by_name.items():
                index = replica_index(name, stem)
                if index is not None:
                    out[index] = (host, text)
        return out

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

    def running(self, program: str, host: str = LOCAL_HOST) -> ProcessInfo | None:
        """The program's process if it runs: RUNNING, or STARTING with a process (within supervisord's
        startsecs; a replica is checked, and may serve, from the moment its process exists)."""
        return self.table.running(program, host)

    async def start(self, runtime: ModelRuntime, config: ModelConfig, launcher: Launcher) -> None:
        await self.snapshot()
        files = await self.replica_texts(config.name)
        # Those that run what the settings give now first: a reload in the middle of a roll keeps
        # its new replicas and leaves out old ones beyond the count.
        running = sorted((i for i, (host, _) in files.items() if self.running(program_name(config.name, i), host)),
                         key=lambda i: (not self._current(config, launcher, i, *files[i]), i))
        if runtime.kept is None and config.replicas == runtime.config.replicas and \
                config.replicas < len(running) <= config.replica_max:
            # A proxy restarted after a live scale that it kept no count of (an older version):
            # every running replica is the model's, and is adopted with it.
            config = runtime.active = runtime.with_replicas(len(running))
        indices = sorted(running[:config.replicas])
        indices += free_indices(indices, config.replicas - len(indices))
        stale = [(host, program_name(config.name, index)) for index, (host, _) in files.items()
                 if index not in indices]
        if stale:
            await self.remove(stale)
        runtime.replicas = []   # those of a failed unload, if any: their programs are judged afresh below
        await self.add(runtime, config, launcher, indices, adopt=True)

    async def add(self, runtime: ModelRuntime, config: ModelConfig, launcher: Launcher, indices: Sequence[int],
                  adopt: bool = False) -> list[Replica]:
        """Write, add and start the programs of replicas `indices` and append them to
        runtime.replicas (kept in index order). With `adopt`, a replica whose program runs is taken
        over as it is: one whose file is what `config` gives now, as current; any other, as out of
        date (Replica.outdated says why), reached as runtime.kept (the settings it was started with)
        says, for the pool to replace it by a current one (proxy/lifecycle/rolling.py)."""
        await self.snapshot()
        all_texts = await self.texts()
        existing = await self.replica_texts(config.name, all_texts)
        previous: dict[str, int] = {}
        for _host, text in existing.values():
            previous.update(ports_in_file(text))
        wanted = list(indices)
        ports = self._assign_ports(config, launcher, previous, all_texts, wanted)
        held = {i: existing[i][0] for i in wanted if i in existing}
        where = dict(self.choose(config, wanted, held)) if self.choose is not None else {}
        local_dir = self.settings.service.state_dir / "logs"
        specs, hosts, texts = [], [], []
        for i in wanted:
            host = self.hosts[where.get(i, LOCAL_HOST if LOCAL_HOST in self.hosts else next(iter(self.hosts)))]
            spec = self._spec(launcher, config, i, ports[i], host)
            specs.append(spec)
            hosts.append(host)
            # Rendered before anything changes: a value it refuses (launchers.spec.UnsafeProgramValue)
            # fails the load with no replica half added.
            texts.append(render_replica(config.name, spec, host.log_dir or local_dir))
        added = [Replica(model=config.name, index=i, spec=spec, fullname=f"{spec.program}:{spec.program}",
                         reach=ProgramReach(spec), host=host.name) for i, spec, host in zip(wanted, specs, hosts)]
        runtime.replicas = sorted(runtime.replicas + added, key=lambda r: r.index)
        to_start: list[tuple[Replica, ProgramSpec]] = []
        for replica, spec, host, text in zip(added, specs, hosts, texts):
            log_dir = host.log_dir or local_dir
            info = self.running(spec.program, host.name)
            found = all_texts.get(host.name, {}).get(spec.program)
            if adopt and info is not None and found is not None:
                if found != text:
                    self._as_running(runtime, replica, launcher, found, host, log_dir)
                log.info("model %s: adopting running replica %d (pid %d) on host %s%s", config.name, replica.index,
                         info.pid, host.name, f", out of date: {replica.outdated}" if replica.outdated else "")
                replica.pid, replica.alive, replica.adopted = info.pid, True, True
                if host.local:   # an older version wrote it readable by all: the text stays, the mode tightens
                    self.replica_file(config.name, replica.index).chmod(PRIVATE_MODE)
                runtime.set_replica_state(replica, ReplicaState.STARTING)
                continue
            # Its file elsewhere (it ran on another host before) goes first: one file per replica.
            old_host = existing.get(replica.index, (host.name, ""))[0]
            if old_host != host.name and old_host in self.hosts:
                await self.remove([(old_host, spec.program)])
            await self.remove_group(spec.program, host.name)
            if host.local:
                path = self.replica_file(config.name, replica.index)
                log_dir.mkdir(parents=True, exist_ok=True)
                write_atomic(path, text, mode=PRIVATE_MODE)
            else:
                await host.client.call("llm_pool.writeProgram", spec.program, text)   # written and added
            to_start.append((replica, spec))
        if any(self.hosts[r.host].local for r, _ in to_start):
            await self.supervisor.reload_config()
        for replica, spec in to_start:
            client = self.hosts[replica.host].client
            if self.hosts[replica.host].local:
                await client.add_process_group(spec.program)
            runtime.set_replica_state(replica, ReplicaState.STARTING)
            await start_replica(client, replica)
        self.wake()
        return added

    def _spec(self, launcher: Launcher, config: ModelConfig, index: int, port: int, host: Host) -> ProgramSpec:
        """Replica `index`'s program with `config` on `port` of `host`: its launcher's, reached at the
        host's address, with what the pool adds (launch_hook)."""
        spec = launcher.launch(config, index, port, self.settings.supervisor.stopwaitsecs, self.environ)
        spec = on_host(spec, host.address) if host.address else spec
        return self.launch_hook(config, spec, host.local) if self.launch_hook is not None else spec

    def _current(self, config: ModelConfig, launcher: Launcher, index: int, host_name: str, text: str) -> bool:
        """Whether program file `text` (replica `index`'s, on `host_name`) is what `config` gives now."""
        host = self.hosts.get(host_name)
        if host is None:
            return False
        program = program_name(config.name, index)
        spec = self._spec(launcher, config, index, ports_in_file(text).get(program, 0), host)
        try:
            return render_replica(config.name, spec, host.log_dir or self.settings.service.state_dir / "logs") == text
        except UnsafeProgramValue:
            return False

    def _as_running(self, runtime: ModelRuntime, replica: Replica, launcher: Launcher, text: str, host: Host,
                    log_dir: Path) -> None:
        """Make `replica` the running program of file `text` (not what the settings give now): its
        spec is rendered from the settings it was started with (runtime.kept) when they give that
        very file; else (no kept settings, or the environment or llm-pool changed since) from the
        current ones on the port it listens on, which reaches it as long as its health check and
        model name are the same. Its `outdated` says what changed, by setting name only."""
        assert replica.spec is not None
        current = runtime.active or runtime.config
        port = ports_in_file(text).get(replica.spec.program, replica.spec.port)
        old = runtime.kept
        if old is not None:
            try:
                spec = self._spec(launcher, old, replica.index, port, host)
                exact = render_replica(current.name, spec, log_dir) == text
            except Exception:   # kept by another version of llm-pool, say: reached as below
                exact = False
            if exact:
                replica.outdated = outdated_reason(what_changed(old, current), exact=True)
                _set_spec(replica, spec)
                return
        spec = self._spec(launcher, current, replica.index, port, host)
        replica.outdated = outdated_reason(what_changed(old, current) if old is not None else [], exact=False)
        _set_spec(replica, spec)

    def _assign_ports(self, config: ModelConfig, launcher: Launcher, previous: dict[str, int],
                      texts: Mapping[str, Mapping[str, str]], indices: Sequence[int]) -> dict[int, int]:
        """Stable ports for replicas `indices` of `config` (ports.assign_ports), apart from every other
        model's: their program files on every host (`texts`) and their replicas' ports now."""
        held = [r.spec.port for rt in self.runtimes.values() if rt.name != config.name
                for r in rt.replicas if r.spec is not None]
        taken = ports_of_other_groups(config.name, texts, held)
        return assign_ports(config, launcher, previous, taken, self.settings.supervisor.port_range, indices,
                            lambda program: any(self.running(program, h) is not None for h in self.hosts))

    async def stop(self, name: str) -> None:
        """Stop every replica program of model `name` and remove their groups and files (the
        program kind's stop): those of its runtime and any other file of its in the folder."""
        programs = {(r.host, r.spec.program) for r in self.runtimes[name].replicas if r.spec is not None}
        files = await self.replica_texts(name)
        programs.update((host, program_name(name, index)) for index, (host, _) in files.items())
        await self.remove(sorted(programs))

    async def remove(self, programs: list[tuple[str, str]]) -> None:
        """Stop these replica programs (each `(host, program)`) together, remove each one's group and
        file. A file is removed only once its program is gone, so that a failed stop is retried."""
        pairs = [(h, p) for h, p in programs if h in self.hosts]
        results = await asyncio.gather(*(self.remove_group(p, h) for h, p in pairs), return_exceptions=True)
        removed = False
        for n, ((host, program), result) in enumerate(zip(pairs, results)):
            if result is not None:
                continue
            if not self.hosts[host].local:
                try:
                    await self.hosts[host].client.call("llm_pool.removeProgram", program)
                except SupervisorError as exc:
                    results[n] = exc
                continue
            path = self.settings.supervisor.programs_dir / f"{program}.conf"
            if path.exists():
                path.unlink()
                removed = True
        if removed:
            await self.supervisor.reload_config()
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def remove_group(self, group: str, host: str = LOCAL_HOST) -> None:
        """Stop every program of `group`, wait until each has exited, then remove the group.

        Judged afresh on every pass, because the table moves under us: a process that crashed
        (EXITED, BACKOFF) may be restarted by autorestart until its group is gone, so anything
        live is asked to stop again, and a group that became live between our look and the
        removal (STILL_RUNNING) is simply another pass. Raises SupervisorError when a process
        outlives stopwaitsecs (supervisord's SIGKILL included) plus `stop_grace_s`."""
        deadline = time.monotonic() + self.settings.supervisor.stopwaitsecs + self.stop_grace_s
        client = self.hosts[host].client
        while True:
            processes = await self.snapshot(only=host)
            members = [i for k, i in processes.items() if i.group == group and k == process_key(host, i.fullname)]
            if not members:
                return   # never added, or removed by someone else
            live = [i for i in members if i.state not in STOPPED_STATES]
            if not live:
                try:
                    await client.remove_process_group(group)
                    return
                except BadName:
                    return
                except StillRunning:
                    pass   # restarted between our look and the removal: another pass
            for info in live:
                if info.state != ProcessState.STOPPING:
                    try:
                        await client.stop_process(info.fullname)
                    except (NotRunning, BadName):
                        pass   # it exited, or went away, between the snapshot and the call
            if time.monotonic() > deadline:
                raise SupervisorError(f"group {group} did not stop: " +
                                      ", ".join(f"{i.fullname} {i.state.name} pid {i.pid}" for i in live))
            await asyncio.sleep(0.05)


def _set_spec(replica: Replica, spec: ProgramSpec) -> None:
    replica.spec, replica.reach = spec, ProgramReach(spec)
    replica.fullname = f"{spec.program}:{spec.program}"


def on_host(spec: ProgramSpec, address: str) -> ProgramSpec:
    """The spec of a replica on another host: it listens on, and is reached at, that host's address.
    Every launcher gives its server the listen address as `--host <spec.host>` (llama-server, vllm
    serve and the shims alike), so that one argument is what changes."""
    argv = list(spec.argv)
    for i in range(len(argv) - 1):
        if argv[i] == "--host" and argv[i + 1] == spec.host:
            argv[i + 1] = address
    return dataclasses.replace(spec, argv=tuple(argv), host=address)
