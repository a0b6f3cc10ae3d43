"""GPU memory: measured through NVML per GPU and per replica process tree, estimated per model.

NVML comes from nvidia-ml-py (`import pynvml`), imported only here and only when asked, so a
machine without it (or without a GPU) still serves: the answer then says `available: false` with
the reason, and still gives every model's estimate.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from proxy.config.model import ModelConfig
from proxy.gpu.proc_tree import descendants, parent_pids
from proxy.gpu.vram_estimate import MIB, Estimator

# An idle GPU shows some memory used by the driver itself; above this, memory is in use by someone.
# When NVML then lists no process, it cannot see the processes (a container's own PID namespace).
IDLE_USED_BYTES = 1024 * MIB


@dataclass(frozen=True)
class ModelSnapshot:
    """What the report needs of a model, taken on the event loop so the report can run in a thread."""

    config: ModelConfig
    state: str
    replica_pids: tuple[tuple[int, int], ...]   # (replica index, supervisord's PID for it)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None      # None: NVML does not know (containers, some platforms)


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str
    used_bytes: int
    total_bytes: int
    processes: tuple[GpuProcess, ...] | None    # None: NVML could not list them
    error: str | None = None


def load_nvml() -> Any:
    import pynvml  # nvidia-ml-py, the `gpu` extra
    return pynvml


def read_gpus(nvml: Any) -> list[GpuReading]:
    """Every GPU's memory and the processes NVML lists on it. The caller has initialised NVML."""
    readings = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        name = nvml.nvmlDeviceGetName(handle)
        processes: tuple[GpuProcess, ...] | None
        error = None
        try:
            seen: dict[int, GpuProcess] = {}
            for query in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
                for proc in query(handle):
                    seen.setdefault(int(proc.pid), GpuProcess(int(proc.pid), proc.usedGpuMemory))
            processes = tuple(seen.values())
        except nvml.NVMLError as exc:
            processes, error = None, str(exc)
        readings.append(GpuReading(index=index, name=name.decode() if isinstance(name, bytes) else str(name),
                                   used_bytes=int(info.used), total_bytes=int(info.total),
                                   processes=processes, error=error))
    return readings


def pid_visibility(gpu: GpuReading, live: set[int]) -> str | None:
    """Why NVML's process list cannot attribute this GPU's memory to our PIDs; None when it can."""
    if gpu.processes is None:
        return f"NVML could not list the processes on GPU {gpu.index}: {gpu.error}"
    if gpu.processes and not any(p.pid in live for p in gpu.processes):
        return (f"NVML lists processes on GPU {gpu.index} whose PIDs do not exist here (a container with "
                "its own PID namespace?): per-process memory cannot be matched")
    if not gpu.processes and gpu.used_bytes >= IDLE_USED_BYTES:
        return (f"NVML lists no process on GPU {gpu.index} while {gpu.used_bytes // MIB} MiB are used "
                "(a container?): per-process memory cannot be matched")
    if any(p.used_bytes is None for p in gpu.processes):
        return f"NVML does not report per-process memory on GPU {gpu.index}"
    return None


def _measured(model: ModelSnapshot, gpus: list[GpuReading], blind: dict[int, str],
              parents: dict[int, int]) -> dict[str, Any] | None:
    if not model.replica_pids:
        return None
    by_pid = {p.pid: (g.index, p.used_bytes) for g in gpus for p in (g.processes or ())}
    relevant = [g.index for g in gpus if not model.config.gpus or g.index in model.config.gpus]
    reasons = [blind[i] for i in relevant if i in blind]
    replicas = []
    total = 0
    matched_any = False
    for index, pid in model.replica_pids:
        tree = descendants(pid, parents) if pid in parents else [pid]
        procs = [{"pid": p, "gpu": by_pid[p][0], "used_mib": _mib(by_pid[p][1])} for p in tree if p in by_pid]
        used = sum(by_pid[p][1] or 0 for p in tree if p in by_pid)
        matched_any = matched_any or bool(procs)
        total += used
        replicas.append({"index": index, "pids": tree, "processes": procs,
                         "used_mib": _mib(used) if procs or not reasons else None})
    if not matched_any and reasons:
        # NVML cannot see our processes: unknown, not zero.
        return {"used_mib": None, "reason": "; ".join(reasons), "replicas": replicas}
    return {"used_mib": _mib(total), "replicas": replicas, **({"partial": "; ".join(reasons)} if reasons else {})}


def _fits(per_replica_bytes: int, model: ModelConfig, gpus: list[GpuReading]) -> dict[str, bool]:
    """Whether one more replica fits in each GPU's free memory now. A model given several GPUs is
    assumed to spread evenly over them."""
    mine = [g for g in gpus if g.index in model.gpus] if model.gpus else gpus
    share = per_replica_bytes / (len(model.gpus) if len(model.gpus) > 1 else 1)
    return {str(g.index): share <= g.total_bytes - g.used_bytes for g in mine}


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / MIB, 1)


def gpu_report(models: list[ModelSnapshot], estimator: Estimator,
               nvml_loader: Callable[[], Any] = load_nvml, proc: Path = Path("/proc")) -> dict[str, Any]:
    """The `/v1/admin/gpu-memory` answer. Blocking (NVML, /proc, model files): run it in a thread."""
    gpus: list[GpuReading] = []
    reason = None
    try:
        nvml = nvml_loader()
        nvml.nvmlInit()
    except Exception as exc:  # ImportError or NVMLError: both mean "no GPU information here"
        reason = f"NVML unavailable: {type(exc).__name__}: {exc}"
    else:
        try:
            gpus = read_gpus(nvml)
        except Exception as exc:
            reason = f"NVML failed: {type(exc).__name__}: {exc}"
        finally:
            nvml.nvmlShutdown()
    parents = parent_pids(proc)
    blind = {g.index: why for g in gpus if (why := pid_visibility(g, set(parents))) is not None}
    out_models = {}
    for model in models:
        est = estimator.estimate(model.config)
        out_models[model.config.name] = {
            "state": model.state,
            "gpus": list(model.config.gpus),
            "measured": _measured(model, gpus, blind, parents) if gpus else None,
            "estimate": est.as_dict(model.config.replicas),
            "fits": _fits(est.total_bytes, model.config, gpus) if gpus else None,
        }
    gpu_rows = [{"index": g.index, "name": g.name, "used_mib": _mib(g.used_bytes), "total_mib": _mib(g.total_bytes),
                 "free_mib": _mib(g.total_bytes - g.used_bytes), "pids_visible": g.index not in blind,
                 **({"note": blind[g.index]} if g.index in blind else {})} for g in gpus]
    answer: dict[str, Any] = {"available": reason is None, "gpus": gpu_rows, "models": out_models}
    if reason is not None:
        answer["reason"] = reason
    return answer
