"""GPU memory through NVML: per device, and per model from its replicas' processes."""
from __future__ import annotations

from typing import Any

from proxy.pool import Pool

MIB = 1024 * 1024


def gpu_memory(pool: Pool) -> dict[str, Any]:
    """Used and total memory per GPU and what each loaded model's processes hold.

    Without NVML (no driver, no GPU, nvidia-ml-py not installed) the answer says so instead of failing:
    a CPU-only pool is a supported setup.
    """
    try:
        import pynvml  # from nvidia-ml-py; imported here so a machine without it still serves
        pynvml.nvmlInit()
    except Exception as exc:  # ImportError or NVMLError: both mean "no GPU information here"
        return {"available": False, "reason": f"NVML unavailable: {type(exc).__name__}", "gpus": [], "models": {}}
    try:
        pids = {r.pid: name for name, rt in pool.models.items() for r in rt.replicas if r.pid}
        per_model: dict[str, int] = {}
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append({"index": index, "name": pynvml.nvmlDeviceGetName(handle),
                         "used_mib": info.used // MIB, "total_mib": info.total // MIB})
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                model = pids.get(proc.pid)
                if model and proc.usedGpuMemory:
                    per_model[model] = per_model.get(model, 0) + proc.usedGpuMemory
        return {"available": True, "gpus": gpus,
                "models": {name: {"used_mib": used // MIB} for name, used in sorted(per_model.items())}}
    finally:
        pynvml.nvmlShutdown()
