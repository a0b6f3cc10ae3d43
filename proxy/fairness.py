"""Client fairness for one model: which waiting request takes the next free slot.

Pure, synchronous and free of I/O: events go in (`submit`, `cancel`, `done`, `set_capacity`) and
each returns the requests that may start now. The event loop is its only caller, so it needs no
locks, and an injectable clock makes every rule testable without sleeping.

The rules are the seed's "Client Fairness":
- requests queue per fairness key, in arrival order; requests without a key share one queue;
- a key's *usage* is its requests' running time divided by its configured weight, running
  requests counting as they run;
- a free slot goes to the waiting key below `soft_max_inflight_per_key` with the least usage, and
  only when every waiting key is at or above it, to the one with the least usage anyway (soft);
- a key that becomes active starts level with the least-used active key, so it is not penalised
  for work the others did alone, and they are not penalised for having worked alone;
- an idle key's usage is remembered for `idle_state_ttl_s`, then forgotten (and, beyond
  `max_idle_keys` idle keys, the longest idle is forgotten first: clients may make keys up);
- `max_pending_per_key` and `max_pending_per_executor` bound waiting (not running) requests;
- a running request is never preempted.

Priority classes (`classes`, in a strict order: issue 44): every request belongs to one, and a
free slot goes to the highest class with work waiting; inside a class, the rules above hold, a key
being a key of its class (the same fairness key in two classes is two keys). A class with
`max_wait_s` is never starved past it: a request of it that has waited that long takes the next
free slot before any other (the oldest such first), so its wait is bounded by `max_wait_s` plus
one request's service time however busy the classes above it are.

One addition, off unless `anticipation_ms` is set: a client that sends one request after another
(an interactive UI) is idle for a moment between them, and without anticipation a flood from
another key takes its slot in that moment, so each of its requests waits for a slot to free again.
With anticipation, the slot of a key that finished below its soft max, while others wait, is held
for that key for `anticipation_ms`; if it does not come back in time the slot goes to the others.

Cost: an event costs O(G + log K) (amortized) for K active keys, G being the number of distinct (class,
running count, weight) triples among them. A key's usage grows with time at the rate running/weight,
so no single order by usage holds for long; but keys with the same running count and weight keep
their order between events (usage = offset + rate * now, same rate), so each such group is a heap by
offset, and the next key is the best of the G group tops (the class ranks first). Running counts add
up to at most the capacity, so G stays small (at most about sqrt(2 * capacity) per weight and class)
however many keys wait.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping

ANONYMOUS = ""
MAX_KEY_LENGTH = 128
# Completions remembered to measure how fast the queue drains (for Retry-After).
DRAIN_WINDOW = 64
# Keys the admin view lists (the most active); it gives the counts of all of them besides.
KEYS_SHOWN = 20


DEFAULT_CLASS = "default"


@dataclass(frozen=True)
class PriorityClass:
    name: str
    max_wait_s: float | None = None   # the aging bound; None: it waits as long as higher classes are busy


# engine.fairness.classes when unset: a request without a tenant (or of a tenant without `priority`)
# is `default`; the Batch API's lines are `batch`.
DEFAULT_CLASSES = (PriorityClass("interactive"), PriorityClass(DEFAULT_CLASS), PriorityClass("batch", 600.0))


@dataclass(frozen=True)
class FairnessPolicy:
    default_weight: float = 1.0
    weights: Mapping[str, float] = field(default_factory=dict)
    soft_max_inflight_per_key: int = 1
    max_pending_per_key: int = 32
    max_pending_per_executor: int = 128
    idle_state_ttl_s: float = 300.0
    anticipation_ms: float = 0.0
    max_idle_keys: int = 1000
    # "fifo" turns fairness off (one shared queue): for comparison in benchmarks only.
    mode: str = "fair"
    classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES   # highest first

    @classmethod
    def from_settings(cls, raw: Mapping[str, object]) -> "FairnessPolicy":
        known: dict[str, object] = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        if "classes" in known:
            known["classes"] = tuple(PriorityClass(str(c["name"]), c.get("max_wait_s"))
                                     for c in known["classes"])   # type: ignore[attr-defined]
        return cls(**known)  # type: ignore[arg-type]

    def rank(self, name: str) -> int:
        """A class's place in the order (0: the highest); ValueError for a class not configured."""
        for rank, each in enumerate(self.classes):
            if each.name == name:
                return rank
        raise ValueError(f"no priority class {name!r}")

    @property
    def default_rank(self) -> int:
        return self.rank(DEFAULT_CLASS)

    def weight(self, key: str) -> float:
        return float(self.weights.get(key, self.default_weight))


