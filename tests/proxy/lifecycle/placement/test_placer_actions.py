"""The placer's decisions, checked by the actions it asks for (proxy/lifecycle/placement/actions.py),
in the style of llama-swap's scheduler tests: a recording fake of the pool carries them out, a
clock the test moves is the only time there is, and each test says what was requested, in order.

Models are sim replicas counted on the CPU budget (100 MiB here); each model's measured footprint
(60 MiB) is what it is charged, so two never fit together."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fakes import FakeClock, FakeReplicaKind, RecordingPlacerActions
from proxy import events as ev
from proxy.admission import Admission
from proxy.config.loading import load_settings
from proxy.errors import BackendError, Unavailable
from proxy.gpu.footprint import GpuTotals
from proxy.gpu.vram_estimate import MIB, Estimator
from proxy.lifecycle.placement.footprints import Footprints
from proxy.lifecycle.placement.load_retry import retry_delay
from proxy.lifecycle.placement.memory import CPU, Memory
from proxy.lifecycle.placement.placer import Placer
from proxy.lifecycle.placement.rules import COUNT
from proxy.lifecycle.state.replicas import ModelState
from proxy.lifecycle.state.runtime import ModelRuntime


class World:
    """A placer over `names` (each charged `mib` MiB), with its recording actions and its clock."""

    def __init__(self, tmp_path: Path, names: dict[str, dict[str, Any]], mib: int = 60, **lifecycle: Any) -> None:
        engine = {"lifecycle": {"min_residence_s": 0, **lifecycle,
                                "memory": {"cpu_budget_mib": 100, "footprint_margin": 0}},
                  "models": {n: {"backend": "sim", "load_on_demand": True, **o} for n, o in names.items()}}
        (tmp_path / "pool.yaml").write_text(json.dumps({"service": {"state_dir": str(tmp_path)}, "engine": engine}))
        self.settings = load_settings(tmp_path / "pool.yaml")
        self.models = {n: ModelRuntime(config=self.settings.models[n], admission=Admission()) for n in names}
        for runtime in self.models.values():
            runtime.kind = FakeReplicaKind()   # a kind this version runs: only such a model loads on demand
        memory = Memory(self.settings.lifecycle, Footprints(tmp_path / "footprints.json", margin=0), Estimator(),
                        GpuTotals({}))
        for runtime in self.models.values():
            memory.footprints.record(runtime.config, {CPU: mib * MIB})
        self.clock = FakeClock()
        self.actions = RecordingPlacerActions(self.models)
        self.placer = Placer(self.settings, self.models, memory, self.actions, clock=self.clock)
        self.actions.placer = self.placer

    def loaded(self, name: str, idle_s: float = 3600.0) -> ModelRuntime:
        """`name` loaded long ago (past any residence or swap bound), last used `idle_s` ago."""
        runtime = self.models[name]
        assert self.placer.admit(runtime, runtime.config) == ()
        runtime.move(ModelState.LOADING)
        runtime.move(ModelState.LOADED)
        runtime.loaded_at = self.clock.monotonic() - 3600
        runtime.admission.last_used = self.clock.time() - idle_s
        self.placer.settled(name)
        return runtime

    def request(self, name: str) -> Any:
        """A request for `name`, not loaded: admitted by the placer (Placer.demand), then queued.
        Returns the future it waits on."""
        runtime = self.models[name]
        self.placer.demand(runtime)
        _ticket, waiter = runtime.admission.enqueue("k")
        assert waiter is not None
        return waiter


async def test_a_failed_on_demand_load_backs_off_and_after_it_the_next_request_tries_again(tmp_path: Path) -> None:
    world = World(tmp_path, {"m": {}})
    world.actions.load_fails["m"] = BackendError("model 'm' failed to load: boom", code="model_load_failed")
    waiter = world.request("m")
    world.placer._plan_once()
    assert world.actions.spawned == ["Placer._load_on_demand"] and world.placer.pending == ["m"]
    await world.actions.run_spawned()
    assert world.actions.calls == [("load", "m", ())] and world.placer.pending == []
    # The waiter gets the load's error, with when the next load is tried.
    delay = retry_delay(world.settings.service, 1)
    failed = waiter.exception()
    assert isinstance(failed, BackendError) and failed.code == "model_load_failed" and failed.retry_after == delay

    # During the back-off a request gets that error at once, and no load is tried.
    world.clock.advance(delay / 2)
    with pytest.raises(BackendError) as caught:
        world.placer.demand(world.models["m"])
    assert caught.value.code == "model_load_failed" and "the next load is tried in" in caught.value.message
    assert caught.value.retry_after == pytest.approx(delay / 2)
    world.placer._plan_once()
    assert world.actions.calls == [("load", "m", ())]

    # After it, the next request queues and its load is tried again.
    world.clock.advance(delay / 2)
    del world.actions.load_fails["m"]
    world.request("m")
    world.placer._plan_once()
    await world.actions.run_spawned()
    assert world.actions.calls == [("load", "m", ()), ("load", "m", ())]
    assert world.models["m"].backoff is None and world.models["m"].state == ModelState.LOADED


async def test_a_second_failure_in_a_row_backs_off_twice_as_long(tmp_path: Path) -> None:
    world = World(tmp_path, {"m": {}})
    world.actions.load_fails["m"] = BackendError("model 'm' failed to load: boom", code="model_load_failed")
    for attempt in (1, 2):
        waiter = world.request("m")
        world.placer._plan_once()
        await world.actions.run_spawned()
        assert waiter.exception().retry_after == retry_delay(world.settings.service, attempt)
        world.clock.advance(retry_delay(world.settings.service, attempt))
    assert retry_delay(world.settings.service, 2) == 2 * retry_delay(world.settings.service, 1)
    assert world.actions.calls == [("load", "m", ()), ("load", "m", ())]


async def test_a_load_that_needs_room_evicts_the_idle_model_before_it_starts(tmp_path: Path) -> None:
    world = World(tmp_path, {"a": {}, "b": {}})
    world.loaded("a")
    world.request("b")
    world.placer._plan_once()
    assert world.actions.spawned == ["Placer._load_on_demand"] and world.actions.calls == []
    # While a drains, b's waiters wait for room, and a wait that runs out says why.
    stall = world.models["b"].admission.stall
    assert stall is not None and stall.code == "insufficient_memory" and "a is being unloaded" in stall.message
    await world.actions.run_spawned()
    assert world.actions.calls == [("unload", "a", "evicted", "b"), ("load", "b", ("a",))]
    assert [(e.kind, e.model, e.cause) for e in world.placer.events.since(0)] == [(ev.EVICT, "a", "b")]
    assert world.models["a"].state == ModelState.UNLOADED and world.models["b"].state == ModelState.LOADED
    assert world.models["b"].admission.stall is None   # it loads: a wait that runs out is queue_timeout again


async def test_an_eviction_that_fails_refuses_the_load_with_insufficient_memory(tmp_path: Path) -> None:
    world = World(tmp_path, {"a": {}, "b": {}})
    world.loaded("a")
    world.actions.unload_fails["a"] = Unavailable("model 'a' could not be unloaded: supervisord is gone",
                                                  code="unload_failed", retry_after=5)
    # An admin's (or startup's) load makes room through make_room itself: it is refused.
    with pytest.raises(Unavailable) as caught:
        await world.placer.make_room(world.models["b"], ("a",))
    assert caught.value.code == "insufficient_memory"
    assert "could not make room: a: model 'a' could not be unloaded" in caught.value.message
    assert world.actions.calls == [("unload", "a", "evicted", "b")]
    # On demand: nothing is started, and the waiters learn why.
    waiter = world.request("b")
    world.placer._plan_once()
    await world.actions.run_spawned()
    assert world.actions.calls == [("unload", "a", "evicted", "b")] * 2
    assert isinstance(waiter.exception(), BackendError) and "could not make room" in waiter.exception().message
    assert world.models["b"].backoff is not None and world.models["b"].admission.stall is None


async def test_a_busy_model_is_swapped_out_only_once_the_cold_models_load_has_waited_the_swap_bound(
        tmp_path: Path) -> None:
    world = World(tmp_path, {"a": {}, "b": {}}, swap_max_wait_s=10)
    a = world.loaded("a")
    a.admission.set_capacity(1)
    await a.admission.acquire("k")            # a request runs on a: it is busy
    world.request("b")
    assert world.placer._plan_once() == 10.0  # b waits; planned again at the bound
    assert world.actions.spawned == [] and world.placer.waiting["b"].device == CPU
    stall = world.models["b"].admission.stall
    assert stall is not None and stall.code == "insufficient_memory"
    world.clock.advance(9)
    assert world.placer._plan_once() == pytest.approx(1.0)
    assert world.actions.spawned == []
    world.clock.advance(1)
    world.placer._plan_once()
    await world.actions.run_spawned()
    assert world.actions.calls == [("unload", "a", "evicted", "b"), ("load", "b", ("a",))]


async def test_an_idle_model_is_unloaded_idle_unload_s_after_its_last_use(tmp_path: Path) -> None:
    world = World(tmp_path, {"a": {"idle_unload_s": 60}})
    world.loaded("a", idle_s=0)
    assert world.placer._plan_once() == 60.0   # planned again when it would be idle long enough
    world.clock.advance(59)
    assert world.placer._plan_once() == pytest.approx(1.0)
    assert world.actions.spawned == []
    world.clock.advance(1)
    world.placer._plan_once()
    assert world.actions.spawned == ["Placer._unload"]
    await world.actions.run_spawned()
    assert world.actions.calls == [("unload", "a", "idle", "60s")]


async def test_a_model_with_a_request_running_is_not_idle(tmp_path: Path) -> None:
    world = World(tmp_path, {"a": {"idle_unload_s": 60}})
    a = world.loaded("a", idle_s=3600)
    a.admission.set_capacity(1)
    await a.admission.acquire("k")
    assert world.placer._plan_once() is None
    assert world.actions.spawned == []


async def test_the_count_cap_evicts_an_idle_model_and_waits_for_a_busy_one(tmp_path: Path) -> None:
    # Small enough that only the count limits them.
    world = World(tmp_path, {"a": {}, "b": {}, "c": {}}, mib=1, max_loaded_models=1, swap_max_wait_s=10)
    world.loaded("a")
    world.request("b")
    world.placer._plan_once()
    await world.actions.run_spawned()
    assert world.actions.calls == [("unload", "a", "evicted", "b"), ("load", "b", ("a",))]
    # b is busy now: c waits for the count, not for memory.
    b = world.models["b"]
    b.loaded_at = world.clock.monotonic() - 3600
    b.admission.set_capacity(1)               # the request queued for it runs: b is busy
    assert b.admission.active == 1
    world.request("c")
    world.placer._plan_once()
    assert world.actions.spawned == ["Placer._load_on_demand"]   # the first load only
    assert world.placer.waiting["c"].device == COUNT
    stall = world.models["c"].admission.stall
    assert stall is not None and "max_loaded_models is 1" in stall.message


async def swap(world: World, name: str, evict: tuple[str, ...]) -> None:
    """`name` loaded as the pool loads it once placement chose `evict` for it (Pool._load_locked),
    and used."""
    runtime = world.models[name]
    world.placer.reserve(name, runtime.config)
    await world.placer.make_room(runtime, evict)
    runtime.move(ModelState.LOADING)
    runtime.move(ModelState.LOADED)
    runtime.loaded_at = world.clock.monotonic()
    runtime.admission.last_used = world.clock.time()
    world.placer.settled(name)


async def test_models_that_take_each_others_room_in_turn_are_one_thrash_event_and_each_swap_is_counted(
        tmp_path: Path) -> None:
    world = World(tmp_path, {"a": {}, "b": {}, "c": {}}, mib=40)     # room for two of the three
    world.loaded("a", idle_s=2)
    world.loaded("b", idle_s=1)
    await swap(world, "c", ("a",))      # c's first load: a swap, and nothing came back
    world.clock.advance(8)
    await swap(world, "a", ("b",))      # a is back 8 s after its eviction: the three are in use
    world.clock.advance(8)
    await swap(world, "b", ("c",))      # and b: the same models, counted and not said again
    feed = world.placer.events.since(0)
    assert [(e.kind, e.model, e.cause) for e in feed] == [
        (ev.EVICT, "a", "c"), (ev.THRASH, "a", "b"), (ev.EVICT, "b", "a"), (ev.EVICT, "c", "b")]
    assert feed[1].message == (
        "model a is loaded again 8.0s after its eviction (thrash_window_s 60), evicting b: the models in use "
        "(a, b, c) need 120.0 MiB together on cpu, more than its budget of 100.0 MiB (a budget of 120.0 MiB "
        "would hold them); each swap is a reload")
    thrash = world.placer.describe()["thrash"]
    assert thrash["window_s"] == 60 and thrash["counts"] == {"a": 1, "b": 1}
    recent = thrash["recent"]
    assert (recent["model"], recent["models"], recent["needed_mib"], recent["budget_mib"]) == \
        ("b", ["a", "b", "c"], 120.0, 100.0)
    world.clock.advance(61)
    assert world.placer.describe()["thrash"]["recent"] is None   # the page's warning ends with its window


async def test_loaded_models_over_a_smaller_budget_are_said_once_by_how_much(tmp_path: Path) -> None:
    world = World(tmp_path, {"a": {}, "b": {}}, mib=40)
    world.loaded("a")
    world.loaded("b")
    world.placer._plan_once()
    # As after a reload to a smaller budget that adopted both: they hold 80 MiB of its 60.
    world.placer.memory.lifecycle = replace(world.placer.memory.lifecycle, cpu_budget_mib=60)
    world.placer._plan_once()
    world.placer._plan_once()
    assert [(e.kind, e.message) for e in world.placer.events.since(0)] == [
        (ev.OVER_BUDGET, "device cpu holds 80.0 MiB of loaded models (a, b), 20.0 MiB more than its budget of "
                         "60.0 MiB: the next load there first evicts until it fits")]
