"""Why a running replica is out of date: which settings differ between those it was started with and
those its model gives now, by name only (settings may name secrets' variables, programs hold their
values). Pure; the program kind (proxy/lifecycle/kinds/programs.py) says it of each replica it adopts,
and the pool rolls such replicas (proxy/lifecycle/rolling.py).
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping, Sequence

from proxy.config.model import ModelConfig

# Settings of how many replicas run and when, not of what each one runs.
_NOT_PROGRAM = frozenset({"replicas", "replica_max", "enabled", "load_on_demand", "idle_unload_s", "pinned",
                          "fallbacks"})   # and which models answer in its place


def what_changed(old: ModelConfig, new: ModelConfig) -> list[str]:
    """The names of the settings that differ between `old` and `new` (a nested one as `sim.ttft_ms`),
    never their values. Those of how many replicas run and when (the count, idle_unload_s, ...) are
not among them: they change no replica's program."""
    names = [f.name for f in fields(ModelConfig)
             if f.name not in _NOT_PROGRAM and f.name != "options" and getattr(old, f.name) != getattr(new, f.name)]

    def walk(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str) -> None:
        for key in sorted(set(a) | set(b)):
            if not prefix and key in _NOT_PROGRAM:
                continue
            x, y = a.get(key), b.get(key)
            if isinstance(x, Mapping) and isinstance(y, Mapping):
                walk(x, y, f"{prefix}{key}.")
            elif x != y:
                names.append(prefix + key)
    walk(old.options, new.options, "")
    return sorted(set(names))


def outdated_reason(names: Sequence[str], exact: bool) -> str:
    """Why a running replica is out of date, by setting name (never a value: a program holds secrets)."""
    if names:
        said = "settings changed: " + ", ".join(names)
        return said if exact else said + " (and its program differs otherwise: environment or llm-pool version)"
    return "its program differs from what its settings give now (environment or llm-pool version)"
