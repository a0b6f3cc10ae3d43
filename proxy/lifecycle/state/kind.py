"""Kinds of replica, as the pool sees them: the rules half of the seam (`KindRules`).

The pool's decisions (admission, routing, states, metrics) are the same for every model; what a
kind decides is how its replicas start and stop, whether they are healthy, how a request reaches
one (its `Reach`, proxy/upstream/reach.py) and which gate a request to it must pass. The seam has
two halves: `KindRules`, here, judges a model and a request with no I/O beyond reading its files
(what `check-config` uses), and `KindRunner` starts, stops, adds and removes replicas; a `Kind` is
both. The runner and `Kind` are declared beside the ModelRuntime they act on
(proxy/lifecycle/state/runtime.py), so that neither module names the other's types. The kinds
themselves are in proxy/lifecycle/kinds/ (rules.py, program_kind.py, remote.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol

if TYPE_CHECKING:
    from proxy.config.model import ModelConfig


class KindRules(Protocol):
    """What one kind of replica asks of a model and of a request, deciding without running anything."""

    def check(self, config: ModelConfig) -> list[str]:
        """Problems that stop the model from loading, each naming the field (never a secret's value)."""
        ...

    def gate(self, config: ModelConfig, headers: Mapping[str, str], body: Mapping[str, Any]) -> None:
        """Raise a PoolError if this request may not go to such a model at all."""
        ...

    def describe(self, config: ModelConfig) -> dict[str, object]:
        """Extra fields of the model's admin row."""
        ...
