"""Fakes, all of them here. Each stands in for something these unit tests keep out on purpose;
the integration tests use the real thing."""
from __future__ import annotations

from typing import Callable

from supervisor.xmlrpc import Faults

from proxy.supervisor import BadName, NotRunning, ProcessInfo, ProcessState, StillRunning


class FakeSupervisor:
    """FAKE supervisord driver: records the calls the pool makes and answers from a process table."""

    def __init__(self) -> None:
        self.processes: dict[str, ProcessInfo] = {}
        self.calls: list[tuple[str, str]] = []
        self.log = "llama-server: error: model file is corrupt"

    def set(self, fullname: str, state: ProcessState, pid: int) -> ProcessInfo:
        group, name = fullname.split(":")
        info = ProcessInfo(group=group, name=name, state=state, pid=pid, exitstatus=0, description="")
        self.processes[fullname] = info
        return info

    async def all_process_info(self) -> list[ProcessInfo]:
        return list(self.processes.values())

    async def tail_log(self, fullname: str, length: int = 4000) -> str:
        return self.log

    async def stop_process(self, fullname: str) -> None:
        self.calls.append(("stop", fullname))

    async def start_process(self, fullname: str) -> None:
        self.calls.append(("start", fullname))


class ScriptedSupervisor(FakeSupervisor):
    """FAKE supervisord driver for unload under faults: stopProcess and removeProcessGroup follow
    supervisord's rules (a stopped, exited or fatal process is NOT_RUNNING; a group with a live
    process is STILL_RUNNING), `faults[method]` raises its queued exceptions first, and each
    `script` step changes the process table before one getAllProcessInfo answers (a crash, a
    restart by autorestart, a process that ignores its stop)."""

    STOPPED_STATES = (ProcessState.STOPPED, ProcessState.EXITED, ProcessState.FATAL)

    def __init__(self) -> None:
        super().__init__()
        self.faults: dict[str, list[Exception]] = {}
        self.script: list[Callable[["ScriptedSupervisor"], None]] = []
        self.stuck: set[str] = set()     # programs that stay STOPPING when asked to stop
        self.removed: list[str] = []

    def _fault(self, method: str) -> None:
        queued = self.faults.get(method)
        if queued:
            raise queued.pop(0)

    async def all_process_info(self) -> list[ProcessInfo]:
        self._fault("all_process_info")
        if self.script:
            self.script.pop(0)(self)
        return list(self.processes.values())

    async def stop_process(self, fullname: str) -> None:
        self.calls.append(("stop", fullname))
        self._fault("stop_process")
        info = self.processes.get(fullname)
        if info is None:
            raise BadName(Faults.BAD_NAME, f"BAD_NAME: {fullname}")
        if info.state in self.STOPPED_STATES:
            raise NotRunning(Faults.NOT_RUNNING, f"NOT_RUNNING: {fullname}")
        stuck = fullname in self.stuck and info.state != ProcessState.BACKOFF
        self.set(fullname, ProcessState.STOPPING if stuck else ProcessState.STOPPED, info.pid if stuck else 0)

    async def remove_process_group(self, name: str) -> None:
        self.calls.append(("remove", name))
        self._fault("remove_process_group")
        members = [i for i in self.processes.values() if i.group == name]
        if not members:
            raise BadName(Faults.BAD_NAME, f"BAD_NAME: {name}")
        if any(i.state not in self.STOPPED_STATES for i in members):
            raise StillRunning(Faults.STILL_RUNNING, f"STILL_RUNNING: {name}")
        for info in members:
            del self.processes[info.fullname]
        self.removed.append(name)

    async def reload_config(self) -> tuple[list[str], list[str], list[str]]:
        self.calls.append(("reload", ""))
        self._fault("reload_config")
        return [], [], []
