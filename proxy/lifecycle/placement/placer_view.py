"""What the placer shows admins: a model's lifecycle fields (its admin row) and the memory report
(GET /v1/admin/memory). Read-only views of the placer's picture (proxy/lifecycle/placement/placer.py)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from proxy.config.settings import LifecycleSettings
from proxy.lifecycle.placement.memory import Memory, qualify
from proxy.lifecycle.placement.rules import MIB, ModelView, Shortfall
from proxy.lifecycle.placement.working_set import WorkingSet
from proxy.lifecycle.state.runtime import ModelRuntime


def model_fields(runtime: ModelRuntime, memory: Memory, short: Shortfall | None,
                 charges: Mapping[str, Mapping[str, int]] | None, now: float) -> dict[str, Any]:
    """The lifecycle fields of a model's admin row. `short`: why its load waits for room;
    `charges`: what each replica of a model that holds memory is charged, per host and device;
    `now`: wall-clock time."""
    used = runtime.last_used
    busy = runtime.admission.active or runtime.admission.waiting
    return {
        "load_on_demand": runtime.config.load_on_demand,
        "idle_unload_s": runtime.config.idle_unload_s,
        "pinned": runtime.config.pinned,
        "last_used": round(used, 3) if used else None,
        "idle_for_s": None if not used or busy else round(max(0.0, now - used), 1),
        "footprint": {**memory.describe(runtime.model), "charged_mib_per_replica": _charged(charges)},
        "loads": dict(runtime.loads),
        "unloads": dict(runtime.unloads),
        "evictions": runtime.unloads.get("evicted", 0),
        "backoff": runtime.backoff.describe(now) if runtime.backoff is not None and runtime.backoff.until > now
        else None,
        "waiting_for_room": short.as_dict() if short is not None else None,
    }


def _charged(charges: Mapping[str, Mapping[str, int]] | None) -> dict[str, float] | None:
    """What each replica is charged, by host-qualified device, in MiB."""
    return {qualify(h, d): round(b / MIB, 1) for h, per in charges.items() for d, b in per.items()} \
        if charges else None


def memory_report(views: Sequence[ModelView], memory: Memory, life: LifecycleSettings, loading: Sequence[str],
                  waiting: Mapping[str, Shortfall], models: Mapping[str, ModelRuntime],
                  working_set: WorkingSet, mono: float) -> dict[str, Any]:
    """GET /v1/admin/memory: per device its budget, what loaded models hold, what loads in flight
    reserve; the loads in flight (`loading`) and those waiting for room, in order; the thrashes
    counted and the last one while it is within its window (`mono`: now, monotonic)."""
    budgets = memory.budgets()
    devices: dict[str, dict[str, Any]] = {}
    for view in views:
        for device, need in view.needs.items():
            row = devices.setdefault(device, {"used_bytes": 0, "reserved_bytes": 0, "unloading_bytes": 0,
                                              "models": []})
            if view.status in ("loaded", "unloading", "asleep"):
                row["used_bytes"] += need
                row["unloading_bytes"] += need if view.status == "unloading" else 0
                row["models"].append(view.name)
            elif view.status == "loading":
                row["reserved_bytes"] += need
                row["models"].append(view.name)
    for device in budgets:
        devices.setdefault(device, {"used_bytes": 0, "reserved_bytes": 0, "unloading_bytes": 0, "models": []})
    rows = []
    for device, row in sorted(devices.items()):
        budget = budgets.get(device)
        # While an eviction runs, the models being unloaded still hold what the load they make
        # room for has reserved: both are counted, and free is 0 until they are gone.
        rows.append({"device": device, "budget_bytes": budget, **row,
                     "free_bytes": None if budget is None
                     else max(0, budget - row["used_bytes"] - row["reserved_bytes"])})
    order = sorted(waiting, key=lambda n: -models[n].admission.oldest_wait_s())
    return {"devices": rows, "gpus_visible": bool(memory.gpus.totals), "gpu_reason": memory.gpus.reason,
            "max_loaded_models": life.max_loaded_models,
            "loaded_models": sum(1 for v in views if v.counted and v.status != "cold"),
            "swap_max_wait_s": life.swap_max_wait_s,
            "min_residence_s": life.min_residence_s,
            "loading": list(loading),
            "thrash": {"window_s": working_set.window_s, "counts": dict(working_set.counts),
                       "recent": None if (last := working_set.recent(mono)) is None
                       else last.as_dict(working_set.window_s)},
            "waiting_for_room": [{"model": n, "waited_s": round(models[n].admission.oldest_wait_s(), 3),
                                  **waiting[n].as_dict()} for n in order]}
