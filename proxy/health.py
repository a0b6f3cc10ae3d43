"""Replica health while serving: outlier ejection on consecutive failures, with a back-off.

A failure is a 5xx answer, a timeout or a connection failure on the data path, or a restart of the
replica's process. After `eject_after` in a row a READY replica is ejected (UNHEALTHY) for
`eject_base_s`, doubled for each ejection in a row up to `eject_max_s`; it comes back only once
that time is over and its health check passes. A success clears the count and the back-off. The
last READY replica of a model is never ejected: a model that answers some errors beats one that
answers none at all. Pure decisions on the replica and its model's runtime; the pool calls them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from proxy.config import ServiceSettings
from proxy.replicas import Replica, ReplicaState
from proxy.runtime import ModelRuntime


@dataclass(frozen=True)
class HealthPolicy:
    interval_s: float = 5.0
    timeout_s: float = 5.0
    eject_after: int = 5
    eject_base_s: float = 30.0
    eject_max_s: float = 300.0

    @classmethod
    def from_settings(cls, service: ServiceSettings) -> "HealthPolicy":
        return cls(interval_s=service.health_interval_s, timeout_s=service.health_timeout_s,
                   eject_after=service.eject_after_failures, eject_base_s=service.eject_base_s,
                   eject_max_s=service.eject_max_s)

    def backoff(self, ejections: int) -> float:
        return min(self.eject_max_s, self.eject_base_s * 2 ** max(0, ejections - 1))


def note_success(replica: Replica) -> None:
    replica.failures = 0
    replica.ejections = 0


def note_failure(runtime: ModelRuntime, replica: Replica, reason: str, policy: HealthPolicy,
                 now: float | None = None) -> bool:
    """Count one failure; eject the replica when it is READY and has failed `eject_after` times in a
    row. True when it was ejected."""
    replica.failures += 1
    if replica.state != ReplicaState.READY or replica.failures < policy.eject_after:
        return False
    return _eject(runtime, replica, reason, policy, now)


def state_after_check(runtime: ModelRuntime, replica: Replica, policy: HealthPolicy,
                      now: float | None = None) -> ReplicaState:
    """Where a replica whose health check just passed goes: READY, unless it is still serving an
    ejection or has failed too often in a row (a process that keeps crashing), in which case it is
    ejected now, provided another replica is READY."""
    now = time.monotonic() if now is None else now
    if now < replica.eject_until:
        return ReplicaState.UNHEALTHY
    if replica.failures >= policy.eject_after and runtime.ready() and \
            _eject(runtime, replica, f"{replica.failures} failures in a row", policy, now):
        return ReplicaState.UNHEALTHY
    return ReplicaState.READY


def _eject(runtime: ModelRuntime, replica: Replica, reason: str, policy: HealthPolicy, now: float | None) -> bool:
    others = [r for r in runtime.ready() if r is not replica]
    if not others:
        return False  # never the last one serving
    now = time.monotonic() if now is None else now
    failures = replica.failures
    replica.ejections += 1
    replica.ejected_total += 1
    backoff = policy.backoff(replica.ejections)
    replica.eject_until = now + backoff
    replica.failures = 0
    runtime.set_replica_state(replica, ReplicaState.UNHEALTHY,
                              f"ejected for {backoff:g}s after {failures} failures in a row (last: {reason})")
    return True
