"""What a model that holds memory is charged (issue 29, swaps that thrash on CPU budgets): its
figure as admitted, whatever is measured while it runs; and GET /v1/admin/memory's free memory."""
from __future__ import annotations

import json
import time
from pathlib import Path

from fakes import RecordingPlacerActions
from proxy.admission import Admission
from proxy.config.loading import load_settings
from proxy.gpu.footprint import GpuTotals
from proxy.gpu.vram_estimate import MIB, Estimator
from proxy.lifecycle.placement.footprints import Footprints
from proxy.lifecycle.placement.memory import CPU, Memory
from proxy.lifecycle.placement.rules import room_for
from proxy.lifecycle.placement.placer import Placer
from proxy.lifecycle.state.replicas import ModelState
from proxy.lifecycle.state.runtime import ModelRuntime


def pool(tmp_path: Path, *names: str) -> tuple[Placer, dict[str, ModelRuntime]]:
    engine = {"lifecycle": {"min_residence_s": 0, "memory": {"cpu_budget_mib": 100, "footprint_margin": 0}},
              "models": {n: {"backend": "sim", "load_on_demand": True} for n in names}}
    (tmp_path / "pool.yaml").write_text(json.dumps({"service": {"state_dir": str(tmp_path)}, "engine": engine}))
    settings = load_settings(tmp_path / "pool.yaml")
    runtimes = {n: ModelRuntime(config=settings.models[n], admission=Admission()) for n in names}
    memory = Memory(settings.lifecycle, Footprints(tmp_path / "footprints.json", margin=0), Estimator(),
                    GpuTotals({}))
    return Placer(settings, runtimes, memory, RecordingPlacerActions(runtimes)), runtimes


def loaded(placer: Placer, runtime: ModelRuntime) -> None:
    """An admitted load that has ended, as the pool carries it out."""
    assert placer.admit(runtime, runtime.config) == ()
    runtime.move(ModelState.LOADING)
    runtime.move(ModelState.LOADED)
    runtime.loaded_at = time.monotonic() - 3600
    placer.settled(runtime.name)


async def test_a_measurement_while_loaded_changes_no_charge_and_evicts_nothing(tmp_path: Path) -> None:
    # Before: a's need followed each measurement, so a figure that swung up (PSS as neighbours
    # came and went) made the next cold load evict it: two models evicting each other in turn.
    placer, models = pool(tmp_path, "a", "b")
    placer.memory.footprints.record(models["a"].config, {CPU: 40 * MIB})
    placer.memory.footprints.record(models["b"].config, {CPU: 50 * MIB})
    loaded(placer, models["a"])
    placer.memory.footprints.record(models["a"].config, {CPU: 90 * MIB})   # measured again, higher
    views = {v.name: v for v in placer.views()}
    assert views["a"].needs == {CPU: 40 * MIB}
    room = room_for("b", placer.views(), placer.limits(), time.time())
    assert room.fits and room.evict == ()                    # b fits beside a as a was admitted
    assert placer.describe()["devices"][0]["free_bytes"] == 60 * MIB
    # The new history is what a's next load is charged.
    models["a"].move(ModelState.UNLOADING)
    models["a"].move(ModelState.UNLOADED)
    assert {v.name: v for v in placer.views()}["a"].needs == {CPU: 90 * MIB}


async def test_free_memory_is_never_negative_while_an_eviction_runs(tmp_path: Path) -> None:
    # Before: mid-eviction, the model being unloaded and the load it makes room for were both
    # counted and free_bytes went below 0 (-24 MiB here).
    placer, models = pool(tmp_path, "a", "c")
    placer.memory.footprints.record(models["a"].config, {CPU: 44 * MIB})
    placer.memory.footprints.record(models["c"].config, {CPU: 80 * MIB})
    loaded(placer, models["a"])
    assert placer.admit(models["c"], models["c"].config) == ("a",)   # reserved: c loads once a is gone
    models["a"].move(ModelState.UNLOADING)
    row = placer.describe()["devices"][0]
    assert row["used_bytes"] == 44 * MIB and row["reserved_bytes"] == 80 * MIB
    assert row["free_bytes"] == 0
    assert row["unloading_bytes"] == 44 * MIB


async def test_a_charge_fixed_from_the_estimate_alone_takes_the_first_measurement_once(tmp_path: Path) -> None:
    # A sim has no model files: its estimate is 0. Charged that for its whole residence, it left
    # the room it held to the next load; its first measurement raises the charge, and no later one.
    placer, models = pool(tmp_path, "a")
    loaded(placer, models["a"])
    assert {v.name: v for v in placer.views()}["a"].needs == {CPU: 0}
    placer.memory.footprints.record(models["a"].config, {CPU: 30 * MIB})
    placer.first_measured("a", models["a"].config, "local")
    assert {v.name: v for v in placer.views()}["a"].needs == {CPU: 30 * MIB}
    placer.memory.footprints.record(models["a"].config, {CPU: 90 * MIB})   # a later swing
    placer.first_measured("a", models["a"].config, "local")
    assert {v.name: v for v in placer.views()}["a"].needs == {CPU: 30 * MIB}
    assert placer.describe()["devices"][0]["free_bytes"] == 70 * MIB
