"""The placer's admission of a request for a model that is not loaded (Placer.demand)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from fakes import RecordingPlacerActions
from proxy.admission import Admission
from proxy.config.loading import load_settings
from proxy.errors import BackendError, Conflict, Unavailable
from proxy.gpu.footprint import GpuTotals
from proxy.gpu.vram_estimate import Estimator
from proxy.lifecycle.placement.footprints import Footprints
from proxy.lifecycle.placement.memory import Memory
from proxy.lifecycle.placement.placer import Placer
from proxy.lifecycle.state.replicas import ModelState
from proxy.lifecycle.state.runtime import Backoff, ModelRuntime


def placer(tmp_path: Path) -> tuple[Placer, ModelRuntime]:
    (tmp_path / "pool.yaml").write_text(f"service: {{state_dir: {tmp_path}}}\n"
                                        "engine: {models: {m: {backend: sim, load_on_demand: true}}}\n")
    settings = load_settings(tmp_path / "pool.yaml")
    runtime = ModelRuntime(config=settings.models["m"], admission=Admission())
    memory = Memory(settings.lifecycle, Footprints(tmp_path / "footprints.json"), Estimator(), GpuTotals({}))
    return Placer(settings, {"m": runtime}, memory, RecordingPlacerActions({"m": runtime})), runtime


async def test_a_request_for_a_model_being_swapped_out_queues_without_reopening_it(tmp_path: Path) -> None:
    placer_, runtime = placer(tmp_path)
    runtime.admission.set_capacity(1)
    runtime.admission.hold()                # being evicted: its queue waits for its next load
    placer_.demand(runtime)
    assert runtime.admission.capacity == 0  # a slot granted now would keep it from ever draining
    runtime.admission.enqueue("k")          # and the request may queue
    assert runtime.admission.waiting == 1


async def test_after_an_admins_unload_or_a_failed_load_requests_may_queue_again(tmp_path: Path) -> None:
    placer_, runtime = placer(tmp_path)
    runtime.admission.close(Unavailable("gone", code="model_unloading"))
    placer_.demand(runtime)
    runtime.admission.enqueue("k")
    assert runtime.admission.waiting == 1


def test_a_model_backing_off_is_refused_at_once_with_when_it_is_tried_again(tmp_path: Path) -> None:
    import time

    placer_, runtime = placer(tmp_path)
    runtime.backoff = Backoff(2, time.time() + 60, BackendError("model 'm' failed to load: boom",
                                                                code="model_load_failed"))
    with pytest.raises(BackendError) as caught:
        placer_.demand(runtime)
    assert caught.value.code == "model_load_failed" and "next load is tried in" in caught.value.message
    assert caught.value.retry_after is not None and caught.value.retry_after > 50


def test_a_model_backing_off_for_a_setting_is_refused_without_retry_after(tmp_path: Path) -> None:
    # Before: 409 model_not_loadable with Retry-After, for a missing file that no wait brings back.
    import time

    placer_, runtime = placer(tmp_path)
    runtime.backoff = Backoff(1, time.time() + 60, Conflict("model 'm' cannot be loaded: engine.models.m.model_path: "
                                                            "/m.gguf does not exist", code="model_not_loadable"))
    with pytest.raises(Conflict) as caught:
        placer_.demand(runtime)
    assert caught.value.code == "model_not_loadable" and caught.value.headers() == {}
    assert "model_path: /m.gguf does not exist" in caught.value.message
    assert "llm-pool check-config" in caught.value.message and "tried in" not in caught.value.message


async def test_a_reloads_successor_unloads_nothing_before_its_predecessor_has_exited(tmp_path: Path) -> None:
    (tmp_path / "pool.yaml").write_text(f"service: {{state_dir: {tmp_path}}}\n"
                                        "engine: {models: {m: {backend: sim, idle_unload_s: 1}}}\n")
    settings = load_settings(tmp_path / "pool.yaml")
    runtime = ModelRuntime(config=settings.models["m"], admission=Admission())
    runtime.state = ModelState.LOADED
    runtime.admission.last_used = time.time() - 60     # idle well past idle_unload_s
    memory = Memory(settings.lifecycle, Footprints(tmp_path / "footprints.json"), Estimator(), GpuTotals({}))
    pool = RecordingPlacerActions({"m": runtime}, predecessor_gone=False)
    placer_ = Placer(settings, {"m": runtime}, memory, pool)
    # The predecessor may still be streaming from m: no idle unload, and planning comes back soon.
    assert placer_._plan_once() == 1.0
    assert pool.spawned == []
    pool.predecessor_gone.set()
    placer_._plan_once()
    assert pool.spawned == ["Placer._unload"]
    pool.drop_spawned()
