"""Scaling down drains the leaving replicas and stops only them; bad counts and unloaded models are
refused; a failed stop leaves the replica shown stopping with the reason and a second scale retries. Against a
scripted fake supervisord; tests/integration/test_scaling.py does it all for real, scaling up too."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from fakes import ScriptedSupervisor
from launchers import sim
from launchers.spec import program_name
from proxy.config.loading import load_settings
from proxy.errors import BadRequest, Conflict, Unavailable
from proxy.lifecycle.pool import Pool
from proxy.upstream.reach import ProgramReach
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState
from proxy.supervisord.supervisor import ProcessState, SupervisorUnavailable

P = [program_name("m", i) for i in range(3)]
R = [f"{p}:{p}" for p in P]


@pytest.fixture
def world(tmp_path: Path) -> Any:
    (tmp_path / "pool.yaml").write_text(f"service: {{state_dir: {tmp_path}, drain_timeout_s: 30}}\n"
                                        "supervisor: {stopwaitsecs: 1}\n"
                                        "engine: {models: {m: {backend: sim, replicas: 1, replica_max: 3,"
                                        " target_inflight: 2}}}\n")
    settings = load_settings(tmp_path / "pool.yaml")
    fake = ScriptedSupervisor()
    pool = Pool(settings, fake, http=None, environ={})  # type: ignore[arg-type]
    runtime = pool.models["m"]
    runtime.state = ModelState.LOADED
    runtime.active = runtime.with_replicas(3)
    settings.supervisor.programs_dir.mkdir(parents=True)
    for i in range(3):
        pool.programs.replica_file("m", i).write_text("; the replica's program file\n")
        spec = sim.launch(runtime.active, i, 18000 + i, 1, {})
        replica = Replica(model="m", index=i, spec=spec, reach=ProgramReach(spec),
                          fullname=R[i], pid=100 + i)
        runtime.replicas.append(replica)
        runtime.set_replica_state(replica, ReplicaState.STARTING)
        runtime.set_replica_state(replica, ReplicaState.READY)
        fake.set(R[i], ProcessState.RUNNING, 100 + i)
    return pool, runtime, fake


async def test_scaling_down_drains_the_leaving_replicas_then_stops_only_them(world: Any) -> None:
    pool, runtime, fake = world
    busy = runtime.replicas[2]
    busy.inflight = 1                                   # a request still streaming from replica 2
    scaling = asyncio.create_task(pool.scale("m", 1))
    await asyncio.sleep(0.2)
    assert not scaling.done()
    # Out of rotation at once: no new request goes there, capacity is replica 0's alone.
    assert [r.state for r in runtime.replicas] == [ReplicaState.READY, ReplicaState.STOPPING, ReplicaState.STOPPING]
    assert runtime.pick_replica() is runtime.replicas[0] and runtime.admission.capacity == 2
    assert ("stop", R[2]) not in fake.calls
    runtime.release(busy)                               # it ends: now the replica may stop
    await asyncio.wait_for(scaling, 10)
    assert [r.index for r in runtime.replicas] == [0] and runtime.replicas[0].pid == 100
    assert ("stop", R[0]) not in fake.calls and {P[1], P[2]} <= set(fake.removed)
    assert sorted(pool.programs.replica_files("m")) == [0]
    assert runtime.active.replicas == 1 and "replicas" not in runtime.active.options   # the configured count
    assert runtime.describe()["replica_count"] == 1


async def test_bad_counts_and_unloaded_models_are_refused(world: Any) -> None:
    pool, runtime, _ = world
    for bad in (0, 4, True, "2"):
        with pytest.raises(BadRequest) as info:
            await pool.scale("m", bad)
        assert info.value.code == "invalid_scale_request"
    runtime.state = ModelState.UNLOADED
    with pytest.raises(Conflict) as conflict:
        await pool.scale("m", 2)
    assert conflict.value.code == "model_not_loaded"


async def test_a_failed_stop_shows_the_reason_and_a_second_scale_retries(world: Any) -> None:
    pool, runtime, fake = world
    fake.faults["stop_process"] = [SupervisorUnavailable("supervisord at unix:///x did not answer stopProcess")]
    with pytest.raises(Unavailable) as info:
        await pool.scale("m", 2)
    assert info.value.code == "scale_failed" and info.value.status == 503
    assert runtime.replicas[2].state == ReplicaState.STOPPING and "did not answer" in runtime.replicas[2].last_error
    assert runtime.active.replicas == 3 and pool.programs.replica_file("m", 2).exists()
    await pool.scale("m", 2)
    assert len(runtime.replicas) == 2 and not pool.programs.replica_file("m", 2).exists()
    assert runtime.active.options["replicas"] == 2


async def test_a_remote_model_scales_its_endpoint_slots(tmp_path: Path) -> None:
    (tmp_path / "pool.yaml").write_text(f"service: {{state_dir: {tmp_path}}}\n"
                                        "engine: {models: {r: {backend: openai_remote, remote_base_url: 'https://x/v1',"
                                        " remote_model: m, replicas: 1, replica_max: 4, target_inflight: 3}}}\n")
    pool = Pool(load_settings(tmp_path / "pool.yaml"), ScriptedSupervisor(), http=None, environ={})  # type: ignore[arg-type]
    runtime = await pool.load("r")
    assert runtime.admission.capacity == 3
    await pool.scale("r", 4)
    assert [r.state for r in runtime.replicas] == [ReplicaState.READY] * 4 and runtime.admission.capacity == 12
    await pool.scale("r", 2)
    assert len(runtime.replicas) == 2 and runtime.admission.capacity == 6 and runtime.active.replicas == 2


async def test_an_ejected_remote_slot_comes_back_once_its_ejection_is_over(tmp_path: Path) -> None:
    (tmp_path / "pool.yaml").write_text(f"service: {{state_dir: {tmp_path}}}\n"
                                        "supervisor: {poll_interval_s: 0.05}\n"
                                        "engine: {models: {r: {backend: openai_remote, remote_base_url: 'https://x/v1',"
                                        " remote_model: m, replicas: 2, replica_max: 2, target_inflight: 1}}}\n")
    pool = Pool(load_settings(tmp_path / "pool.yaml"), ScriptedSupervisor(), http=None, environ={})  # type: ignore[arg-type]
    runtime = await pool.load("r")
    slot = runtime.replicas[1]
    for _ in range(pool.monitor.health.eject_after):
        pool.monitor.report_outcome(slot, "HTTP 500 from the provider")
    assert slot.state == ReplicaState.UNHEALTHY and runtime.admission.capacity == 1
    slot.eject_until = 0.0   # its back-off is over (rather than waiting eject_base_s)
    await pool.start()
    try:
        async def back() -> None:
            while slot.state != ReplicaState.READY:
                await runtime.wait_changed(1.0)
        await asyncio.wait_for(back(), 30)
    finally:
        await pool.close(stop_models=False)
    assert runtime.admission.capacity == 2


async def test_scaling_down_stops_out_of_date_replicas_first(world: Any) -> None:
    pool, runtime, fake = world
    runtime.replicas[0].outdated = "settings changed: sim.ttft_ms"   # adopted mid-roll (proxy/lifecycle/rolling.py)
    await asyncio.wait_for(pool.scale("m", 2), 10)
    assert [r.index for r in runtime.replicas] == [1, 2] and set(fake.removed) == {P[0]}
