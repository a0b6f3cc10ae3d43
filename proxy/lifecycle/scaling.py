"""Live scaling: start or stop replicas of a loaded model while requests keep flowing on the others.

Up: the kind adds the new replicas under the lowest free indices (state/indices.py: a rolled
model's may have a gap) (for programs: one supervisord program each, the running ones untouched)
and the call returns once they are READY; admission's capacity grows as each becomes READY. Down:
the highest-numbered replicas (out-of-date ones first) leave rotation at once (STOPPING: no new
request is sent to them, capacity shrinks), their requests in flight finish (up to
service.drain_timeout_s), then the kind stops them. Either way the runtime's `active` settings
record the new count. A roll (rolling.py) uses the same two moves, one replica at a time.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from proxy import events as ev
from proxy.config.checks import replicas_problem
from proxy.config.model import ModelConfig
from proxy.errors import BackendError, BadRequest, Conflict, Unavailable
from proxy.events import Events
from proxy.lifecycle.state.indices import free_indices
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.supervisord.supervisor import SupervisorError

log = logging.getLogger(__name__)


class Waiter(Protocol):
    """What scaling needs of the monitor: to wait until new replicas have passed their checks."""

    async def await_replicas(self, runtime: ModelRuntime, replicas: list[Replica] | None = None) -> None: ...


async def scale(runtime: ModelRuntime, replicas: int, monitor: Waiter, drain_timeout_s: float, events: Events,
                actor: str | None = None) -> ModelRuntime:
    """Scale `runtime` to `replicas`; a change is an event (`actor`: who asked)."""
    before = len(runtime.replicas)
    problem = replicas_problem(replicas, runtime.config.replica_max)
    if problem:
        raise BadRequest(f"model {runtime.name!r}: {problem}", code="invalid_scale_request", param="replicas")
    async with runtime.lock:
        if runtime.state != ModelState.LOADED or runtime.kind is None:
            raise Conflict(f"model {runtime.name!r} is not loaded; load it (with `replicas`) instead",
                           code="model_not_loaded")
        current = len(runtime.replicas)
        try:
            if replicas > current:
                await _scale_up(runtime, replicas, monitor)
            elif replicas < current:
                await _scale_down(runtime, replicas, drain_timeout_s)
        except SupervisorError as exc:
            raise Unavailable(f"model {runtime.name!r} could not be scaled: supervisord: {exc}; scale again to retry",
                              code="scale_failed", retry_after=5) from exc
        runtime.active = runtime.with_replicas(replicas)
    if len(runtime.replicas) != before:
        by = f" by {actor}" if actor else ""
        events.record(ev.SCALE, f"model {runtime.name} scaled from {before} to {len(runtime.replicas)} replicas{by} "
                      f"({len(runtime.ready())} ready)", model=runtime.name, actor=actor)
    return runtime


async def _scale_up(runtime: ModelRuntime, replicas: int, monitor: Waiter) -> None:
    config = runtime.with_replicas(replicas)
    started = time.monotonic()
    indices = free_indices([r.index for r in runtime.replicas], replicas - len(runtime.replicas))
    added, errors = await add_ready(runtime, config, indices, monitor)
    if errors:
        raise BackendError(f"model {runtime.name!r} could not be scaled to {replicas}: {errors}",
                           code="model_scale_failed")
    log.info("model %s: %d replica(s) added in %.2fs", runtime.name, len(added), time.monotonic() - started)


async def add_ready(runtime: ModelRuntime, config: ModelConfig, indices: list[int], monitor: Waiter
                    ) -> tuple[list[Replica], str]:
    """Add replicas `indices` with `config` and wait until they are READY: all or nothing, a
    replica that cannot start is removed again. Returns them, and "" or why they could not start."""
    assert runtime.kind is not None
    before = list(runtime.replicas)
    try:
        added = await runtime.kind.add(runtime, config, indices)
    except Exception:
        # One that supervisord would not start (its command is missing, say) is listed already.
        with contextlib.suppress(Exception):
            await _remove(runtime, [r for r in runtime.replicas if r not in before])
        raise
    await monitor.await_replicas(runtime, added)
    failed = [r for r in added if r.state != ReplicaState.READY]
    if not failed:
        return added, ""
    errors = "; ".join(f"replica {r.index}: {r.last_error}" for r in failed)
    await _remove(runtime, added)
    return added, errors


async def _scale_down(runtime: ModelRuntime, replicas: int, drain_timeout_s: float) -> None:
    # Out-of-date replicas (a roll's, rolling.py) go first: they were to be replaced anyway.
    staying = sorted(runtime.replicas, key=lambda r: (r.outdated is not None, r.index))[:replicas]
    await drain_and_remove(runtime, [r for r in runtime.replicas if r not in staying], drain_timeout_s)


async def drain_and_remove(runtime: ModelRuntime, leaving: list[Replica], drain_timeout_s: float) -> None:
    """Take `leaving` out of rotation at once, let their requests in flight finish (up to
    `drain_timeout_s`), then stop them."""
    for replica in leaving:
        runtime.set_replica_state(replica, ReplicaState.STOPPING)   # out of rotation; capacity follows
    deadline = time.monotonic() + drain_timeout_s
    while any(r.inflight > 0 for r in leaving) and time.monotonic() < deadline:
        await runtime.wait_changed(0.05)
    await _remove(runtime, leaving)


async def _remove(runtime: ModelRuntime, leaving: list[Replica]) -> None:
    assert runtime.kind is not None
    for replica in leaving:
        replica.cancel_tasks()
        runtime.set_replica_state(replica, ReplicaState.STOPPING)
    try:
        await runtime.kind.remove(runtime, leaving)
    except (SupervisorError, asyncio.CancelledError) as exc:
        # They stay listed, STOPPING with the reason, so that the admin view shows them and the
        # next scale (or unload) stops them again.
        for replica in leaving:
            runtime.set_replica_state(replica, ReplicaState.STOPPING, f"stop did not finish: {exc}")
        raise
    runtime.replicas = [r for r in runtime.replicas if r not in leaving]
    for replica in leaving:
        runtime.set_replica_state(replica, ReplicaState.STOPPED)
        replica.pid, replica.alive = 0, False