class QueueFull(Exception):
    """The request was refused: answer 429 with `code` and `retry_after` seconds."""

    def __init__(self, code: str, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


def normalize_key(key: object) -> str:
    """Trimmed and at most 128 characters; no key (or a blank one) is the anonymous queue."""
    if not isinstance(key, str):
        return ANONYMOUS
    return key.strip()[:MAX_KEY_LENGTH]


@dataclass(eq=False)
class _Key:
    name: str
    weight: float
    rank: int = 0                  # its priority class's place (FairnessPolicy.classes)
    queue: deque[Hashable] = field(default_factory=deque)
    running: dict[Hashable, float] = field(default_factory=dict)   # request -> start time
    used: float = 0.0              # weighted seconds of finished work (and the level-up offset)
    idle_since: float | None = None
    started_sum: float = 0.0       # sum of the running requests' starts, relative to the scheduler's epoch
    version: int = 0               # bumped on every change; heap entries of older versions are stale

    def usage(self, now: float) -> float:
        return self.used + sum(now - start for start in self.running.values()) / self.weight

    def offset(self) -> float:
        """usage(now) = offset() + len(running) / weight * (now - epoch): constant between events."""
        return self.used - self.started_sum / self.weight

    @property
    def ident(self) -> tuple[int, str]:
        return self.rank, self.name

    @property
    def group(self) -> tuple[int, int, float]:
        return self.rank, len(self.running), self.weight

    @property
    def active(self) -> bool:
        return bool(self.queue or self.running)


# Heap entries: (offset, tie-break, unique sequence number, key version, key).
_Entry = tuple[float, int, int, int, _Key]


class FairScheduler:
    def __init__(self, policy: FairnessPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self.capacity = 0
        self._epoch = clock()
        self._keys: dict[tuple[int, str], _Key] = {}      # (class rank, fairness key) -> its state
        self._where: dict[Hashable, _Key] = {}          # every queued or running request -> its key
        self._arrival: dict[Hashable, int] = {}         # queued request -> arrival number
        self._seq = itertools.count()
        self._completions: deque[float] = deque(maxlen=DRAIN_WINDOW)
        self._held: dict[tuple[int, str], float] = {}   # key -> until when a slot is held for it
        # Per class (by rank): its queued requests in arrival order, each with when it came (aging),
        # and how many of its requests run.
        self._since: list[dict[Hashable, float]] = [{} for _ in policy.classes]
        self._class_running = [0] * len(policy.classes)
        self._running = 0
        self._active = 0                                # keys with work queued or running
        self._idle: OrderedDict[tuple[int, str], None] = OrderedDict()   # idle keys, longest idle first
        # Per (class, running count, weight) group: keys with work waiting, by (offset, head arrival),
        # and every active key, by offset (for the level-up of a key that becomes active).
        self._waiting_groups: dict[tuple[int, int, float], list[_Entry]] = {}
        self._active_groups: dict[tuple[int, int, float], list[_Entry]] = {}
        self._entries = 0
        self._entry_seq = itertools.count()

    # -- state -----------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._arrival)

    def is_running(self, request: Hashable) -> bool:
        key = self._where.get(request)
        return key is not None and request in key.running

    def keys(self, limit: int | None = KEYS_SHOWN) -> dict[str, dict[str, float | str]]:
        """The most active keys (running plus waiting, then the most recently idle), at most `limit`."""
        now = self.clock()
        chosen = self._keys.values() if limit is None else heapq.nlargest(
            limit, self._keys.values(),
            key=lambda k: (len(k.running) + len(k.queue), k.idle_since if k.idle_since is not None else now))
        classes, default = self.policy.classes, self.policy.default_rank
        # A key of the default class by its name alone (as before classes), another with its class's.
        return {k.name if k.rank == default else f"{k.name} [{classes[k.rank].name}]":
                {"active": len(k.running), "waiting": len(k.queue), "weight": k.weight,
                 "usage_s": round(k.usage(now), 3), "class": classes[k.rank].name}
                for k in chosen}

    def classes(self) -> dict[str, dict[str, float | None]]:
        """Per priority class, highest first: requests running and waiting, the oldest one's wait."""
        now = self.clock()
        return {c.name: {"running": self._class_running[rank], "waiting": len(self._since[rank]),
                         "oldest_wait_s": round(now - next(iter(self._since[rank].values()), now), 3),
                         "max_wait_s": c.max_wait_s}
                for rank, c in enumerate(self.policy.classes)}

    def key_counts(self) -> dict[str, int]:
        """How many keys are remembered, and how many of them have work queued or running."""
        return {"total": len(self._keys), "active": self._active}

    def drain_rate(self) -> float | None:
        """Completions per second over the recent window, or None before there is a measure."""
        if len(self._completions) < 2:
            return None
        span = self._completions[-1] - self._completions[0]
        return (len(self._completions) - 1) / span if span > 0 else None

    def retry_after(self, ahead: int) -> float:
        """Seconds until `ahead` more requests have drained at the measured rate."""
        rate = self.drain_rate()
        if rate is None:
            # Nothing has finished yet: assume each slot frees once a second.
            rate = float(max(1, self.capacity))
        return max(1.0, ahead / rate)

    # -- events ----------------------------------------------------------------------------------

    def submit(self, request: Hashable, key: str = ANONYMOUS, rank: int | None = None) -> list[Hashable]:
        """Queue a request of priority class `rank` (FairnessPolicy.rank; None: the default class);
        raise QueueFull if it may not wait. Returns the requests to start now."""
        if request in self._where:
            raise ValueError(f"request {request!r} submitted twice")
        now = self.clock()
        self._forget_idle(now)
        if rank is None:
            rank = self.policy.default_rank
        if self.policy.mode == "fifo":
            key, rank = ANONYMOUS, self.policy.default_rank
        ident = (rank, key)
        # A new key is remembered only once its request is queued: refused ones leave no trace.
        state = self._keys.get(ident) or _Key(key, self.policy.weight(key), rank)
        must_wait = self.waiting > 0 or self.running + len(self._held) >= self.capacity
        if must_wait:
            if len(state.queue) >= self.policy.max_pending_per_key:
                raise QueueFull("fairness_key_queue_full",
                                f"fairness key {key or '(none)'!r} already has {len(state.queue)} requests waiting",
                                self.retry_after(len(state.queue) * max(1, self._active)))
            if self.waiting >= self.policy.max_pending_per_executor:
                # What goes before it: the waiting requests of its class and the classes above.
                ahead = sum(len(self._since[r]) for r in range(rank + 1))
                raise QueueFull("executor_queue_full",
                                f"{self.waiting} requests are already waiting for this model ({ahead} of them in "
                                f"class {self.policy.classes[rank].name!r} or above)",
                                self.retry_after(max(1, ahead)))
        if not state.active:
            self._level_up(state, now)
            state.idle_since = None
            self._idle.pop(ident, None)
            self._keys[ident] = state
            self._active += 1
        if not must_wait:
            # Nobody waits and a place no key holds is free: it starts now, as _dispatch would start
            # it (taking back its key's held slot, if it has one), without queueing it first. The
            # common case under light load, and once per request.
            self._held.pop(ident, None)
            self._where[request] = state
            self._start_running(state, request, now)
            return [request]
        state.queue.append(request)
        self._where[request] = state
        self._arrival[request] = next(self._seq)
        self._since[rank][request] = now
        self._changed(state)
        return self._dispatch(now)

    def cancel(self, request: Hashable) -> list[Hashable]:
        """The client went away. A waiting request leaves its queue; a running one ends (its
        running time still counts to its key). Returns the requests to start now."""
        state = self._where.get(request)
        if state is None:
            return []
        now = self.clock()
        if request in state.running:
            return self._finish(state, request, now, completed=False)
        state.queue.remove(request)
        del self._where[request]
        del self._arrival[request]
        del self._since[state.rank][request]
        self._changed(state)
        self._maybe_idle(state, now)
        return self._dispatch(now)

    def done(self, request: Hashable) -> list[Hashable]:
        state = self._where.get(request)
        if state is None or request not in state.running:
            return []
        return self._finish(state, request, self.clock(), completed=True)

    def tick(self) -> list[Hashable]:
        """Time has passed: held slots may have expired. Returns the requests to start now."""
        return self._dispatch(self.clock())

    def next_wakeup(self) -> float | None:
        """When the earliest held slot expires (so the caller can `tick` then), or None."""
        return min(self._held.values(), default=None)

    def set_capacity(self, capacity: int) -> list[Hashable]:
        self.capacity = max(0, capacity)
        return self._dispatch(self.clock())

    def drop_waiting(self) -> list[Hashable]:
        """Remove and return every waiting request (the model is going away); running ones stay."""
        dropped = sorted(self._arrival, key=self._arrival.__getitem__)
        now = self.clock()
        for request in dropped:
            state = self._where.pop(request)
            state.queue.remove(request)
            del self._arrival[request]
            del self._since[state.rank][request]
            self._changed(state)
            self._maybe_idle(state, now)
        return dropped

    # -- internals -------------------------------------------------------------------------------

    def _finish(self, state: _Key, request: Hashable, now: float, completed: bool) -> list[Hashable]:
        start = state.running.pop(request)
        self._running -= 1
        self._class_running[state.rank] -= 1
        state.started_sum -= start - self._epoch
        del self._where[request]
        state.used += (now - start) / state.weight
        if not state.running:
            state.started_sum = 0.0   # no rounding left over from the additions and removals
        if completed:
            self._completions.append(now)
        # Never held from a class above it: a slot is held for a key against its own class's flood.
        anticipate = self.policy.anticipation_ms > 0 and not state.queue \
            and len(state.running) < self.policy.soft_max_inflight_per_key and self._arrival \
            and not any(self._since[rank] for rank in range(state.rank))
        if anticipate:
            self._held[state.ident] = now + self.policy.anticipation_ms / 1000
        self._changed(state)
        self._maybe_idle(state, now)
        return self._dispatch(now)

    def _dispatch(self, now: float) -> list[Hashable]:
        for name in [n for n, until in self._held.items() if until <= now or n not in self._keys]:
            del self._held[name]
        started = []
        while self._running < self.capacity and self._arrival:
            # A key whose slot is held takes it back; everyone else shares what is not held.
            owners = [self._keys[n] for n in self._held if self._keys[n].queue]
            if owners:
                state = owners[0]
                del self._held[state.ident]
            elif self._running + len(self._held) < self.capacity:
                state = self._aged(now) or self._next_key(now)
            else:
                break
            request = state.queue.popleft()
            del self._arrival[request]
            del self._since[state.rank][request]
            self._start_running(state, request, now)
            started.append(request)
        return started

    def _start_running(self, state: _Key, request: Hashable, now: float) -> None:
        state.running[request] = now
        state.started_sum += now - self._epoch
        self._running += 1
        self._class_running[state.rank] += 1
        self._changed(state)

    def _aged(self, now: float) -> _Key | None:
        """The key of the oldest request that has waited its class's `max_wait_s`, if one has: it
        is the first of its key's queue (a key's queue is in arrival order)."""
        oldest: tuple[float, Hashable] | None = None
        for rank, each in enumerate(self.policy.classes):
            if each.max_wait_s is None or not self._since[rank]:
                continue
            request, since = next(iter(self._since[rank].items()))
            if now - since >= each.max_wait_s and (oldest is None or since < oldest[0]):
                oldest = since, request
        return self._where[oldest[1]] if oldest is not None else None

    def _next_key(self, now: float) -> _Key:
        """The waiting key with the best rank: the best of each group's top."""
        best: _Key | None = None
        best_rank: tuple[int, bool, float, int] | None = None
        for group in list(self._waiting_groups):
            top = self._top(self._waiting_groups, group)
            if top is None:
                continue
            rank = self._rank(top, now)
            if best_rank is None or rank < best_rank:
                best, best_rank = top, rank
        assert best is not None, "a request waits but no key holds it"
        return best

    def _top(self, groups: dict[tuple[int, int, float], list[_Entry]], group: tuple[int, int, float]) -> _Key | None:
        """The first live key of a group's heap, dropping stale entries on the way (or the group)."""
        heap = groups[group]
        while heap:
            entry = heap[0]
            if entry[3] == entry[4].version:
                return entry[4]
            heapq.heappop(heap)
            self._entries -= 1
        del groups[group]
        return None

    def _changed(self, state: _Key) -> None:
        """Record a key's new standing: older heap entries go stale, current ones are pushed."""
        state.version += 1
        if state.active:
            offset = state.offset()
            self._push(self._active_groups, state, (offset, 0))
            if state.queue:
                self._push(self._waiting_groups, state, (offset, self._arrival[state.queue[0]]))
        # Stale entries are dropped lazily at the tops; rebuild when they outnumber live ones.
        if self._entries > 4 * (self._active + 16):
            self._rebuild()

    def _push(self, groups: dict[tuple[int, int, float], list[_Entry]], state: _Key, order: tuple[float, int]) -> None:
        heapq.heappush(groups.setdefault(state.group, []),
                       (order[0], order[1], next(self._entry_seq), state.version, state))
        self._entries += 1

    def _rebuild(self) -> None:
        self._waiting_groups, self._active_groups, self._entries = {}, {}, 0
        for state in self._keys.values():
            if state.active:
                state.version += 1
                offset = state.offset()
                self._push(self._active_groups, state, (offset, 0))
                if state.queue:
                    self._push(self._waiting_groups, state, (offset, self._arrival[state.queue[0]]))

    def _rank(self, state: _Key, now: float) -> tuple[int, bool, float, int]:
        over_soft_max = len(state.running) >= self.policy.soft_max_inflight_per_key
        return state.rank, over_soft_max, state.usage(now), self._arrival[state.queue[0]]

    def _level_up(self, state: _Key, now: float) -> None:
        # Level with its own class: the usage of another class's keys is no measure of this one's.
        tops = [self._top(self._active_groups, g) for g in list(self._active_groups) if g[0] == state.rank]
        others = [k.usage(now) for k in tops if k is not None and k is not state]
        if others:
            state.used = max(state.used, min(others))

    def _maybe_idle(self, state: _Key, now: float) -> None:
        if not state.active and state.idle_since is None:
            state.idle_since = now
            self._active -= 1
            self._idle[state.ident] = None
            while len(self._idle) > self.policy.max_idle_keys:
                self._forget(next(iter(self._idle)))

    def _forget_idle(self, now: float) -> None:
        ttl = self.policy.idle_state_ttl_s
        while self._idle:
            ident = next(iter(self._idle))
            since = self._keys[ident].idle_since
            if since is not None and now - since < ttl:
                break
            self._forget(ident)

    def _forget(self, ident: tuple[int, str]) -> None:
        del self._idle[ident]
        del self._keys[ident]
