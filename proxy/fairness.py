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
- an idle key's usage is remembered for `idle_state_ttl_s`, then forgotten;
- `max_pending_per_key` and `max_pending_per_executor` bound waiting (not running) requests;
- a running request is never preempted.

One addition, off unless `anticipation_ms` is set: a client that sends one request after another
(an interactive UI) is idle for a moment between them, and without anticipation a flood from
another key takes its slot in that moment, so each of its requests waits for a slot to free again.
With anticipation, the slot of a key that finished below its soft max, while others wait, is held
for that key for `anticipation_ms`; if it does not come back in time the slot goes to the others.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Mapping

ANONYMOUS = ""
MAX_KEY_LENGTH = 128
# Completions remembered to measure how fast the queue drains (for Retry-After).
DRAIN_WINDOW = 64


@dataclass(frozen=True)
class FairnessPolicy:
    default_weight: float = 1.0
    weights: Mapping[str, float] = field(default_factory=dict)
    soft_max_inflight_per_key: int = 1
    max_pending_per_key: int = 32
    max_pending_per_executor: int = 128
    idle_state_ttl_s: float = 300.0
    anticipation_ms: float = 0.0
    # "fifo" turns fairness off (one shared queue): for comparison in benchmarks only.
    mode: str = "fair"

    @classmethod
    def from_settings(cls, raw: Mapping[str, object]) -> "FairnessPolicy":
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**known)  # type: ignore[arg-type]

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
    queue: deque[Hashable] = field(default_factory=deque)
    running: dict[Hashable, float] = field(default_factory=dict)   # request -> start time
    used: float = 0.0              # weighted seconds of finished work (and the level-up offset)
    idle_since: float | None = None

    def usage(self, now: float) -> float:
        return self.used + sum(now - start for start in self.running.values()) / self.weight

    @property
    def active(self) -> bool:
        return bool(self.queue or self.running)


class FairScheduler:
    def __init__(self, policy: FairnessPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self.capacity = 0
        self._keys: dict[str, _Key] = {}
        self._where: dict[Hashable, _Key] = {}          # every queued or running request -> its key
        self._arrival: dict[Hashable, int] = {}         # queued request -> arrival number
        self._seq = itertools.count()
        self._completions: deque[float] = deque(maxlen=DRAIN_WINDOW)
        self._held: dict[str, float] = {}               # key -> until when a slot is held for it

    # -- state -----------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return sum(len(k.running) for k in self._keys.values())

    @property
    def waiting(self) -> int:
        return len(self._arrival)

    def is_running(self, request: Hashable) -> bool:
        key = self._where.get(request)
        return key is not None and request in key.running

    def keys(self) -> dict[str, dict[str, float]]:
        now = self.clock()
        return {k.name: {"active": len(k.running), "waiting": len(k.queue), "weight": k.weight,
                         "usage_s": round(k.usage(now), 3)}
                for k in self._keys.values()}

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

    def submit(self, request: Hashable, key: str = ANONYMOUS) -> list[Hashable]:
        """Queue a request; raise QueueFull if it may not wait. Returns the requests to start now."""
        if request in self._where:
            raise ValueError(f"request {request!r} submitted twice")
        now = self.clock()
        self._forget_idle(now)
        if self.policy.mode == "fifo":
            key = ANONYMOUS
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _Key(key, self.policy.weight(key))
        must_wait = self.waiting > 0 or self.running + len(self._held) >= self.capacity
        if must_wait:
            if len(state.queue) >= self.policy.max_pending_per_key:
                active_keys = sum(1 for k in self._keys.values() if k.active)
                raise QueueFull("fairness_key_queue_full",
                                f"fairness key {key or '(none)'!r} already has {len(state.queue)} requests waiting",
                                self.retry_after(len(state.queue) * max(1, active_keys)))
            if self.waiting >= self.policy.max_pending_per_executor:
                raise QueueFull("executor_queue_full",
                                f"{self.waiting} requests are already waiting for this model",
                                self.retry_after(self.waiting))
        if not state.active:
            self._level_up(state, now)
            state.idle_since = None
        state.queue.append(request)
        self._where[request] = state
        self._arrival[request] = next(self._seq)
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
            self._maybe_idle(state, now)
        return dropped

    # -- internals -------------------------------------------------------------------------------

    def _finish(self, state: _Key, request: Hashable, now: float, completed: bool) -> list[Hashable]:
        start = state.running.pop(request)
        del self._where[request]
        state.used += (now - start) / state.weight
        if completed:
            self._completions.append(now)
        anticipate = self.policy.anticipation_ms > 0 and not state.queue \
            and len(state.running) < self.policy.soft_max_inflight_per_key and self._arrival
        if anticipate:
            self._held[state.name] = now + self.policy.anticipation_ms / 1000
        self._maybe_idle(state, now)
        return self._dispatch(now)

    def _dispatch(self, now: float) -> list[Hashable]:
        for name in [n for n, until in self._held.items() if until <= now or n not in self._keys]:
            del self._held[name]
        started = []
        while self.running < self.capacity and self._arrival:
            # A key whose slot is held takes it back; everyone else shares what is not held.
            owners = [self._keys[n] for n in self._held if self._keys[n].queue]
            if owners:
                state = owners[0]
                del self._held[state.name]
            elif self.running + len(self._held) < self.capacity:
                state = min(self._waiting_keys(), key=lambda k: self._rank(k, now))
            else:
                break
            request = state.queue.popleft()
            del self._arrival[request]
            state.running[request] = now
            started.append(request)
        return started

    def _waiting_keys(self) -> Iterator[_Key]:
        return (k for k in self._keys.values() if k.queue)

    def _rank(self, state: _Key, now: float) -> tuple[bool, float, int]:
        over_soft_max = len(state.running) >= self.policy.soft_max_inflight_per_key
        return over_soft_max, state.usage(now), self._arrival[state.queue[0]]

    def _level_up(self, state: _Key, now: float) -> None:
        others = [k.usage(now) for k in self._keys.values() if k.active and k is not state]
        if others:
            state.used = max(state.used, min(others))

    def _maybe_idle(self, state: _Key, now: float) -> None:
        if not state.active:
            state.idle_since = now

    def _forget_idle(self, now: float) -> None:
        ttl = self.policy.idle_state_ttl_s
        for name in [k.name for k in self._keys.values()
                     if k.idle_since is not None and now - k.idle_since >= ttl]:
            del self._keys[name]
