"""Evicted into sleep, and woken (vllm_sleep_on_evict, proxy/lifecycle/sleeping.py): against a fake
vLLM at the HTTP boundary (sleep mode needs CUDA; tests/gpu/vllm_sleep.sh runs the real one), a
scripted fake supervisord and a fake GPU. The pool, its placer and its monitor are the real ones."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import pytest

from fakes import FakeNvml, FakeSleepyVllm, ScriptedSupervisor
from launchers import vllm_serve
from proxy import events as ev
from proxy.config.loading import load_settings
from proxy.gpu.footprint import gpu_totals
from proxy.lifecycle import sleeping
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState
from proxy.supervisord.supervisor import ProcessState
from proxy.upstream.client import UpstreamHttp
from proxy.upstream.reach import ProgramReach

MIB = 1024 * 1024
GIB = 1024 * MIB
WEIGHTS = 3 * MIB


def settings_text(tmp_path: Path, port: int, cpu_budget_mib: float) -> str:
    weights = tmp_path / "weights"
    weights.mkdir(exist_ok=True)
    (weights / "config.json").write_text("{}")
    (weights / "model.safetensors").write_bytes(bytes(WEIGHTS))
    return (f"service: {{state_dir: {tmp_path}}}\n"
            "supervisor: {stopwaitsecs: 1, poll_interval_s: 0.05}\n"
            "engine:\n"
            f"  lifecycle: {{memory: {{cpu_budget_mib: {cpu_budget_mib}, gpu_headroom_mib: 0}}}}\n"
            "  models:\n"
            f"    v: {{backend: vllm_serve, vllm_model: {weights}, vllm_sleep_on_evict: true, "
            f"vllm_serve_binary: {sys.executable}, "
            f"vllm_serve_port: {port}, vllm_kv_cache_memory_bytes: {64 * MIB}, load_on_demand: true}}\n")


class World:
    def __init__(self, pool: Pool, vllm: FakeSleepyVllm, supervisor: ScriptedSupervisor) -> None:
        self.pool, self.vllm, self.supervisor = pool, vllm, supervisor
        self.runtime = pool.models["v"]

    def load(self) -> Replica:
        """Model v as a load leaves it: LOADED, one READY replica whose process runs (pid 100)."""
        runtime, pool = self.runtime, self.pool
        pool.placer.reserve("v", runtime.config)
        runtime.state = ModelState.LOADED
        runtime.active = runtime.config
        pool.placer.settled("v")
        spec = vllm_serve.launch(runtime.config, 0, self.vllm.port, 1, {})
        pool.settings.supervisor.programs_dir.mkdir(parents=True, exist_ok=True)
        pool.programs.replica_file("v", 0).write_text("; the replica's program file\n")
        fullname = f"{spec.program}:{spec.program}"
        replica = Replica(model="v", index=0, spec=spec, reach=ProgramReach(spec), fullname=fullname, pid=100,
                          alive=True)
        runtime.replicas = [replica]
        runtime.set_replica_state(replica, ReplicaState.STARTING)
        runtime.set_replica_state(replica, ReplicaState.READY)
        self.supervisor.set(fullname, ProcessState.RUNNING, 100)
        return replica

    def device(self, name: str) -> dict[str, Any]:
        return next(d for d in self.pool.memory_report()["devices"] if d["device"] == name)

    def stops(self) -> list[tuple[str, str]]:
        return [c for c in self.supervisor.calls if c[0] == "stop"]


async def make_world(tmp_path: Path, cpu_budget_mib: float = 64) -> AsyncIterator[World]:
    vllm = await FakeSleepyVllm("v").start()
    (tmp_path / "pool.yaml").write_text(settings_text(tmp_path, vllm.port, cpu_budget_mib))
    nvml = FakeNvml([{"used": 0, "total": 8 * GIB, "processes": []}])
    supervisor = ScriptedSupervisor()
    async with UpstreamHttp(aiohttp.ClientSession()) as http:
        pool = Pool(load_settings(tmp_path / "pool.yaml"), supervisor, http, environ={}, nvml_loader=lambda: nvml)
        pool.memory.gpus = gpu_totals(lambda: nvml)
        pool.monitor.start()
        try:
            yield World(pool, vllm, supervisor)
        finally:
            await pool.tasks.cancel_all()
            await pool.monitor.close()
            await vllm.stop()


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async for w in make_world(tmp_path):
        yield w


@pytest.fixture
async def small_cpu(tmp_path: Path) -> AsyncIterator[World]:
    """A CPU budget of 2 MiB: the 3 MiB of weights do not fit there asleep."""
    async for w in make_world(tmp_path, cpu_budget_mib=2):
        yield w


async def test_an_eviction_puts_the_model_to_sleep_instead_of_stopping_it(world: World) -> None:
    replica = world.load()
    await world.pool.unload_by_pool("v", "evicted", "other")
    runtime = world.runtime
    assert runtime.state == ModelState.ASLEEP and replica.state == ReplicaState.ASLEEP
    assert ("POST", "/sleep?level=1") in world.vllm.calls
    assert world.stops() == [] and world.supervisor.processes   # its process runs on
    assert runtime.replicas == [replica] and runtime.admission.capacity == 0   # nothing is routed to it
    row = world.pool.describe(runtime)
    assert row["state"] == "asleep" and row["sleeps"] == 1 and row["replicas"][0]["state"] == "asleep"
    assert [e.kind for e in world.pool.events.since()][-1] == ev.SLEEP


async def test_asleep_its_weights_are_charged_to_the_cpu_budget_and_its_gpu_charge_is_released(
        world: World) -> None:
    world.load()
    assert world.device("gpu0")["used_bytes"] > 64 * MIB and world.device("cpu")["used_bytes"] == 0
    await world.pool.unload_by_pool("v", "evicted", "other")
    assert world.device("gpu0")["used_bytes"] == 0
    assert world.device("cpu")["used_bytes"] == WEIGHTS and world.device("cpu")["models"] == ["v"]
    view = next(v for v in world.pool.placer.views() if v.name == "v")
    assert view.status == "asleep" and not view.counted   # not a loaded model for max_loaded_models


async def test_a_request_wakes_it_through_the_on_demand_load(world: World) -> None:
    replica = world.load()
    await world.pool.unload_by_pool("v", "evicted", "other")
    await world.pool.load_placed("v", ())   # what placement runs for a request that waits for it
    runtime = world.runtime
    assert runtime.state == ModelState.LOADED and replica.state == ReplicaState.READY
    assert runtime.replicas == [replica] and replica.pid == 100   # the same process: no reload
    assert ("POST", "/wake_up") in world.vllm.calls and world.stops() == []
    assert runtime.wakes == 1 and runtime.admission.capacity == runtime.target_inflight
    assert world.device("cpu")["used_bytes"] == 0 and world.device("gpu0")["used_bytes"] > 64 * MIB
    assert [e.kind for e in world.pool.events.since()][-1] == ev.WAKE


async def test_a_request_for_an_asleep_model_is_a_load_placement_plans(world: World) -> None:
    world.load()
    await world.pool.unload_by_pool("v", "evicted", "other")
    world.runtime.admission.accept()
    world.pool.demand(world.runtime)
    view = next(v for v in world.pool.placer.views() if v.name == "v")
    assert view.status == "asleep" and view.wake_needs and "gpu0" in view.wake_needs


async def test_an_admin_load_wakes_it_too(world: World) -> None:
    world.load()
    await world.pool.unload_by_pool("v", "evicted", "other")
    await world.pool.load("v")
    assert world.runtime.state == ModelState.LOADED and world.runtime.wakes == 1 and world.stops() == []


async def test_a_sleep_that_fails_is_an_ordinary_stop(world: World) -> None:
    world.load()
    world.vllm.sleep_status = 500
    await world.pool.unload_by_pool("v", "evicted", "other")
    runtime = world.runtime
    assert runtime.state == ModelState.UNLOADED and runtime.replicas == []
    assert world.stops() and world.supervisor.processes == {}
    assert runtime.unloads == {"evicted": 1} and runtime.sleeps == 0
    kinds = [(e.kind, e.reason) for e in world.pool.events.since()]
    assert (ev.SLEEP, "failed") in kinds and kinds[-1] == (ev.UNLOAD, "evicted")


async def test_a_replica_that_answers_but_does_not_sleep_is_stopped(world: World) -> None:
    world.load()
    world.vllm.says_asleep = False
    await world.pool.unload_by_pool("v", "evicted", "other")
    assert world.runtime.state == ModelState.UNLOADED and world.stops()


async def test_no_room_in_host_ram_for_its_weights_stops_it(small_cpu: World) -> None:
    small_cpu.load()
    await small_cpu.pool.unload_by_pool("v", "evicted", "other")
    assert small_cpu.runtime.state == ModelState.UNLOADED
    assert not any(c[1].startswith("/sleep") for c in small_cpu.vllm.calls)


async def test_a_wake_that_fails_falls_back_to_a_start_from_scratch(world: World) -> None:
    world.load()
    await world.pool.unload_by_pool("v", "evicted", "other")
    world.vllm.wake_status = 500
    await world.pool.load_placed("v", ())
    runtime = world.runtime
    # Its process was stopped and a new one started (the fake serves on the same port): serving.
    assert runtime.state == ModelState.LOADED and runtime.ready()
    assert world.stops() and any(c[0] == "start" for c in world.supervisor.calls)
    assert runtime.ready()[0].pid != 100 and runtime.wakes == 0
    kinds = [(e.kind, e.reason) for e in world.pool.events.since()]
    assert (ev.WAKE, "failed") in kinds and kinds[-1] == (ev.LOAD, "on_demand")


async def test_an_admin_unload_of_an_asleep_model_stops_it(world: World) -> None:
    world.load()
    await world.pool.unload_by_pool("v", "evicted", "other")
    await world.pool.unload("v")
    runtime = world.runtime
    assert runtime.state == ModelState.UNLOADED and runtime.replicas == [] and world.stops()
    assert world.device("cpu")["used_bytes"] == 0
    assert not any(c[1] == "/wake_up" for c in world.vllm.calls)


async def test_an_asleep_model_evicted_again_is_stopped_for_real(world: World) -> None:
    world.load()
    await world.pool.unload_by_pool("v", "evicted", "other")
    await world.pool.unload_by_pool("v", "evicted", "a model that needs host RAM")
    assert world.runtime.state == ModelState.UNLOADED and world.stops()
    assert [c for c in world.vllm.calls if c[1].startswith("/sleep")] == [("POST", "/sleep?level=1")]


async def test_an_idle_unload_stops_it_and_never_sleeps(world: World) -> None:
    world.load()
    await world.pool.unload_by_pool("v", "idle", "60s")
    assert world.runtime.state == ModelState.UNLOADED and world.vllm.calls == []


async def test_a_replica_adopted_asleep_is_woken_and_an_awake_one_left_alone(world: World) -> None:
    world.load()
    await sleeping.wake_adopted(world.runtime, world.pool.http, world.pool.events)
    assert ("POST", "/wake_up") not in world.vllm.calls   # it said it was awake
    world.vllm.asleep = True   # an earlier proxy put it to sleep; this one adopted it as running
    await sleeping.wake_adopted(world.runtime, world.pool.http, world.pool.events)
    assert ("POST", "/wake_up") in world.vllm.calls and not world.vllm.asleep
