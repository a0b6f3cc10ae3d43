"""A process and its descendants, read from /proc: a replica's GPU memory is held by its whole tree
(vLLM's engine core and tensor-parallel workers are children of `vllm serve`)."""
from __future__ import annotations

import os
from pathlib import Path


def parent_pids(proc: Path = Path("/proc")) -> dict[int, int]:
    """pid -> parent pid for every process visible in `proc`."""
    parents: dict[int, int] = {}
    try:
        entries = os.listdir(proc)
    except OSError:
        return parents
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = (proc / entry / "stat").read_text()
        except OSError:
            continue  # it exited while we were reading
        # The command name (field 2) is in parentheses and may itself hold spaces or ')': the
        # fields after the last ')' are state, ppid, ...
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) >= 2:
            parents[int(entry)] = int(fields[1])
    return parents


def descendants(pid: int, parents: dict[int, int]) -> list[int]:
    """`pid` and every process below it, parents before children."""
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    tree = [pid]
    i = 0
    while i < len(tree):
        tree.extend(sorted(children.get(tree[i], ())))
        i += 1
    return tree
