"""What a running replica really takes: its process tree's GPU memory (NVML) or CPU memory (its
resident pages, a file mapped by several of its processes counted once).

On the CPU, resident pages (Rss), not PSS. PSS splits each page shared with other processes between
them, so a model's figure depended on what else ran: the demo model measured 10.2 to 19.3 MiB as
other llama-servers mapping the same GGUF and libraries came and went, and a budget admitted by it
made two models evict each other in turn (issue 29). What a tree has resident does not change with
its neighbours. Within the tree a file's pages (libraries, weights that vLLM's workers all map,
shared memory) are counted once, as the tree needs them once; anonymous memory (the KV cache,
compute buffers, heaps) per process. Two replicas of one GGUF each count its weights, as the
estimates do: on the safe side, since each replica alone would need them. Blocking (/proc, NVML):
run in a thread.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from proxy.gpu.proc_tree import descendants, parent_pids
from proxy.gpu.report import load_nvml, read_gpus


@dataclass(frozen=True)
class GpuTotals:
    """Each visible GPU's total memory in bytes by device name ("gpu0", ...), or why none is known."""

    totals: dict[str, int]
    reason: str | None = None


def gpu_device(index: int) -> str:
    return f"gpu{index}"


def gpu_totals(nvml_loader: Callable[[], Any] = load_nvml) -> GpuTotals:
    try:
        nvml = nvml_loader()
        nvml.nvmlInit()
    except Exception as exc:  # ImportError or NVMLError: no GPU information here
        return GpuTotals({}, f"NVML unavailable: {type(exc).__name__}: {exc}")
    try:
        return GpuTotals({gpu_device(g.index): g.total_bytes for g in read_gpus(nvml)})
    except Exception as exc:
        return GpuTotals({}, f"NVML failed: {type(exc).__name__}: {exc}")
    finally:
        nvml.nvmlShutdown()


# A mapping's header line in /proc/<pid>/smaps: range, perms, offset, device, inode, path.
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) (\S+) (\d+)")


def tree_cpu_bytes(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The memory `pid` and its descendants have resident, each file's pages once (above); None
    when `pid` is gone."""
    anonymous, seen = 0, False
    files: dict[tuple[str, str, str, int], int] = {}   # (device, inode, offset, size) -> bytes resident
    for member in descendants(pid, parent_pids(proc)):
        mappings = _mappings(proc / str(member))
        if mappings is None:
            continue
        seen = True
        for key, rss, anon in mappings:
            anonymous += anon if key is not None else rss
            if key is not None:
                files[key] = max(files.get(key, 0), rss - anon)
    return anonymous + sum(files.values()) if seen else None


def _mappings(process: Path) -> list[tuple[tuple[str, str, str, int] | None, int, int]] | None:
    """Each mapping of a process: its file's key (None when anonymous), its Rss and the part of it
    that is anonymous (a private file mapping's written pages), in bytes; None when it is gone."""
    try:
        text = (process / "smaps").read_text()
    except OSError:
        return None
    out: list[tuple[tuple[str, str, str, int] | None, int, int]] = []
    key: tuple[str, str, str, int] | None = None
    rss = anon = 0
    started = False
    for line in text.splitlines():
        header = _MAPPING.match(line)
        if header:
            if started:
                out.append((key, rss, anon))
            start, end, offset, device, inode = header.groups()
            key = None if inode == "0" else (device, inode, offset, int(end, 16) - int(start, 16))
            rss = anon = 0
            started = True
        elif line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Anonymous:"):
            anon = int(line.split()[1]) * 1024
    if started:
        out.append((key, rss, anon))
    return out


def tree_gpu_bytes(pid: int, nvml_loader: Callable[[], Any] = load_nvml,
                   proc: Path = Path("/proc")) -> dict[str, int] | None:
    """GPU memory held by `pid` and its descendants, per GPU; None when NVML cannot say."""
    tree = set(descendants(pid, parent_pids(proc)))
    try:
        nvml = nvml_loader()
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        used: dict[str, int] = {}
        for gpu in read_gpus(nvml):
            for process in gpu.processes or ():
                if process.pid in tree and process.used_bytes is not None:
                    device = gpu_device(gpu.index)
                    used[device] = used.get(device, 0) + process.used_bytes
        return used or None
    except Exception:
        return None
    finally:
        nvml.nvmlShutdown()
