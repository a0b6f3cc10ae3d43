"""Which kind runs each backend, and what each backend can do.

The seam itself (`KindRules`, `KindRunner`, `Kind`) is declared in the state wing
(proxy/lifecycle/state/kind.py and runtime.py); the kinds are `ProgramKind`
(proxy/lifecycle/kinds/program_kind.py) and `EndpointKind` (proxy/lifecycle/kinds/remote.py), each its
rules (proxy/lifecycle/kinds/rules.py) plus a runner. `kinds_for` picks among either: the pool's
runners, or `check-config`'s rules alone.
"""
from __future__ import annotations

from typing import TypeVar

from launchers import launcher_for
from proxy.capabilities import Traits
from proxy.lifecycle.kinds import remote_options

# Backends whose replica is a remote endpoint; every other runnable backend has a launcher.
ENDPOINT_BACKENDS = frozenset({"openai_remote"})

K = TypeVar("K")


def kinds_for(backends: set[str], program: K, endpoint: K) -> dict[str, K]:
    """The kind of each configured backend this version can run (`program` or `endpoint`: the
    kinds, or only their rules); a backend left out answers 409 backend_not_supported on load."""
    kinds: dict[str, K] = {}
    for backend in backends:
        if backend in ENDPOINT_BACKENDS:
            kinds[backend] = endpoint
        elif launcher_for(backend) is not None:
            kinds[backend] = program
    return kinds


def traits_for(backend: str) -> Traits:
    """What `backend` can do, as it declares it; a backend this version cannot run can do nothing."""
    if backend in ENDPOINT_BACKENDS:
        return remote_options.TRAITS
    launcher = launcher_for(backend)
    return launcher.TRAITS if launcher is not None else Traits()
