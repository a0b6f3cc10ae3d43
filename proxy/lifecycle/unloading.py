"""How a model is unloaded once the pool has decided it (proxy/lifecycle/pool.py): its queue held
or closed, what runs drained, its replicas stopped by their kind, the model UNLOADED; or FAILED
with the reason, from which another unload starts over.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Awaitable, Callable

from proxy import events as ev
from proxy.errors import Conflict, Unavailable
from proxy.events import Events
from proxy.lifecycle.state.replicas import ModelState, ReplicaState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.supervisord.supervisor import SupervisorError

log = logging.getLogger(__name__)

# Records what a model's READY replicas take on their devices now (the placer's measure).
Measure = Callable[[ModelRuntime], Awaitable[None]]
# Keeps what a model's replicas hold before they stop (the KV store's save, proxy/lifecycle/kvcache/).
BeforeStop = Callable[[ModelRuntime], Awaitable[None]]
# Instead of stopping it: True when the model was put to sleep (proxy/lifecycle/sleeping.py).
Sleep = Callable[[ModelRuntime], Awaitable[bool]]


async def unload_model(runtime: ModelRuntime, drain: bool, reason: str, cause: str | None, actor: str | None,
                       events: Events, measure: Measure, drain_timeout_s: float,
                       before_stop: BeforeStop | None = None, sleep: Sleep | None = None) -> ModelRuntime:
    """Unload `runtime` (`reason`: admin, idle, evicted, shutdown; `cause`: the model it made room
    for, or how long it was idle; `actor`: who asked). An unload the pool decided (idle, evicted)
    drains without a bound and keeps the waiters queued for the model's next load; it leaves a
    model alone that is not LOADED (or ASLEEP) or is pinned, and an idle one that a request came to
    since. `before_stop` runs once what ran there has ended, before the replicas stop. `sleep`:
    tried once it has drained, before anything stops; when it puts the model to sleep, nothing is."""
    name = runtime.name
    if runtime.state in (ModelState.UNLOADED, ModelState.UNLOADING):
        raise Conflict(f"model {name!r} is not loaded", code="model_not_loaded")
    async with runtime.lock:
        # It may have changed while this waited for the lock (a load that failed, a racing unload).
        if runtime.state == ModelState.UNLOADED:  # type: ignore[comparison-overlap]
            raise Conflict(f"model {name!r} is not loaded", code="model_not_loaded")
        if reason in ("idle", "evicted") and (runtime.state not in (ModelState.LOADED, ModelState.ASLEEP)
                                              or runtime.config.pinned):
            raise Conflict(f"model {name!r} is {runtime.state.value}: not unloaded ({reason})",
                           code="model_not_loaded")
        if reason == "idle" and (runtime.admission.active or runtime.admission.waiting):
            return runtime   # a request came since placement found it idle: it stays
        runtime.move(ModelState.UNLOADING)
        runtime.unload_reason = reason
        started = time.monotonic()
        keep_waiters = reason in ("idle", "evicted")
        try:
            await stop_serving(runtime, drain=drain, keep_waiters=keep_waiters,
                               measure=measure if reason != "shutdown" else None, drain_timeout_s=drain_timeout_s)
            if sleep is not None and await sleep(runtime):
                return runtime
            await stop_replicas(runtime, before_stop=before_stop)
        except BaseException as exc:
            # Never leave UNLOADING behind: it refuses requests and a second unload alike.
            reason = "interrupted (the proxy is stopping)" if isinstance(exc, asyncio.CancelledError) else str(exc)
            runtime.move(ModelState.FAILED, f"unload did not finish: {reason}")
            log.error("model %s: %s", name, runtime.last_error)
            if isinstance(exc, SupervisorError):
                raise Unavailable(f"model {name!r} could not be unloaded: {exc}; it is marked failed, "
                                  "unload it again to retry", code="unload_failed", retry_after=5) from exc
            raise
        runtime.move(ModelState.UNLOADED)
        runtime.unload_s = time.monotonic() - started
        runtime.unloads[reason] = runtime.unloads.get(reason, 0) + 1
        runtime.unload_reason = None
        runtime.active = None
        runtime.last_error = None
        why = {"evicted": f"evicted for {cause}", "idle": f"idle for {cause}"}.get(reason, reason) \
            if cause else reason
        by = f" by {actor}" if actor else ""
        events.record(ev.UNLOAD, f"model {name} unloaded ({why}{by}) in {runtime.unload_s:.2f}s",
                      model=name, reason=reason, cause=cause, actor=actor)
        return runtime


async def teardown(runtime: ModelRuntime, drain: bool, keep_waiters: bool = False, measure: Measure | None = None,
                   drain_timeout_s: float = 0.0, before_stop: BeforeStop | None = None) -> None:
    """Stop serving `runtime` and stop its replicas (stop_serving, then stop_replicas)."""
    await stop_serving(runtime, drain, keep_waiters, measure, drain_timeout_s)
    await stop_replicas(runtime, before_stop)


async def stop_serving(runtime: ModelRuntime, drain: bool, keep_waiters: bool = False, measure: Measure | None = None,
                       drain_timeout_s: float = 0.0) -> None:
    """Take no more requests for `runtime`. `keep_waiters`: its queue is held, its waiters wait for
    its next load (else they fail, model_unloading); `measure`: its footprint is recorded first;
    `drain`: what runs finishes first (bounded by `drain_timeout_s` unless `keep_waiters`)."""
    if keep_waiters:
        runtime.admission.hold()   # they wait for its next load
    else:
        runtime.admission.close(Unavailable(f"model {runtime.name!r} is being unloaded", code="model_unloading"))
    if measure is not None:
        await measure(runtime)   # after serving: its footprint as it grew with use
    if drain:
        # The pool's own unloads (idle, evicted) never cut a request short: what runs ends by
        # itself, bounded by its timeouts. An admin's waits service.drain_timeout_s at most.
        deadline = time.monotonic() + (math.inf if keep_waiters else drain_timeout_s)
        while runtime.admission.active > 0 and time.monotonic() < deadline:
            await runtime.wait_changed(0.05)


async def stop_replicas(runtime: ModelRuntime, before_stop: BeforeStop | None = None) -> None:
    """Stop the replicas of `runtime`, which serves nothing now (stop_serving); `before_stop` first."""
    if before_stop is not None:
        await before_stop(runtime)
    for replica in runtime.replicas:
        replica.cancel_tasks()
        runtime.set_replica_state(replica, ReplicaState.STOPPING)
    # Should this raise, the replicas stay STOPPING (shown with the model's reason) and a
    # program group's file stays, so that the next unload retries the same steps.
    if runtime.kind is not None:
        await runtime.kind.stop(runtime)
    for replica in runtime.replicas:
        runtime.set_replica_state(replica, ReplicaState.STOPPED)
        replica.pid, replica.alive = 0, False
    runtime.replicas = []
