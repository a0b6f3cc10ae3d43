"""The program kind: replicas as supervisord programs, written by the backend's launcher.

`ProgramKind` is the adapter between the `Kind` seam (proxy/lifecycle/state/kind.py) and `Programs`
(proxy/lifecycle/kinds/programs.py), which does the work; its rules are ProgramRules (rules.py).
"""
from __future__ import annotations

from typing import Sequence

from proxy.config.model import ModelConfig
from proxy.lifecycle.kinds.programs import Programs
from proxy.lifecycle.kinds.rules import ProgramRules, launcher_of
from proxy.lifecycle.state.replicas import Replica
from proxy.lifecycle.state.runtime import ModelRuntime


class ProgramKind(ProgramRules):
    """Replicas as supervisord programs (`Programs`), written by the backend's launcher."""

    def __init__(self, programs: Programs) -> None:
        self.programs = programs

    async def start(self, runtime: ModelRuntime, config: ModelConfig) -> None:
        await self.programs.start(runtime, config, launcher_of(config))

    async def stop(self, runtime: ModelRuntime) -> None:
        await self.programs.stop(runtime.name)

    async def add(self, runtime: ModelRuntime, config: ModelConfig, indices: Sequence[int]) -> list[Replica]:
        return await self.programs.add(runtime, config, launcher_of(config), indices)

    async def remove(self, runtime: ModelRuntime, replicas: list[Replica]) -> None:
        await self.programs.remove([(r.host, r.spec.program) for r in replicas if r.spec is not None])
