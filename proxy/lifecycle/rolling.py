"""Rolling a model onto new settings, one replica at a time, so that it never has zero replicas.

A `serve` that finds a model's replicas running a program other than what its settings (the config
files plus its kept overrides, kept.py) give now adopts them as they are: they serve on, marked out
of date (Replica.outdated says which settings changed). Then each is replaced in turn, with
scaling's own two moves (scaling.py): a replica with the new settings is added under the lowest
free index and must be READY before the old one is drained (its requests in flight finish, up to
service.drain_timeout_s) and stopped; so at every moment the model has at least as many READY
replicas as before but one. Each restart is an event (`restart`, with the settings that changed).
A new replica that does not become ready stops the roll: the old ones keep serving, and the
model's last_error and an event say so; the next reload (or an unload and load) tries again.

No old replica is stopped before `predecessor_gone` is set: while the previous proxy process still
drains its own requests (a handover), they may be on the old replicas.
"""
from __future__ import annotations

import asyncio
import logging

from proxy import events as kinds
from proxy.events import Events
from proxy.lifecycle.state.replicas import ModelState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.lifecycle.scaling import Waiter, add_ready, drain_and_remove
from proxy.lifecycle.state.indices import free_indices
from proxy.supervisord.supervisor import SupervisorError

log = logging.getLogger(__name__)


async def roll(runtime: ModelRuntime, monitor: Waiter, events: Events, predecessor_gone: asyncio.Event,
               drain_timeout_s: float) -> bool:
    """Replace every out-of-date replica of `runtime`, one at a time. Returns whether none is left
    (False: the roll stopped, runtime.last_error says why). Each step holds the model's lock, so
    that no scale or unload runs in the middle of one; between steps they may."""
    while True:
        async with runtime.lock:
            if runtime.state != ModelState.LOADED or runtime.kind is None:
                return False   # unloaded (or failed) meanwhile: nothing left to roll
            old = next((r for r in runtime.replicas if r.outdated is not None), None)
            if old is None:
                return True
            reason = old.outdated or ""
            left = sum(1 for r in runtime.replicas if r.outdated is not None)
            index = free_indices([r.index for r in runtime.replicas], 1)
            try:
                added, errors = await add_ready(runtime, runtime.model, index, monitor)
            except Exception as exc:   # supervisord, no free port, a value no program file may hold
                errors = str(exc)
            if errors:
                runtime.last_error = (f"rolling onto new settings stopped: a replica with them did not become "
                                      f"ready ({errors}); {left} out-of-date replica(s) keep serving")
                events.record(kinds.RESTART, f"model {runtime.name}: {runtime.last_error}", model=runtime.name,
                              replica=old.index, reason=reason, level=logging.ERROR)
                return False
            (new,) = added
            await predecessor_gone.wait()
            try:
                await drain_and_remove(runtime, [old], drain_timeout_s)
            except SupervisorError as exc:
                runtime.last_error = f"rolling onto new settings stopped: replica {old.index} did not stop: {exc}"
                events.record(kinds.RESTART, f"model {runtime.name}: {runtime.last_error}", model=runtime.name,
                              replica=old.index, reason=reason, level=logging.ERROR)
                return False
            events.record(kinds.RESTART, f"model {runtime.name}: replica {old.index} replaced by replica "
                          f"{new.index} ({reason}); {left - 1} out-of-date replica(s) left", model=runtime.name,
                          replica=new.index, reason=reason)


class Rolls:
    """The rolls that run: one at a time per model, each replacing a model's out-of-date replicas."""

    def __init__(self, monitor: Waiter, events: Events, predecessor_gone: asyncio.Event,
                 drain_timeout_s: float) -> None:
        self.monitor = monitor
        self.events = events
        self.predecessor_gone = predecessor_gone
        self.drain_timeout_s = drain_timeout_s
        self._running: set[str] = set()

    def wanted(self, runtime: ModelRuntime) -> bool:
        """Whether `runtime` has replicas out of date and no roll of its own runs."""
        return any(r.outdated for r in runtime.replicas) and runtime.name not in self._running

    async def run(self, runtime: ModelRuntime) -> None:
        """Replace the replicas adopted out of date one by one (roll); once none is left, the
        settings the last proxy kept for it are no longer needed to reach one."""
        outdated = sum(1 for r in runtime.replicas if r.outdated)
        log.info("model %s: rolling %d out-of-date replica(s) onto its settings, one at a time", runtime.name,
                 outdated)
        self._running.add(runtime.name)
        try:
            done = await roll(runtime, self.monitor, self.events, self.predecessor_gone, self.drain_timeout_s)
        finally:
            self._running.discard(runtime.name)
        if done:
            runtime.kept = None
            log.info("model %s: every replica runs its settings", runtime.name)
