"""Unload always finishes: crashes, restarts and supervisord faults during an unload end in
UNLOADED with the processes stopped, or FAILED with the reason, and a second unload then works.
Against a scripted fake supervisord; tests/integration/test_lifecycle.py does it for real."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fakes import ScriptedSupervisor
from launchers import sim
from launchers.spec import program_name
from proxy.config.loading import load_settings
from proxy.errors import Unavailable
from proxy.lifecycle.pool import Pool
from proxy.upstream.reach import ProgramReach
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState
from proxy.supervisord.supervisor import BadName, ProcessState, StillRunning, SupervisorUnavailable

RUNNING, STARTING, BACKOFF = ProcessState.RUNNING, ProcessState.STARTING, ProcessState.BACKOFF
STOPPED, EXITED = ProcessState.STOPPED, ProcessState.EXITED
P0, P1 = (program_name("m", i) for i in range(2))   # each replica is a supervisord group of its own
R0, R1 = f"{P0}:{P0}", f"{P1}:{P1}"


@pytest.fixture
def world(tmp_path: Path) -> Any:
    (tmp_path / "pool.yaml").write_text(f"service: {{state_dir: {tmp_path}}}\n"
                                        "supervisor: {stopwaitsecs: 1}\n"
                                        "engine: {models: {m: {backend: sim, replicas: 2, replica_max: 2}}}\n")
    settings = load_settings(tmp_path / "pool.yaml")
    fake = ScriptedSupervisor()
    pool = Pool(settings, fake, http=None, environ={})  # type: ignore[arg-type]
    runtime = pool.models["m"]
    runtime.state = ModelState.LOADED
    runtime.active = runtime.config
    settings.supervisor.programs_dir.mkdir(parents=True)
    for i in range(2):
        pool.programs.replica_file("m", i).write_text("; the replica's program file\n")
    for i, fullname in enumerate((R0, R1)):
        spec = sim.launch(settings.models["m"], i, 18000 + i, 1, {})
        replica = Replica(model="m", index=i, spec=spec, reach=ProgramReach(spec),
                          fullname=fullname, pid=100 + i)
        runtime.replicas.append(replica)
        runtime.set_replica_state(replica, ReplicaState.STARTING)
        runtime.set_replica_state(replica, ReplicaState.READY)
        fake.set(fullname, RUNNING, 100 + i)
    return pool, runtime, fake


def assert_unloaded(pool: Pool, fake: ScriptedSupervisor) -> None:
    runtime = pool.models["m"]
    assert runtime.state == ModelState.UNLOADED and runtime.replicas == []
    assert fake.processes == {} and {P0, P1} <= set(fake.removed)
    assert pool.programs.replica_files("m") == {}


async def test_a_replica_that_crashed_and_restarts_during_the_unload_is_stopped_too(world: Any) -> None:
    pool, _, fake = world
    fake.set(R0, EXITED, 0)                            # crashed mid-stream just before the unload...
    # ...and autorestart brings it back before its group is removed (the replicas stop together,
    # each its own group: the first look the pool takes is already the restarted process).
    fake.script = [lambda f: f.set(R0, RUNNING, 200)]
    await pool.unload("m", drain=False)
    assert_unloaded(pool, fake)


async def test_processes_in_backoff_or_starting_are_stopped(world: Any) -> None:
    pool, _, fake = world
    fake.set(R0, BACKOFF, 0)
    fake.set(R1, STARTING, 300)
    await pool.unload("m", drain=False)
    assert_unloaded(pool, fake)
    assert ("stop", R0) in fake.calls and ("stop", R1) in fake.calls


async def test_a_group_removed_behind_the_pools_back_still_unloads(world: Any) -> None:
    pool, _, fake = world
    def vanish(f: ScriptedSupervisor) -> None:
        f.processes.clear()
    fake.faults["stop_process"] = [BadName(10, "BAD_NAME: gone")]
    fake.script = [lambda f: None, vanish]
    await pool.unload("m", drain=False)
    runtime = pool.models["m"]
    assert runtime.state == ModelState.UNLOADED and runtime.replicas == []


async def test_supervisord_gone_mid_unload_fails_the_model_with_the_reason_then_a_second_unload_works(
        world: Any) -> None:
    pool, runtime, fake = world
    fake.faults["stop_process"] = [SupervisorUnavailable("supervisord at unix:///x did not answer stopProcess")]
    with pytest.raises(Unavailable) as info:
        await pool.unload("m", drain=False)
    assert info.value.status == 503 and info.value.retry_after
    assert runtime.state == ModelState.FAILED
    assert "did not answer stopProcess" in runtime.last_error
    # Nothing was left half-done that only a restart could clear: the same call now finishes.
    await pool.unload("m", drain=False)
    assert_unloaded(pool, fake)


async def test_a_process_that_will_not_stop_fails_the_unload_instead_of_wedging_it(world: Any) -> None:
    pool, runtime, fake = world
    pool.programs.stop_grace_s = 0.0                            # give up right after stopwaitsecs (1 s here)
    fake.stuck.add(R1)
    with pytest.raises(Unavailable):
        await pool.unload("m", drain=False)
    assert runtime.state == ModelState.FAILED
    assert R1 in runtime.last_error and "did not stop" in runtime.last_error
    assert [r.state for r in runtime.replicas] == [ReplicaState.STOPPING] * 2   # shown until they are gone
    fake.stuck.clear()
    fake.set(R1, STOPPED, 0)                           # supervisord's SIGKILL got it in the end
    await pool.unload("m", drain=False)
    assert_unloaded(pool, fake)


async def test_a_restart_between_the_last_look_and_the_removal_is_one_more_pass(world: Any) -> None:
    pool, _, fake = world
    fake.faults["remove_process_group"] = [StillRunning(91, "STILL_RUNNING: " + P0)]
    await pool.unload("m", drain=False)
    assert_unloaded(pool, fake)
    assert fake.calls.count(("remove", P0)) + fake.calls.count(("remove", P1)) == 3
