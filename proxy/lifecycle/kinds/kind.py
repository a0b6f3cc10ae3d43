"""Kinds of replica: what differs between a supervised program and a remote endpoint.

The pool's decisions (admission, routing, states, metrics) are the same for every model; what a
kind decides is how its replicas start and stop, whether they are healthy, how a request reaches
one (its `Reach`, proxy/upstream/reach.py) and which gate a request to it must pass. `Kind` is
that seam; the kinds themselves are `ProgramKind` (proxy/lifecycle/kinds/programs.py) and `EndpointKind`
(proxy/lifecycle/kinds/remote.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from launchers import launcher_for
from proxy.capabilities import Traits
from proxy.lifecycle.kinds import remote
if TYPE_CHECKING:
    from proxy.config.model import ModelConfig
    from proxy.lifecycle.state.replicas import Replica
    from proxy.lifecycle.state.runtime import ModelRuntime


# Backends whose replica is a remote endpoint; every other runnable backend has a launcher.
ENDPOINT_BACKENDS = frozenset({"openai_remote"})


class Kind(Protocol):
    """Start, stop and gate one kind of replica; the pool calls nothing else that differs per kind."""

    def check(self, config: ModelConfig) -> list[str]:
        """Problems that stop the model from loading, each naming the field (never a secret's value)."""
        ...

    async def start(self, runtime: ModelRuntime, config: ModelConfig) -> None:
        """Create runtime.replicas and set them going; health decides READY (the pool waits for it)."""
        ...

    async def stop(self, runtime: ModelRuntime) -> None:
        """Whatever runs for the replicas is gone when this returns."""
        ...

    async def add(self, runtime: ModelRuntime, config: ModelConfig, indices: Sequence[int]) -> list[Replica]:
        """Live scaling up: append replicas `indices` to runtime.replicas and set them going, leaving
        the others alone; health decides READY (the pool waits for it). Returns the new replicas."""
        ...

    async def remove(self, runtime: ModelRuntime, replicas: list[Replica]) -> None:
        """Live scaling down: whatever runs for `replicas` (already drained) is gone when this
        returns; the others are left alone."""
        ...

    def gate(self, config: ModelConfig, headers: Mapping[str, str], body: Mapping[str, Any]) -> None:
        """Raise a PoolError if this request may not go to such a model at all."""
        ...

    def describe(self, config: ModelConfig) -> dict[str, object]:
        """Extra fields of the model's admin row."""
        ...


def kinds_for(backends: set[str], program: Kind, endpoint: Kind) -> dict[str, Kind]:
    """The kind of each configured backend this version can run; a backend left out answers
    409 backend_not_supported on load."""
    kinds: dict[str, Kind] = {}
    for backend in backends:
        if backend in ENDPOINT_BACKENDS:
            kinds[backend] = endpoint
        elif launcher_for(backend) is not None:
            kinds[backend] = program
    return kinds


def traits_for(backend: str) -> Traits:
    """What `backend` can do, as it declares it; a backend this version cannot run can do nothing."""
    if backend in ENDPOINT_BACKENDS:
        return remote.TRAITS
    launcher = launcher_for(backend)
    return launcher.TRAITS if launcher is not None else Traits()
