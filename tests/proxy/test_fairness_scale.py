"""The fairness scheduler with many keys: the same decisions as the plain rules, a cost per event
that does not grow with the number of keys, a bound on remembered idle keys, a small admin view."""
from __future__ import annotations

import random
from collections import deque
from typing import Hashable

import pytest

from proxy import fairness
from proxy.fairness import FairnessPolicy, FairScheduler, QueueFull


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ReferenceScheduler:
    """The seed's rules written the obvious way (every decision looks at every key), to check the
    real scheduler's decisions against. No anticipation, no queue limits."""

    def __init__(self, policy: FairnessPolicy, clock: Clock) -> None:
        self.policy, self.clock, self.capacity = policy, clock, 0
        self.queue: dict[str, deque[Hashable]] = {}
        self.running: dict[str, dict[Hashable, float]] = {}
        self.used: dict[str, float] = {}
        self.idle_since: dict[str, float] = {}
        self.arrival: dict[Hashable, int] = {}
        self.key_of: dict[Hashable, str] = {}
        self.seq = 0

    def usage(self, key: str, now: float) -> float:
        return self.used[key] + sum(now - s for s in self.running[key].values()) / self.policy.weight(key)

    def active(self, key: str) -> bool:
        return bool(self.queue[key] or self.running[key])

    def submit(self, request: Hashable, key: str) -> list[Hashable]:
        now = self.clock()
        for k in [k for k, since in self.idle_since.items() if now - since >= self.policy.idle_state_ttl_s]:
            for table in (self.queue, self.running, self.used, self.idle_since):
                del table[k]
        if key not in self.queue:
            self.queue[key], self.running[key], self.used[key] = deque(), {}, 0.0
        if not self.active(key):
            others = [self.usage(k, now) for k in self.queue if k != key and self.active(k)]
            if others:
                self.used[key] = max(self.used[key], min(others))
            self.idle_since.pop(key, None)
        self.queue[key].append(request)
        self.key_of[request], self.arrival[request] = key, self.seq
        self.seq += 1
        return self.dispatch(now)

    def end(self, request: Hashable) -> list[Hashable]:
        now = self.clock()
        key = self.key_of.pop(request)
        if request in self.running[key]:
            start = self.running[key].pop(request)
            self.used[key] += (now - start) / self.policy.weight(key)
        else:
            self.queue[key].remove(request)
            del self.arrival[request]
        if not self.active(key):
            self.idle_since[key] = now
        return self.dispatch(now)

    def set_capacity(self, capacity: int) -> list[Hashable]:
        self.capacity = capacity
        return self.dispatch(self.clock())

    def dispatch(self, now: float) -> list[Hashable]:
        started = []
        while sum(len(r) for r in self.running.values()) < self.capacity and self.arrival:
            soft = self.policy.soft_max_inflight_per_key
            key = min((k for k in self.queue if self.queue[k]),
                      key=lambda k: (len(self.running[k]) >= soft, self.usage(k, now), self.arrival[self.queue[k][0]]))
            request = self.queue[key].popleft()
            del self.arrival[request]
            self.running[key][request] = now
            started.append(request)
        return started


@pytest.mark.parametrize("seed", range(12))
def test_decisions_match_the_plain_rules_under_random_traffic(seed: int) -> None:
    rng = random.Random(seed)
    # Weights and clock steps that are exact in binary, so both sides compute identical floats.
    policy = FairnessPolicy(weights={"k1": 2.0, "k2": 0.5, "k3": 4.0}, soft_max_inflight_per_key=rng.choice([1, 2, 3]),
                            max_pending_per_key=10**6, max_pending_per_executor=10**6, idle_state_ttl_s=6.0,
                            max_idle_keys=10**6)
    clock = Clock()
    real, ref = FairScheduler(policy, clock), ReferenceScheduler(policy, clock)
    assert real.set_capacity(4) == ref.set_capacity(4)
    live: list[Hashable] = []
    for step in range(1500):
        clock.now += rng.choice([0.0, 0.125, 0.25, 1.0])
        roll = rng.random()
        if roll < 0.45 or not live:
            request = ("r", step)
            key = f"k{rng.randrange(12)}"
            got, want = real.submit(request, key), ref.submit(request, key)
            live.append(request)
        elif roll < 0.9:
            request = live.pop(rng.randrange(len(live)))
            if real.is_running(request):
                got, want = real.done(request), ref.end(request)
            else:
                got, want = real.cancel(request), ref.end(request)
        else:
            capacity = rng.randrange(1, 7)
            got, want = real.set_capacity(capacity), ref.set_capacity(capacity)
        assert got == want, f"step {step}"
        assert real.running == sum(len(r) for r in ref.running.values()) and real.waiting == len(ref.arrival)


def _usage_calls_per_event(keys: int, monkeypatch: pytest.MonkeyPatch) -> float:
    sched = FairScheduler(FairnessPolicy(max_pending_per_key=10, max_pending_per_executor=10**6), Clock())
    sched.set_capacity(8)
    for i in range(keys):
        sched.submit((i, 0), f"key{i}")
        sched.submit((i, 1), f"key{i}")
    calls = 0
    original = fairness._Key.usage

    def counted(self: fairness._Key, now: float) -> float:
        nonlocal calls
        calls += 1
        return original(self, now)
    monkeypatch.setattr(fairness._Key, "usage", counted)
    running = deque(r for r in list(sched._where) if sched.is_running(r))
    events = 0
    for n in range(200):
        finished = running.popleft()
        running.extend(sched.done(finished))
        running.extend(sched.submit((finished[0], 2 + n), f"key{finished[0]}"))
        events += 2
    return calls / events


def test_the_work_of_an_event_does_not_grow_with_the_number_of_waiting_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    few = _usage_calls_per_event(20, monkeypatch)
    many = _usage_calls_per_event(2000, monkeypatch)
    assert many <= few + 1, (few, many)   # the plain rules look at all 2,000 keys on every event


def test_idle_keys_are_bounded_longest_idle_forgotten_first() -> None:
    clock = Clock()
    sched = FairScheduler(FairnessPolicy(max_idle_keys=100, idle_state_ttl_s=3600), clock)
    sched.set_capacity(1)
    for i in range(3000):
        clock.now += 0.001
        assert sched.submit(i, f"made-up-{i}") == [i]
        sched.done(i)
    assert sched.key_counts() == {"total": 100, "active": 0}
    assert "made-up-2999" in sched.keys(limit=None) and "made-up-2899" not in sched.keys(limit=None)


def test_a_refused_request_leaves_no_key_behind() -> None:
    sched = FairScheduler(FairnessPolicy(max_pending_per_key=1, max_pending_per_executor=1), Clock())
    sched.set_capacity(1)
    sched.submit("a0", "a")
    sched.submit("a1", "a")
    with pytest.raises(QueueFull):
        sched.submit("b0", "b")
    assert sched.key_counts() == {"total": 1, "active": 1}


def test_the_admin_view_lists_the_most_active_keys_and_counts_them_all() -> None:
    sched = FairScheduler(FairnessPolicy(max_pending_per_key=100, max_pending_per_executor=10**6), Clock())
    sched.set_capacity(1)
    for i in range(3000):
        sched.submit(("one", i), f"k{i}")
    for i in range(5):
        sched.submit(("busy", i), "busy")
    shown = sched.keys()
    assert len(shown) == fairness.KEYS_SHOWN
    assert next(iter(sorted(shown, key=lambda k: -shown[k]["waiting"]))) == "busy"
    assert sched.key_counts() == {"total": 3001, "active": 3001}
