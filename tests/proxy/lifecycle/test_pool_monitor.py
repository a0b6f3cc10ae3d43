"""How the monitor reads supervisord's process table into replica states, against a fake driver."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fakes import FakeManagedSupervisord, FakeSupervisor
from launchers import sim
from proxy.config.loading import load_settings
from proxy.lifecycle.pool import Pool
from proxy.upstream.reach import ProgramReach
from proxy.lifecycle.state.replicas import InvalidTransition, ModelState, Replica, ReplicaState
from proxy.lifecycle.watch.monitor import DOWN_LOG_INTERVAL_S
from proxy.supervisord.supervisor import ProcessState, SupervisorUnavailable

RUNNING, STARTING, BACKOFF = ProcessState.RUNNING, ProcessState.STARTING, ProcessState.BACKOFF
STOPPED, FATAL, EXITED = ProcessState.STOPPED, ProcessState.FATAL, ProcessState.EXITED


@pytest.fixture
def world(tmp_path: Path) -> Any:
    (tmp_path / "pool.yaml").write_text(f"service: {{state_dir: {tmp_path}}}\n"
                                        "engine: {models: {m: {backend: sim, target_inflight: 2}}}\n")
    settings = load_settings(tmp_path / "pool.yaml")
    fake = FakeSupervisor()
    pool = Pool(settings, fake, http=None, environ={})  # type: ignore[arg-type]
    runtime = pool.models["m"]
    runtime.state = ModelState.LOADED
    spec = sim.launch(settings.models["m"], 0, 18000, 5, {})
    replica = Replica(model="m", index=0, spec=spec, fullname="g:r0", pid=100, alive=True,
                      reach=ProgramReach(spec))
    runtime.replicas = [replica]
    runtime.set_replica_state(replica, ReplicaState.STARTING)
    runtime.set_replica_state(replica, ReplicaState.READY)
    return pool, runtime, replica, fake


async def observe(world: Any, state: ProcessState, pid: int) -> ReplicaState:
    pool, runtime, replica, fake = world
    await pool.monitor.observe(runtime, replica, fake.set("g:r0", state, pid))
    return replica.state


async def test_a_crash_takes_the_replica_out_until_it_is_healthy_again(world: Any) -> None:
    _, runtime, replica, _ = world
    assert runtime.admission.capacity == 2
    assert await observe(world, BACKOFF, 0) == ReplicaState.STARTING
    assert runtime.admission.capacity == 0
    await observe(world, STARTING, 101)
    assert replica.restarts == 1 and replica.pid == 101


async def test_a_restart_between_two_polls_is_seen_by_its_new_pid(world: Any) -> None:
    _, _, replica, _ = world
    assert await observe(world, RUNNING, 102) == ReplicaState.STARTING
    assert replica.restarts == 1


async def test_an_admin_stop_is_respected_and_an_admin_start_rejoins(world: Any) -> None:
    _, _, _, fake = world
    assert await observe(world, STOPPED, 0) == ReplicaState.STOPPED
    assert await observe(world, STOPPED, 0) == ReplicaState.STOPPED
    assert fake.calls == []  # the pool never restarts what an admin stopped
    assert await observe(world, STARTING, 103) == ReplicaState.STARTING


async def test_an_admin_stop_is_a_stopped_event_when_it_happens_and_the_start_a_started_event_not_a_crash(
        world: Any) -> None:
    pool, _, replica, _ = world
    assert await observe(world, ProcessState.STOPPING, 100) == ReplicaState.STOPPED   # supervisord was asked
    assert [(e.kind, e.model, e.replica) for e in pool.events.since(0)] == [("stopped", "m", 0)]
    assert await observe(world, STOPPED, 0) == ReplicaState.STOPPED
    assert await observe(world, STARTING, 103) == ReplicaState.STARTING
    feed = pool.events.since(0)
    assert [(e.kind, e.model, e.replica) for e in feed] == [("stopped", "m", 0), ("started", "m", 0)]
    assert "(pid 100) was stopped in supervisord, not by the pool" in feed[0].message
    assert "was started in supervisord (pid 103)" in feed[1].message
    # A start, not a restart: nothing counts against the replica.
    assert (replica.pid, replica.restarts, replica.failures) == (103, 0, 0)


async def test_a_restart_in_supervisord_between_two_looks_is_a_stop_and_a_start_by_its_log_not_a_crash(
        world: Any) -> None:
    pool, runtime, replica, fake = world
    program = replica.spec.program
    # supervisorctl restart: supervisord's log says it was asked to stop it; its table shows only the new pid.
    fake.main_log = (f"2026-12-03 10:00:00,001 INFO stopped: {program} (terminated by SIGTERM)\n"
                     f"2026-12-03 10:00:00,101 INFO spawned: '{program}' with pid 105\n")
    assert await observe(world, RUNNING, 105) == ReplicaState.STARTING
    assert [(e.kind, e.replica) for e in pool.events.since(0)] == [("stopped", 0), ("started", 0)]
    assert (replica.pid, replica.restarts, replica.failures) == (105, 0, 0)
    # An exit after it is a crash again.
    runtime.set_replica_state(replica, ReplicaState.READY)
    fake.main_log += f"2026-12-03 10:01:00,001 WARN exited: {program} (terminated by SIGKILL; not expected)\n"
    assert await observe(world, RUNNING, 106) == ReplicaState.STARTING
    assert [e.kind for e in pool.events.since(0)] == ["stopped", "started", "crash"]
    assert replica.restarts == 1


async def test_an_admin_start_after_supervisord_gave_up_is_a_started_event(world: Any) -> None:
    pool, _, _, _ = world
    assert await observe(world, FATAL, 0) == ReplicaState.FAILED
    assert await observe(world, STARTING, 104) == ReplicaState.STARTING
    assert [e.kind for e in pool.events.since(0)] == ["crash", "started"]


async def test_supervisord_giving_up_fails_the_replica_with_its_log(world: Any) -> None:
    _, _, replica, _ = world
    assert await observe(world, FATAL, 0) == ReplicaState.FAILED
    assert "model file is corrupt" in replica.last_error


async def test_an_exit_during_load_fails_the_replica_and_stops_its_retries(world: Any) -> None:
    _, runtime, replica, fake = world
    runtime.state = ModelState.LOADING
    runtime.set_replica_state(replica, ReplicaState.STARTING)
    assert await observe(world, EXITED, 0) == ReplicaState.FAILED
    assert fake.calls == [("stop", "g:r0")]
    assert "log tail" in replica.last_error


async def test_a_program_removed_behind_the_pools_back_is_stopped(world: Any) -> None:
    pool, runtime, replica, _ = world
    await pool.monitor.observe(runtime, replica, None)
    assert replica.state == ReplicaState.STOPPED


async def test_a_refused_connection_stops_routing_at_once(world: Any) -> None:
    pool, runtime, replica, _ = world
    pool.monitor.report_connection_failure(replica, "ClientConnectorError")
    assert replica.state == ReplicaState.STARTING and runtime.pick_replica() is None
    assert replica.last_error == "ClientConnectorError"


async def test_the_lifecycle_refuses_transitions_it_does_not_allow(world: Any) -> None:
    _, runtime, replica, _ = world
    runtime.set_replica_state(replica, ReplicaState.STOPPING)
    with pytest.raises(InvalidTransition, match="stopping -> ready"):
        runtime.set_replica_state(replica, ReplicaState.READY)


async def test_a_ready_replica_that_fails_its_health_check_leaves_rotation_until_it_passes(
        world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pool, runtime, replica, _ = world
    healthy = {"now": False}

    async def probe(*_: Any) -> tuple[bool, str | None]:
        return healthy["now"], None

    monkeypatch.setattr("proxy.lifecycle.watch.monitor.probe", probe)
    await pool.monitor.checks.check(runtime, replica, replica.pid)
    assert replica.state == ReplicaState.UNHEALTHY and runtime.admission.capacity == 0
    assert "health check failed while ready" in replica.last_error
    assert await observe(world, RUNNING, 100) == ReplicaState.UNHEALTHY   # same process, still out
    if replica.probe is not None:
        await replica.probe   # the recheck the monitor started: still failing
    assert replica.state == ReplicaState.UNHEALTHY
    healthy["now"] = True
    await pool.monitor.checks.recheck(runtime, replica, replica.pid)
    assert replica.state == ReplicaState.READY and runtime.admission.capacity == 2


async def test_an_unhealthy_replica_whose_process_dies_is_restarting(world: Any) -> None:
    _, runtime, replica, _ = world
    runtime.set_replica_state(replica, ReplicaState.UNHEALTHY, "health check failed")
    assert await observe(world, BACKOFF, 0) == ReplicaState.STARTING
    assert await observe(world, FATAL, 0) == ReplicaState.FAILED


async def test_a_request_dropped_after_it_was_sent_does_not_take_the_replica_out(world: Any) -> None:
    pool, _, replica, _ = world
    pool.monitor.report_outcome(replica, "dropped the request: ServerDisconnectedError")
    assert replica.state == ReplicaState.READY and replica.failures == 1


async def test_a_crash_counts_as_one_failure_however_many_signs_of_it_arrive(world: Any) -> None:
    pool, _, replica, _ = world
    # SIGKILL of pid 100: the request it was answering breaks off, the next ones are refused, and
    # supervisord restarts it under a new pid. All of that is one crash.
    pool.monitor.report_outcome(replica, "dropped the request: ClientOSError")
    for _ in range(3):
        pool.monitor.report_connection_failure(replica, "ClientConnectorError: Connection refused")
    pool.monitor.report_outcome(replica, "dropped the request: ServerDisconnectedError")
    assert await observe(world, BACKOFF, 0) == ReplicaState.STARTING
    assert await observe(world, STARTING, 101) == ReplicaState.STARTING
    assert replica.restarts == 1 and replica.failures == 1


async def test_each_crash_in_a_row_is_one_more_failure(world: Any) -> None:
    _, runtime, replica, _ = world
    for crash, pid in enumerate((101, 102, 103), start=1):
        assert await observe(world, RUNNING, pid) == ReplicaState.STARTING   # restarted between two polls
        runtime.set_replica_state(replica, ReplicaState.READY)              # its health check passed
        assert replica.failures == crash
    # An answer that failed on the live process after its restart counts on its own.
    pool = world[0]
    pool.monitor.report_outcome(replica, "HTTP 500")
    assert replica.failures == 4


async def test_the_admin_row_shows_no_pid_once_the_process_is_gone(world: Any) -> None:
    _, runtime, replica, _ = world
    assert replica.describe()["pid"] == 100
    assert await observe(world, BACKOFF, 0) == ReplicaState.STARTING      # crashed: no process now
    assert replica.describe()["pid"] is None
    assert await observe(world, STARTING, 101) == ReplicaState.STARTING   # restarted
    assert replica.describe()["pid"] == 101 and replica.restarts == 1
    runtime.set_replica_state(replica, ReplicaState.READY)
    assert await observe(world, STOPPED, 0) == ReplicaState.STOPPED       # an admin's supervisorctl stop
    assert replica.describe()["pid"] is None
    assert await observe(world, RUNNING, 102) == ReplicaState.STARTING    # and supervisorctl start
    runtime.set_replica_state(replica, ReplicaState.READY)
    assert await observe(world, FATAL, 0) == ReplicaState.FAILED
    assert replica.describe()["pid"] is None


async def test_a_replica_not_started_yet_does_not_take_the_pid_of_the_old_process_it_replaces(world: Any) -> None:
    pool, runtime, _, fake = world
    # A reload after a settings change: the load made a new replica whose program still shows the
    # old process (pid 100) until the load has stopped it and started the new one.
    runtime.state = ModelState.LOADING
    spec = runtime.replicas[0].spec
    fresh = Replica(model="m", index=0, spec=spec, fullname="g:r0", reach=ProgramReach(spec))
    runtime.replicas = [fresh]
    await pool.monitor.observe(runtime, fresh, fake.set("g:r0", RUNNING, 100))
    assert fresh.pid == 0 and fresh.state == ReplicaState.STOPPED
    runtime.set_replica_state(fresh, ReplicaState.STARTING)    # the load started the new program
    await pool.monitor.observe(runtime, fresh, fake.set("g:r0", STARTING, 200))
    assert fresh.state == ReplicaState.STARTING and fresh.pid == 200 and fresh.restarts == 0
    assert fake.calls == []


async def test_supervisord_not_answering_is_logged_once_then_at_a_slow_interval(
        world: Any, caplog: pytest.LogCaptureFixture) -> None:
    monitor = world[0].monitor
    for _ in range(5):
        await monitor._not_answering(SupervisorUnavailable("supervisord did not answer"))
    assert caplog.text.count("supervisord is not answering") == 1
    assert monitor.supervisord_status()["answering"] is False
    monitor.down.logged_at -= DOWN_LOG_INTERVAL_S          # a slow interval later
    await monitor._not_answering(SupervisorUnavailable("supervisord did not answer"))
    await monitor._not_answering(SupervisorUnavailable("supervisord did not answer"))
    assert caplog.text.count("supervisord still not answering") == 1
    monitor._answering()
    assert "supervisord answers again" in caplog.text and monitor.supervisord_status()["answering"] is True


async def test_a_dead_managed_supervisord_is_started_again_with_the_replicas_that_served(world: Any) -> None:
    pool, runtime, replica, fake = world
    spec = sim.launch(pool.settings.models["m"], 1, 18001, 5, {})
    stopped = Replica(model="m", index=1, spec=spec, fullname="g:r1", reach=ProgramReach(spec))
    runtime.replicas.append(stopped)     # one an admin stopped with supervisorctl: it stays stopped
    managed = pool.monitor.managed = FakeManagedSupervisord()
    await pool.monitor._not_answering(SupervisorUnavailable("supervisord did not answer"))
    assert managed.started == 1 and pool.monitor.supervisord_status()["restarts"] == 1
    assert replica.state == ReplicaState.STARTING and "supervisord died" in replica.last_error
    assert replica.describe()["pid"] == 300 and replica.restarts == 1     # its new process's, read at its start
    assert runtime.admission.capacity == 0 and stopped.state == ReplicaState.STOPPED
    assert fake.calls == [("start", "g:r0")]
    # Its new process is no crash of the old one, and is judged like any start.
    assert await observe(world, STARTING, 300) == ReplicaState.STARTING
    assert replica.restarts == 1 and replica.failures == 0


async def test_a_supervisord_that_is_alive_but_slow_is_not_started_again(world: Any) -> None:
    pool, _, replica, fake = world
    managed = pool.monitor.managed = FakeManagedSupervisord(dead=False)
    await pool.monitor._not_answering(SupervisorUnavailable("supervisord did not answer"))
    assert managed.started == 0 and replica.state == ReplicaState.READY and fake.calls == []


async def test_a_replica_ready_within_supervisords_startsecs_stays_ready(world: Any) -> None:
    # Checked from the moment its process exists, a replica can pass before supervisord's startsecs
    # are over: supervisord's STARTING for the same pid is that process running, not a restart.
    _, runtime, replica, _ = world
    assert await observe(world, STARTING, 100) == ReplicaState.READY
    assert replica.restarts == 0 and runtime.admission.capacity == 2
    assert await observe(world, STARTING, 103) == ReplicaState.STARTING     # a new process is a restart
    assert replica.restarts == 1


async def test_a_starting_replica_is_probed_before_supervisord_calls_it_running(world: Any) -> None:
    pool, runtime, replica, _ = world
    runtime.set_replica_state(replica, ReplicaState.STARTING)
    replica.probe = None
    await observe(world, STARTING, 100)
    assert replica.probe is not None       # the health check of its process is under way
    replica.probe.cancel()
