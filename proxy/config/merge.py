"""How settings documents combine: the local file over the base one, a load's overrides over a
model's settings, and what a reload changed."""
from __future__ import annotations

from typing import Any, Mapping


def deep_merge(base: Any, over: Any) -> Any:
    """`over` wins per key; mappings merge recursively, anything else (lists too) is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        merged = dict(base)
        for key, value in over.items():
            merged[key] = deep_merge(base[key], value) if key in base else value
        return merged
    return over


def changed(base: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """What `current` sets differently from `base`; of a nested mapping, only the keys that differ."""
    found: dict[str, Any] = {}
    for key, value in current.items():
        was = base.get(key)
        if isinstance(was, dict) and isinstance(value, dict):
            if inner := changed(was, value):
                found[key] = inner
        elif was != value:
            found[key] = value
    return found
