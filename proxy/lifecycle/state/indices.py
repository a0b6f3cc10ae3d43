"""Replica indices: a replica's index is its name, and a new one takes the lowest index free."""
from __future__ import annotations

from typing import Sequence


def free_indices(used: Sequence[int], count: int) -> list[int]:
    """The `count` lowest replica indices not in `used`.

    A replica's index is its name (program `<model>-<hash>-r<i>`, `model/r<i>` in the admin view),
    not its position: a program cannot be renamed while it runs, so a roll (rolling.py) starts each
    new replica under the lowest index free then (the one past the others for the first, then the
    index of the old replica it replaced) and a rolled model's indices may have a gap (r0, r2).
    Scaling takes the same rule: up adds the lowest free indices, down removes the highest ones,
    and a restarted proxy adopts the running replicas by their indices, whatever they are."""
    taken = set(used)
    found: list[int] = []
    i = 0
    while len(found) < count:
        if i not in taken:
            found.append(i)
        i += 1
    return found
