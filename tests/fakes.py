"""Fakes, all of them here. Each stands in for something these unit tests keep out on purpose;
the integration tests use the real thing."""
from __future__ import annotations

from proxy.supervisor import ProcessInfo, ProcessState


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


class FakeSSEResponse:
    """FAKE upstream aiohttp response: `content.readline()` hands out the given lines, then EOF.
    For parsing a stream exactly as a misbehaving backend sent it, without a server."""

    def __init__(self, lines: list[bytes]) -> None:
        self.content = self
        self._lines = list(lines)
        self.closed = False

    async def readline(self) -> bytes:
        return self._lines.pop(0) if self._lines else b""

    def close(self) -> None:
        self.closed = True
