"""Replica health while serving: outlier ejection on consecutive failures, with a back-off.

A failure is a 5xx answer, a timeout or a connection failure on the data path, or a crash of the
replica's process. A crash is one failure, however many signs of it arrive (the requests it broke
off, the connections refused after it, the restart under a new pid): the failures a process
answered with are folded into its exit, and nothing more counts against it once it is known gone.
After `eject_after` in a row a READY replica is ejected (UNHEALTHY) for `eject_base_s`, doubled for
each ejection in a row up to `eject_max_s`; it comes back once that time is over and its health
check passes. A success clears the count and the back-off. The last READY replica of a model is
never ejected, and an ejected replica whose check passes comes back at once when no other replica
is READY (a panic threshold, as Envoy has): a model that answers some errors beats one that answers
none at all. The functions are pure decisions on a replica and its model's runtime; `ReadyChecks`
runs the periodic health checks of replicas in rotation and of those taken out.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from launchers.spec import ProgramSpec
from proxy import events as ev
from proxy.config.settings import ServiceSettings
from proxy.events import Events
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState
from proxy.lifecycle.state.runtime import ModelRuntime

log = logging.getLogger(__name__)

# A replica's health check: (healthy, why not when known), within the given seconds.
Probe = Callable[["ProgramSpec | None", float], Awaitable[tuple[bool, "str | None"]]]


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
        return min(self.eject_max_s, self.eject_base_s * 2.0 ** max(0, ejections - 1))


def note_success(replica: Replica) -> None:
    replica.failures = 0
    replica.ejections = 0
    replica.failed_pid = 0


def note_failure(runtime: ModelRuntime, replica: Replica, reason: str, policy: HealthPolicy,
                 now: float | None = None, events: Events | None = None) -> bool:
    """Count one failure; eject the replica when it is READY and has failed `eject_after` times in a
    row. True when it was ejected (an event in `events`). A failure of a process already known to be
    gone is its crash, counted once by `note_exit`."""
    if replica.pid and replica.exited_pid == replica.pid:
        return False
    if replica.failed_pid != replica.pid:
        replica.failed_pid = replica.pid
        replica.failures_before = replica.failures
    replica.failures += 1
    if replica.state != ReplicaState.READY or replica.failures < policy.eject_after:
        return False
    return _eject(runtime, replica, reason, policy, now, events)


def note_exit(replica: Replica) -> None:
    """The replica's process went down: it exited, came back under a new pid, or refused a
    connection. One failure for that process, whatever else its end made fail: the requests it
    broke off before anyone knew are folded into it, and what fails later is not counted again."""
    if replica.pid and replica.exited_pid == replica.pid:
        return
    if replica.pid and replica.failed_pid == replica.pid:
        replica.failures = replica.failures_before
    replica.failures += 1
    replica.exited_pid = replica.pid
    replica.failed_pid = 0


def state_after_check(runtime: ModelRuntime, replica: Replica, policy: HealthPolicy,
                      now: float | None = None, events: Events | None = None) -> ReplicaState:
    """Where a replica whose health check just passed goes: READY, unless it is still serving an
    ejection or has failed too often in a row (a process that keeps crashing), in which case it is
    ejected now, provided another replica is READY. With none READY (panic), an ejection ends now."""
    now = time.monotonic() if now is None else now
    if now < replica.eject_until:
        if runtime.ready():
            return ReplicaState.UNHEALTHY
        replica.eject_until = now
        log.warning("model %s replica %d: back in rotation before its ejection ended: no other replica is ready",
                    replica.model, replica.index)
    if replica.failures >= policy.eject_after and runtime.ready() and \
            _eject(runtime, replica, f"{replica.failures} failures in a row", policy, now, events):
        return ReplicaState.UNHEALTHY
    return ReplicaState.READY


def _eject(runtime: ModelRuntime, replica: Replica, reason: str, policy: HealthPolicy, now: float | None,
           events: Events | None = None) -> bool:
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
    replica.failed_pid = 0
    why = f"ejected for {backoff:g}s after {failures} failures in a row (last: {reason})"
    runtime.set_replica_state(replica, ReplicaState.UNHEALTHY, why)
    if events is not None:
        events.record(ev.EJECT, f"model {runtime.name} replica {replica.index} {why}", model=runtime.name,
                      replica=replica.index, host=replica.host, reason=reason, level=logging.WARNING)
    return True


class ReadyChecks:
    """Health checks while a model is loaded: each READY replica every `interval_s`, so a frozen
    (SIGSTOPped) or failing server leaves rotation instead of swallowing the requests routed to it;
    each UNHEALTHY one, once its ejection is over, until a check passes and it is READY again.
    The pool's monitor calls `maybe_check` and `maybe_recheck` on every pass."""

    def __init__(self, policy: HealthPolicy, probe: Probe, events: Events | None = None) -> None:
        self.policy = policy
        self.probe = probe
        self.events = events

    def maybe_check(self, runtime: ModelRuntime, replica: Replica) -> None:
        if replica.state == ReplicaState.READY and runtime.state == ModelState.LOADED and self._due(replica):
            replica.probe = asyncio.create_task(self.check(runtime, replica, replica.pid))

    def maybe_recheck(self, runtime: ModelRuntime, replica: Replica) -> None:
        # With no READY replica the model serves nothing: check the ones taken out on every pass,
        # ejected or not, so that the first to pass serves again (state_after_check).
        panic = not runtime.ready()
        if replica.state == ReplicaState.UNHEALTHY and (panic or time.monotonic() >= replica.eject_until) and \
                self._due(replica, 0.0 if panic else self.policy.interval_s):
            replica.probe = asyncio.create_task(self.recheck(runtime, replica, replica.pid))

    def _due(self, replica: Replica, interval_s: float | None = None) -> bool:
        now = time.monotonic()
        busy = replica.probe is not None and not replica.probe.done()
        if busy or now - replica.checked_at < (self.policy.interval_s if interval_s is None else interval_s):
            return False
        replica.checked_at = now
        return True

    async def check(self, runtime: ModelRuntime, replica: Replica, pid: int) -> None:
        ok, error = await self.probe(replica.spec, self.policy.timeout_s)
        if ok or replica.state != ReplicaState.READY or replica.pid != pid:
            return
        replica.probe_failures += 1
        reason = "health check failed while ready: " + \
            (error or f"no healthy answer within {self.policy.timeout_s:g}s (service.health_timeout_s)")
        runtime.set_replica_state(replica, ReplicaState.UNHEALTHY, reason)
        message = f"model {replica.model} replica {replica.index} out of rotation: {reason}"
        if self.events is None:
            log.warning("%s", message)
        else:
            self.events.record(ev.EJECT, message, model=replica.model, replica=replica.index, host=replica.host,
                               reason="health check failed", level=logging.WARNING)

    async def recheck(self, runtime: ModelRuntime, replica: Replica, pid: int) -> None:
        ok, _error = await self.probe(replica.spec, self.policy.timeout_s)
        if not ok:
            replica.probe_failures += 1
        if not ok or replica.state != ReplicaState.UNHEALTHY or replica.pid != pid:
            return
        if state_after_check(runtime, replica, self.policy, events=self.events) == ReplicaState.READY:
            runtime.set_replica_state(replica, ReplicaState.READY)
            replica.last_error = None
            log.info("model %s replica %d is back in rotation", replica.model, replica.index)
