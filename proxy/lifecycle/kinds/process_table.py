"""supervisord's process table on every host, as the program kind and the monitor read it.

One look asks each host's supervisord for its processes, at most one call in flight per host, and
merges the answers under `process_key`; a host other than the local one that stops answering is
marked down (its replicas leave rotation) and recorded as an event, and as up again when it answers.
`Programs` (proxy/lifecycle/kinds/programs.py) owns one table; the monitor polls it.
"""
from __future__ import annotations

import asyncio
import logging
import time

from proxy import events
from proxy.config.settings import LOCAL_HOST
from proxy.events import Events
from proxy.supervisord.hosts import Host
from proxy.supervisord.orphans import PidRecord
from proxy.supervisord.supervisor import ProcessInfo, ProcessState, SupervisorError


def process_key(host: str, fullname: str) -> str:
    """A process's key in the merged table: the local host's as supervisord names them (as always),
    another host's prefixed with its name."""
    return fullname if host == LOCAL_HOST else f"{host}/{fullname}"


def live(info: ProcessInfo) -> bool:
    return info.state == ProcessState.RUNNING or (info.state == ProcessState.STARTING and info.pid > 0)


class ProcessTable:
    """Every host's processes at the last look (`processes`, by process_key)."""

    def __init__(self, hosts: dict[str, Host], events: Events, pid_record: PidRecord | None) -> None:
        self.hosts = hosts            # shared with Programs: the same hosts, by name
        self.events = events          # a host that stops answering, and answers again
        self.pid_record = pid_record  # managed mode: what to stop should supervisord die (proxy/supervisord/orphans.py)
        self.processes: dict[str, ProcessInfo] = {}
        self._polls: dict[str, asyncio.Task[dict[str, ProcessInfo]]] = {}   # in flight, by host

    async def snapshot(self, patience_s: float | None = None, only: str | None = None) -> dict[str, ProcessInfo]:
        """Every host's process table now, by process_key (kept as `processes` too). The local
        supervisord not answering raises, as it always did; another host that does not answer is
        marked down (Host.down_since) and its processes are left out.

        Each host is asked by a poll of its own, at most one in flight per host. `patience_s` bounds
        the wait for other hosts than the local one: one that has not answered by then keeps its last
        table (Host.table_at says how old) and its poll runs on, to be taken by a later call, so
        that one frozen host does not hold up every other host's monitoring for rpc_timeout_s.
        None waits for each until it answers or its call times out. `only`: ask that host alone."""
        asked = [self.hosts[only]] if only is not None else list(self.hosts.values())
        polls = {h.name: self._poll(h) for h in asked}
        local = [polls[h.name] for h in asked if h.local]
        remote = [polls[h.name] for h in asked if not h.local]
        if local:
            await asyncio.wait(local)
        if remote:
            await asyncio.wait(remote, timeout=patience_s)
        failed: set[str] = set()
        local_error: BaseException | None = None
        for host in asked:
            task = polls[host.name]
            if not task.done():
                continue   # still asking: its last table stands for it this time
            if self._polls.get(host.name) is task:
                del self._polls[host.name]
            error = task.exception()
            if error is None:
                continue
            failed.add(host.name)
            if not isinstance(error, SupervisorError) or host.local:
                local_error = local_error or error
            elif host.mark_down(error):
                self.events.record(events.HOST_DOWN, f"host {host.name} is not answering: {error}; its replicas "
                                   "leave rotation", host=host.name, reason=str(error), level=logging.WARNING)
        merged: dict[str, ProcessInfo] = {}
        for host in self.hosts.values():
            if host.name not in failed and host.down_since is None:
                merged.update({process_key(host.name, n): i for n, i in host.processes.items()})
        self.processes = merged
        if local_error is not None:
            raise local_error
        return merged

    def _poll(self, host: Host) -> "asyncio.Task[dict[str, ProcessInfo]]":
        task = self._polls.get(host.name)
        if task is None:
            task = self._polls[host.name] = asyncio.create_task(self._host_snapshot(host),
                                                                name=f"llm-pool poll {host.name}")
        return task

    async def close(self) -> None:
        """Cancel the polls still in flight (a frozen host's)."""
        polls, self._polls = list(self._polls.values()), {}
        for task in polls:
            task.cancel()
        await asyncio.gather(*polls, return_exceptions=True)

    async def _host_snapshot(self, host: Host) -> dict[str, ProcessInfo]:
        asked_at = time.monotonic()
        processes = await host.snapshot()
        if host.local and self.pid_record is not None:
            self.pid_record.update(processes.values())
        if host.down_since is not None or (not host.local and host.log_dir is None):
            await host.refresh()
            if host.down_since is not None:
                self.events.record(events.HOST_UP, f"host {host.name} answers again after "
                                   f"{time.monotonic() - host.down_since:.1f}s", host=host.name,
                                   level=logging.WARNING)
            host.down_since, host.error = None, None
        host.processes, host.table_at, host.last_contact = processes, asked_at, time.monotonic()
        return processes

    def down_hosts(self) -> set[str]:
        return {h.name for h in self.hosts.values() if h.down_since is not None}

    def running(self, program: str, host: str = LOCAL_HOST) -> ProcessInfo | None:
        """The program's process if it runs: RUNNING, or STARTING with a process (within supervisord's
        startsecs; a replica is checked, and may serve, from the moment its process exists)."""
        info = self.processes.get(process_key(host, f"{program}:{program}"))
        return info if info is not None and live(info) else None
