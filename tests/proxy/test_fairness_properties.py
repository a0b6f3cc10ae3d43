"""Properties of the fairness scheduler (proxy/fairness.FairScheduler) on generated event
sequences with a fake clock:

- it never starts more than the capacity, never starts a request twice, never one that was not
  submitted or was cancelled while waiting; with anticipation on, a held slot is never granted
  twice (held and running together stay within the capacity);
- no key starves: with every key backlogged, each one starts a request within a bounded number of
  completions;
- shares converge to weights: backlogged keys' running times approach the ratio of their weights.
"""
from __future__ import annotations

from collections import Counter
from typing import Hashable

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.fairness import FairnessPolicy, FairScheduler, QueueFull


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


EVENTS = st.lists(st.tuples(st.sampled_from(["submit", "submit", "submit", "done", "cancel", "tick", "capacity",
                                             "wait"]),
                            st.integers(0, 3), st.integers(0, 40), st.floats(0, 0.2)), max_size=120)


@settings(max_examples=600, deadline=None)
@given(EVENTS, st.integers(1, 4), st.sampled_from([0.0, 50.0]), st.integers(1, 3))
def test_no_event_sequence_overfills_or_grants_twice(events: list[tuple[str, int, int, float]], capacity: int,
                                                    anticipation_ms: float, soft_max: int) -> None:
    clock = Clock()
    policy = FairnessPolicy(weights={"k0": 3.0, "k1": 1.0}, soft_max_inflight_per_key=soft_max,
                            max_pending_per_key=8, max_pending_per_executor=20, anticipation_ms=anticipation_ms)
    sched = FairScheduler(policy, clock=clock)
    sched.set_capacity(capacity)
    submitted: set[Hashable] = set()
    cancelled_waiting: set[Hashable] = set()
    started: Counter[Hashable] = Counter()
    running: set[Hashable] = set()
    next_id = 0

    def start(granted: list[Hashable]) -> None:
        for r in granted:
            assert r in submitted and r not in cancelled_waiting
            started[r] += 1
            assert started[r] == 1, f"{r} started twice"
            running.add(r)

    for kind, key, pick, dt in events:
        before = len(started)
        clock.now += dt
        if kind == "submit":
            request = next_id
            next_id += 1
            try:
                submitted.add(request)
                start(sched.submit(request, f"k{key}"))
            except QueueFull:
                submitted.discard(request)
        elif kind in ("done", "cancel") and submitted:
            request = sorted(submitted)[pick % len(submitted)]
            if kind == "done":
                if request in running:
                    running.discard(request)
                    start(sched.done(request))
            else:
                if request not in running and started[request] == 0:
                    cancelled_waiting.add(request)
                running.discard(request)
                start(sched.cancel(request))
        elif kind == "tick":
            start(sched.tick())
        elif kind == "capacity":
            capacity = pick % 5
            start(sched.set_capacity(capacity))
        else:
            clock.now += 0.1
            start(sched.tick())
        assert sched.running == len(running)
        # A capacity that went down leaves what runs running (never preempted), and a slot held for
        # a key stays held until it expires; but whatever starts, starts within the capacity, held
        # slots counted: a held slot is never granted to another key too.
        if len(started) > before:
            assert sched.running + len(sched._held) <= capacity, (sched.running, sched._held, capacity)


def _backlogged(weights: dict[str, float], steps: int, capacity: int = 1) -> tuple[Counter[str], int]:
    """Every key always has requests waiting; each running request takes one time unit. Returns the
    running time each key got, and the longest run of completions a key waited through."""
    clock = Clock()
    sched = FairScheduler(FairnessPolicy(weights=weights, max_pending_per_key=1000, max_pending_per_executor=10000),
                          clock=clock)
    sched.set_capacity(capacity)
    owner: dict[int, str] = {}
    running: list[tuple[float, int]] = []
    got: Counter[str] = Counter()
    since: dict[str, int] = dict.fromkeys(weights, 0)
    longest_wait = 0
    n = 0

    def submit(key: str) -> list[Hashable]:
        nonlocal n
        n += 1
        owner[n] = key
        return sched.submit(n, key)

    def started(granted: list[Hashable]) -> None:
        for r in granted:
            assert isinstance(r, int)
            running.append((clock.now + 1.0, r))
            since[owner[r]] = 0
            started_key = owner[r]
            started_new = submit(started_key)   # it stays backlogged
            started(started_new)

    for key in weights:
        for _ in range(3):
            started(submit(key))
    for _ in range(steps):
        running.sort()
        end, r = running.pop(0)
        clock.now = end
        got[owner[r]] += 1
        for key in since:
            since[key] += 1
            longest_wait = max(longest_wait, since[key])
        started(sched.done(r))
    return got, longest_wait


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d", "e"]), st.sampled_from([0.5, 1.0, 2.0, 4.0]),
                       min_size=2, max_size=5))
def test_backlogged_keys_share_by_weight_and_none_starves(weights: dict[str, float]) -> None:
    got, longest_wait = _backlogged(weights, steps=2000)
    total_weight = sum(weights.values())
    total = sum(got.values())
    for key, weight in weights.items():
        share = got[key] / total
        assert abs(share - weight / total_weight) < 0.05, (key, share, weight / total_weight, dict(got))
    # No key waits through more completions than a full round of the others' weighted turns takes.
    assert longest_wait <= 4 * (total_weight / min(weights.values())) + 8, longest_wait
