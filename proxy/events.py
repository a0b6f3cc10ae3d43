"""The events feed: what happened to models, replicas and hosts, why, and who or what caused it.

One bounded ring of recent events, read by `GET /v1/admin/events`, `llm-pool ctl events` and the
status page. Recording an event also writes it to the proxy's log, so the feed and the log never
disagree. Pure and synchronous: the event loop is its only writer.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable

# What happened. Plain strings: they are the feed's `kind` field as clients read it.
LOAD = "load"                # a model became ready (reason: startup, admin, on_demand, adopted)
LOAD_FAILED = "load_failed"  # a load ended in failed
UNLOAD = "unload"            # a model's processes stopped (reason: admin, idle, evicted, shutdown)
EVICT = "evict"              # placement chose a model to make room (cause: the model it made room for)
SCALE = "scale"              # a loaded model's replica count changed
RESTART = "restart"          # a replica was restarted on purpose (reason: why)
CRASH = "crash"              # a replica's process exited without being asked
EJECT = "eject"              # a replica was taken out of rotation for its failures
HOST_DOWN = "host_down"      # a host's supervisord stopped answering
HOST_UP = "host_up"          # it answered again
ADMIN = "admin"              # an admin action, refused or not (actor: who)
RELOAD = "reload"            # SIGUSR1: a new process took over (reason: took_over), or nothing changed (failed)
SLEEP = "sleep"              # an evicted model was put to sleep instead of stopped (cause: the model it made room for)
WAKE = "wake"                # an asleep model woke (reason: on_demand, admin), or its wake failed (reason: failed)
LEDGER = "ledger"            # the usage ledger cannot write (reason: failed), or writes again (reason: recovered)
THRASH = "thrash"            # a model evicted and loaded again within lifecycle.thrash_window_s (cause: what it evicts)
OVER_BUDGET = "over_budget"  # a device's loaded models hold more than its budget (a smaller budget, adopted models)
STOPPED = "stopped"          # a replica was stopped in supervisord (an admin's supervisorctl stop), not by the pool
STARTED = "started"          # a replica stopped there was started there again (an admin's supervisorctl start)
KINDS = (LOAD, LOAD_FAILED, UNLOAD, EVICT, SCALE, RESTART, CRASH, EJECT, HOST_DOWN, HOST_UP, ADMIN, RELOAD, SLEEP,
         WAKE, LEDGER, THRASH, OVER_BUDGET, STOPPED, STARTED)

DEFAULT_CAPACITY = 1000


@dataclass(frozen=True)
class Event:
    id: int
    time: float
    kind: str
    message: str
    model: str | None = None
    replica: int | None = None
    host: str | None = None
    reason: str | None = None
    cause: str | None = None
    actor: str | None = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


class Events:
    """The most recent `capacity` events, oldest first, each with an id that only grows (a reader
    polls with `after=<the last id it saw>`)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.time,
                 logger: logging.Logger | None = None) -> None:
        self._ring: deque[Event] = deque(maxlen=capacity)
        self._clock = clock
        self._log = logger or logging.getLogger("proxy.events")
        self.last_id = 0

    def record(self, kind: str, message: str, *, model: str | None = None, replica: int | None = None,
               host: str | None = None, reason: str | None = None, cause: str | None = None,
               actor: str | None = None, level: int = logging.INFO) -> Event:
        """Add an event and log its message at `level`. `message` is a whole sentence for a person;
        the other fields are for filters and tables."""
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}")
        self.last_id += 1
        event = Event(self.last_id, self._clock(), kind, message, model, replica, host, reason, cause, actor)
        self._ring.append(event)
        self._log.log(level, "%s", message)
        return event

    def since(self, after: int = 0, limit: int = 200, model: str | None = None,
              kinds: frozenset[str] | None = None) -> list[Event]:
        """Events newer than `after`, oldest first, at most the `limit` newest of them, only of
        `model` and `kinds` when given."""
        picked = [e for e in self._ring if e.id > after and (model is None or e.model == model)
                  and (kinds is None or e.kind in kinds)]
        return picked[-limit:] if limit > 0 else []
