"""Outlier ejection (proxy/lifecycle/watch/health.py) and the per-replica cap, on a model runtime without processes."""
from __future__ import annotations

import time

import pytest

from helpers import ready_runtime
from proxy.config.model import ModelConfig
from proxy.events import Events
from proxy.lifecycle.watch.health import HealthPolicy, ReadyChecks, note_failure, note_success, state_after_check
from proxy.lifecycle.state.replicas import InvalidTransition, ReplicaState
from proxy.lifecycle.state.runtime import ModelRuntime

CONFIG = ModelConfig(name="m", backend="sim", enabled=True, replicas=2, replica_max=2, target_inflight=2,
                     modalities=("text",), gpus=(), options={})
POLICY = HealthPolicy(eject_after=3, eject_base_s=10, eject_max_s=25)


def runtime(n: int = 2) -> ModelRuntime:
    rt: ModelRuntime = ready_runtime(CONFIG, n)
    return rt


def test_consecutive_failures_eject_a_replica_with_a_doubling_backoff() -> None:
    rt = runtime()
    bad = rt.replicas[0]
    assert not note_failure(rt, bad, "HTTP 500", POLICY, now=0)
    assert not note_failure(rt, bad, "HTTP 500", POLICY, now=0)
    assert note_failure(rt, bad, "HTTP 500", POLICY, now=0)
    assert bad.state == ReplicaState.UNHEALTHY and bad.eject_until == 10
    assert "3 failures in a row (last: HTTP 500)" in (bad.last_error or "")
    assert rt.admission.capacity == 2 and rt.ready() == [rt.replicas[1]]
    # Its ejection is not over: a passing health check does not bring it back yet.
    assert state_after_check(rt, bad, POLICY, now=9) == ReplicaState.UNHEALTHY
    assert state_after_check(rt, bad, POLICY, now=10) == ReplicaState.READY
    rt.set_replica_state(bad, ReplicaState.READY)
    for _ in range(3):
        note_failure(rt, bad, "timeout", POLICY, now=20)
    assert bad.eject_until == 40 and bad.ejected_total == 2        # 10 s, then 20 s
    rt.set_replica_state(bad, ReplicaState.READY)
    for _ in range(3):
        note_failure(rt, bad, "timeout", POLICY, now=50)
    assert bad.eject_until == 75                                   # capped at eject_max_s


def test_a_success_clears_the_count_and_the_backoff() -> None:
    rt = runtime()
    bad = rt.replicas[0]
    note_failure(rt, bad, "HTTP 500", POLICY, now=0)
    note_failure(rt, bad, "HTTP 500", POLICY, now=0)
    note_success(bad)
    assert not note_failure(rt, bad, "HTTP 500", POLICY, now=0)
    assert bad.state == ReplicaState.READY and bad.failures == 1


def test_the_last_ready_replica_is_never_ejected() -> None:
    rt = runtime()
    for replica in rt.replicas:
        for _ in range(5):
            note_failure(rt, replica, "HTTP 500", POLICY, now=0)
    assert [r.state for r in rt.replicas] == [ReplicaState.UNHEALTHY, ReplicaState.READY]
    assert rt.admission.capacity == 2


def test_a_replica_that_keeps_crashing_is_ejected_when_it_comes_back() -> None:
    rt = runtime()
    crashing = rt.replicas[0]
    rt.set_replica_state(crashing, ReplicaState.STARTING)
    crashing.failures = 3   # three restarts seen by the monitor
    assert state_after_check(rt, crashing, POLICY, now=0) == ReplicaState.UNHEALTHY
    assert crashing.ejected_total == 1 and crashing.eject_until == 10


def test_unhealthy_is_left_only_for_a_known_state() -> None:
    rt = runtime()
    replica = rt.replicas[0]
    rt.set_replica_state(replica, ReplicaState.UNHEALTHY, "health check failed")
    assert rt.admission.capacity == 2
    rt.set_replica_state(replica, ReplicaState.READY)
    assert rt.admission.capacity == 4
    rt.set_replica_state(replica, ReplicaState.STOPPING)
    with pytest.raises(InvalidTransition):
        rt.set_replica_state(replica, ReplicaState.UNHEALTHY)


def test_a_replica_never_gets_more_than_target_inflight_whatever_the_gauges_say() -> None:
    rt = runtime()
    busy, idle = rt.replicas
    busy.reported = {"running": 10.0}   # another client keeps replica 0 busy
    picked = []
    for _ in range(4):
        replica = rt.pick_replica()
        assert replica is not None
        replica.inflight += 1
        picked.append(replica.index)
    assert picked.count(1) == 2 and picked.count(0) == 2
    assert rt.pick_replica() is None    # both full: the request waits for a place
    rt.release(idle)
    assert rt.pick_replica() is idle


async def test_an_ejected_replica_comes_back_at_once_when_no_other_replica_is_ready() -> None:
    rt = runtime()
    ejected, other = rt.replicas
    now = time.monotonic()
    for _ in range(3):
        note_failure(rt, ejected, "HTTP 500", POLICY, now=now)
    assert ejected.state == ReplicaState.UNHEALTHY and ejected.eject_until > now
    passing = ReadyChecks(POLICY, _passing_probe)
    passing.maybe_recheck(rt, ejected)
    assert ejected.probe is None              # another replica serves: the ejection runs its course
    rt.set_replica_state(other, ReplicaState.STARTING, "process exited; restarting")
    # Panic threshold: nothing else can serve, so its passing health check brings it back now.
    assert state_after_check(rt, ejected, POLICY, now=now) == ReplicaState.READY
    passing.maybe_recheck(rt, ejected)
    assert ejected.probe is not None
    await ejected.probe
    assert ejected.state == ReplicaState.READY and rt.admission.capacity == 2
    assert ejected.ejected_total == 1 and ejected.eject_until <= time.monotonic()


async def test_in_panic_a_failing_ejected_replica_stays_out() -> None:
    rt = runtime()
    ejected, other = rt.replicas
    for _ in range(3):
        note_failure(rt, ejected, "HTTP 500", POLICY, now=time.monotonic())
    rt.set_replica_state(other, ReplicaState.STARTING)

    async def failing(*_: object) -> tuple[bool, str | None]:
        return False, "HTTP 500"

    checks = ReadyChecks(POLICY, failing)
    checks.maybe_recheck(rt, ejected)
    assert ejected.probe is not None
    await ejected.probe
    assert ejected.state == ReplicaState.UNHEALTHY and ejected.probe_failures == 1


async def _passing_probe(*_: object) -> tuple[bool, str | None]:
    return True, None


def test_an_ejection_is_an_event_with_its_replica_and_last_failure_and_the_last_ready_one_none() -> None:
    feed = Events(clock=lambda: 0.0)
    rt = runtime()
    for _ in range(3):
        note_failure(rt, rt.replicas[0], "HTTP 502", POLICY, now=0, events=feed)
    for _ in range(5):
        note_failure(rt, rt.replicas[1], "HTTP 502", POLICY, now=0, events=feed)   # the last READY: kept
    (event,) = feed.since()
    assert (event.kind, event.model, event.replica, event.reason) == ("eject", "m", 0, "HTTP 502")
    assert event.message == "model m replica 0 ejected for 10s after 3 failures in a row (last: HTTP 502)"
