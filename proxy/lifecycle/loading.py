"""How an admitted load runs once the pool has decided it (proxy/lifecycle/pool.py): the model
LOADING, its replicas started by their kind and waited for until each passes its health check,
then LOADED, or FAILED with the reason; and what a failed load tells the requests that wait.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from proxy import events as ev
from proxy.config.model import ModelConfig
from proxy.errors import BackendError, Conflict, PoolError, Unavailable
from proxy.events import Events
from proxy.lifecycle.state.runtime import Kind
from proxy.lifecycle.scaling import Waiter
from proxy.lifecycle.state.replicas import ModelState, ReplicaState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.lifecycle.unloading import teardown
from proxy.supervisord.supervisor import SupervisorError


async def start_model(runtime: ModelRuntime, config: ModelConfig, kind: Kind, reason: str, counted: str,
                      actor: str | None, monitor: Waiter, events: Events) -> None:
    """Start `runtime`'s replicas with `config` and wait until they are healthy: LOADED with at
    least one READY replica, else FAILED (its processes stopped, its waiters told) and raised.
    `reason`: startup, adopted, admin or on_demand; `counted`: the reason its load counts under."""
    name = runtime.name
    runtime.move(ModelState.LOADING)
    started = time.monotonic()
    runtime.active = config
    runtime.last_error = None
    runtime.admission.reopen()
    try:
        await kind.start(runtime, config)
        await monitor.await_replicas(runtime)
    except asyncio.CancelledError:
        raise  # the proxy is stopping: what runs is left for the next one to adopt or stop
    except Exception as exc:
        runtime.last_error = str(exc)
        with contextlib.suppress(Exception):
            await teardown(runtime, drain=False, keep_waiters=True)
        runtime.move(ModelState.FAILED)
        _load_failed(runtime, reason, actor, str(exc), events)
        if isinstance(exc, SupervisorError):
            error = Unavailable(f"supervisord: {exc}", code="supervisor_unavailable", retry_after=5)
            _fail_waiters(runtime, counted, error)
            raise error from exc
        _fail_waiters(runtime, counted, exc)
        raise
    errors = "; ".join(f"replica {r.index}: {r.last_error}" for r in runtime.replicas
                       if r.state != ReplicaState.READY)
    runtime.last_error = errors or None
    if not runtime.ready():
        await teardown(runtime, drain=False, keep_waiters=True)
        runtime.move(ModelState.FAILED)
        _load_failed(runtime, reason, actor, errors, events)
        failed = BackendError(f"model {name!r} failed to load: {errors}", code="model_load_failed")
        _fail_waiters(runtime, counted, failed)
        raise failed
    runtime.move(ModelState.LOADED)
    runtime.loaded_at = time.monotonic()
    runtime.load_s = runtime.loaded_at - started
    runtime.loads[counted] = runtime.loads.get(counted, 0) + 1
    by = f" by {actor}" if actor else ""
    events.record(ev.LOAD, f"model {name} loaded ({reason}{by}) in {runtime.load_s:.2f}s: "
                  f"{len(runtime.ready())} of {len(runtime.replicas)} replicas ready",
                  model=name, reason=reason, actor=actor)


def kind_to_start(runtime: ModelRuntime, config: ModelConfig, reason: str, events: Events) -> Kind:
    """The kind that starts `runtime`'s replicas with `config`; or, when this version cannot run
    its backend or `config` cannot be loaded (the kind's check), the model FAILED with the reason
    (for the admin view and /health; every other model is unaffected) and that raised. A load of no
    replicas is refused (and changes nothing)."""
    name = runtime.name
    kind = runtime.kind
    if kind is None:
        raise _cannot_start(runtime, reason, Conflict(
            f"model {name!r}: backend {config.backend!r} cannot be run by this version of llm-pool",
            code="backend_not_supported"), events)
    problems = kind.check(config)
    if problems:
        raise _cannot_start(runtime, reason, Conflict(
            f"model {name!r} cannot be loaded: " + "; ".join(problems), code="model_not_loadable"), events)
    if config.replicas < 1:
        raise Conflict(f"model {name!r}: replicas must be at least 1 to load", code="model_not_loadable")
    return kind


def _cannot_start(runtime: ModelRuntime, reason: str, error: Conflict, events: Events) -> Conflict:
    runtime.move(ModelState.FAILED, error.message)
    _load_failed(runtime, reason, None, error.message, events)
    _fail_waiters(runtime, reason, error)
    return error


def _load_failed(runtime: ModelRuntime, reason: str, actor: str | None, why: str, events: Events) -> None:
    by = f" by {actor}" if actor else ""
    events.record(ev.LOAD_FAILED, f"model {runtime.name} failed to load ({reason}{by}): {why}",
                  model=runtime.name, reason=reason, actor=actor, level=logging.ERROR)


def _fail_waiters(runtime: ModelRuntime, reason: str, exc: Exception) -> None:
    """A load failed (the model is FAILED): requests that queued for it meanwhile (it loads on
    demand) learn why; an on-demand load's waiters get the error with its back-off from the
    placer instead. A load refused before it began (the model is loaded with other settings,
    there is no room) never comes here: it changed nothing, and the model serves on."""
    if reason != "on_demand":
        runtime.admission.close(exc if isinstance(exc, PoolError) else BackendError(
            f"model {runtime.name!r} failed to load: {exc}", code="model_load_failed"))
