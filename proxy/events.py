"""The events feed: what happened to models, replicas and hosts, why, and who or what caused it.

One bounded ring of recent events, read by `GET /v1/admin/events`, `llm-pool ctl events` and the
status page. Recording an event also writes it to the proxy's log, so the feed and the log never
disagree. Synchronous: the event loop is its only writer.

The record outlives the process: once the feed continues a journal (proxy/event_journal.py, a file
in the state folder) every event is appended to it, and the next proxy, a reload's successor or a
start after a crash, reads it back and numbers on from its last id. A reload's old process, once it
handed over, sends its events to the successor instead (`hand_over`), which records them with its
own ids: one writer of the journal at any time, and ids that never repeat.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

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
WORKER = "worker"            # a worker process exited unasked (reason: exited) and another was started
KV_STORE = "kv_store"        # a model's restored slots showed no reuse: it saves none (reason: restore_unverified)
KINDS = (LOAD, LOAD_FAILED, UNLOAD, EVICT, SCALE, RESTART, CRASH, EJECT, HOST_DOWN, HOST_UP, ADMIN, RELOAD, SLEEP,
         WAKE, LEDGER, THRASH, OVER_BUDGET, STOPPED, STARTED, WORKER, KV_STORE)

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

    @classmethod
    def from_json(cls, data: Any) -> "Event | None":
        """The event `to_json` gave, or None for anything else (a journal's torn last line, a field
        of the wrong type)."""
        if not isinstance(data, Mapping):
            return None
        checks = {"id": _positive, "time": _number, "kind": _text, "message": _text, "replica": _index}
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = data.get(f.name)
            if not checks.get(f.name, _optional_text)(value):
                return None
            values[f.name] = value
        return cls(**values)


def _positive(v: object) -> bool:
    return type(v) is int and v > 0


def _number(v: object) -> bool:
    return type(v) in (int, float)


def _text(v: object) -> bool:
    return isinstance(v, str)


def _optional_text(v: object) -> bool:
    return v is None or isinstance(v, str)


def _index(v: object) -> bool:
    return v is None or type(v) is int


class Journal(Protocol):
    """Where the feed keeps its events beyond the process (proxy/event_journal.py)."""

    def append(self, event: Event, recent: Sequence[Event]) -> None: ...

    def rewrite(self, events: Iterable[Event]) -> None: ...

    def close(self) -> None: ...


class Events:
    """The most recent `capacity` events, oldest first, each with an id that only grows (a reader
    polls with `after=<the last id it saw>`)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.time,
                 logger: logging.Logger | None = None) -> None:
        self._ring: deque[Event] = deque(maxlen=capacity)
        self._clock = clock
        self._log = logger or logging.getLogger("proxy.events")
        self.last_id = 0
        self._journal: Journal | None = None
        self._send: Callable[[Event], None] | None = None

    @property
    def capacity(self) -> int:
        return self._ring.maxlen or 0

    def record(self, kind: str, message: str, *, model: str | None = None, replica: int | None = None,
               host: str | None = None, reason: str | None = None, cause: str | None = None,
               actor: str | None = None, level: int = logging.INFO) -> Event:
        """Add an event and log its message at `level`. `message` is a whole sentence for a person;
        the other fields are for filters and tables."""
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}")
        self.last_id += 1
        event = Event(self.last_id, self._clock(), kind, message, model, replica, host, reason, cause, actor)
        self._keep(event)
        self._log.log(level, "%s", message)
        return event

    def _keep(self, event: Event) -> None:
        self._ring.append(event)
        if self._send is not None:
            self._send(event)
        elif self._journal is not None:
            self._journal.append(event, self._ring)

    def continue_from(self, history: Sequence[Event], journal: Journal) -> None:
        """Go on from `history` (what `journal` holds, oldest first): it comes before every event
        recorded so far, which are numbered again after its last id, and from now on each event is
        also written to `journal`. A proxy calls this at its start, or a reload's successor once it
        was handed the service (until then its predecessor writes the journal)."""
        own = list(self._ring)
        self._ring.clear()
        self._ring.extend(history)
        self.last_id = max((e.id for e in history), default=0)
        for event in own:
            self.last_id += 1
            self._ring.append(replace(event, id=self.last_id))
        journal.rewrite(self._ring)
        self._journal = journal

    def hand_over(self, send: Callable[[Event], None]) -> None:
        """A reload's old process handed the service over: from now on each event goes to `send`
        (to the successor, which records it in its feed and its journal) and no longer to the journal."""
        self._send = send
        self.close()

    def close(self) -> None:
        """The proxy is done: the journal is closed, and what is recorded after stays in memory."""
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def received(self, data: Any) -> Event | None:
        """An event a reload's old process recorded after it handed over (`Event.to_json`): recorded
        here with the next id and its own time, not logged again (that process logged it). Anything
        else is dropped (None)."""
        given = Event.from_json(data)
        if given is None:
            return None
        self.last_id += 1
        event = replace(given, id=self.last_id)
        self._keep(event)
        return event

    def since(self, after: int = 0, limit: int = 200, model: str | None = None,
              kinds: frozenset[str] | None = None) -> list[Event]:
        """Events newer than `after`, oldest first, at most the `limit` newest of them, only of
        `model` and `kinds` when given."""
        picked = [e for e in self._ring if e.id > after and (model is None or e.model == model)
                  and (kinds is None or e.kind in kinds)]
        return picked[-limit:] if limit > 0 else []
