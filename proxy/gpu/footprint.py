"""What a running replica really takes: its process tree's GPU memory (NVML) or CPU memory (PSS).

PSS, not RSS: pages shared between replicas (the engine's libraries, a GGUF file mapped by two
llama-servers) are split between the processes that share them, so the footprints of replicas
running side by side add up to what they hold together. Blocking (/proc, NVML): run in a thread.
"""
from __future__ import annotations

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


def tree_pss_bytes(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The PSS of `pid` and its descendants; None when `pid` is gone."""
    tree = descendants(pid, parent_pids(proc))
    total, seen = 0, False
    for member in tree:
        pss = _pss_bytes(proc / str(member))
        if pss is not None:
            total, seen = total + pss, True
    return total if seen else None


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


def _pss_bytes(process: Path) -> int | None:
    # smaps_rollup (Linux 4.14+) sums smaps for us; reading every mapping would cost far more.
    try:
        text = (process / "smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return None
