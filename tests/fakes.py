"""Fakes, all of them here. Each stands in for something these unit tests keep out on purpose;
the integration tests use the real thing."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

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


class FakeNvmlError(Exception):
    """FAKE pynvml.NVMLError."""


class FakeNvml:
    """FAKE pynvml (nvidia-ml-py) module: NVML needs an NVIDIA driver and GPU, which these tests do
    not have. It answers the calls proxy/gpu.py makes from a table of GPUs, each with its memory and
    the processes NVML would list (pid, used bytes; None when NVML cannot tell)."""

    NVMLError = FakeNvmlError

    def __init__(self, gpus: list[dict[str, Any]]) -> None:
        self.gpus = gpus
        self.initialised = False
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        assert self.initialised
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> bytes:
        return handle.get("name", "FAKE GPU").encode()  # older nvidia-ml-py returns bytes

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(used=handle["used"], total=handle["total"], free=handle["total"] - handle["used"])

    def nvmlDeviceGetComputeRunningProcesses(self, handle: dict[str, Any]) -> list[SimpleNamespace]:
        if handle.get("processes_error"):
            raise FakeNvmlError(handle["processes_error"])
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.get("processes", [])]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: dict[str, Any]) -> list[SimpleNamespace]:
        return []
