"""The fairness scheduler's rules, each with a fake clock and no sleeping."""
from __future__ import annotations

import pytest

from proxy.fairness import ANONYMOUS, FairnessPolicy, FairScheduler, QueueFull, normalize_key


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def scheduler(capacity: int, **policy: object) -> tuple[FairScheduler, Clock]:
    clock = Clock()
    sched = FairScheduler(FairnessPolicy(**policy), clock)  # type: ignore[arg-type]
    sched.set_capacity(capacity)
    return sched, clock


def test_a_lone_key_uses_every_slot() -> None:
    sched, _ = scheduler(4, max_pending_per_key=100)
    started = [r for i in range(10) for r in sched.submit(("batch", i), "batch")]
    assert started == [("batch", i) for i in range(4)]
    assert sched.running == 4 and sched.waiting == 6


def test_same_key_keeps_arrival_order() -> None:
    sched, _ = scheduler(1)
    for i in range(4):
        sched.submit(i, "k")
    order = [r for i in range(4) for r in sched.done(i)]
    assert order == [1, 2, 3]


def test_interactive_request_takes_the_next_free_slot_behind_a_flood() -> None:
    sched, clock = scheduler(4, max_pending_per_key=200, max_pending_per_executor=200)
    for i in range(104):
        sched.submit(("batch", i), "batch")
    clock.advance(5)
    assert sched.submit("ui-1", "ui") == []           # running batch work is not interrupted
    assert sched.done(("batch", 0)) == ["ui-1"]        # ...but the next free slot is the UI's
    assert sched.done(("batch", 1)) == [("batch", 4)]  # no one else waits: batch takes it again


def test_newcomer_is_not_penalised_for_solo_work_nor_is_the_soloist() -> None:
    sched, clock = scheduler(1, max_pending_per_key=100)
    sched.submit("a0", "a")
    for i in range(1, 20):
        sched.submit(f"a{i}", "a")
    clock.advance(1000)                   # a works alone for a long time
    sched.submit("b0", "b")
    sched.submit("b1", "b")
    # From now on they alternate: b does not get 1000 s of catching up, a is not starved.
    got = []
    current = "a0"
    for _ in range(4):
        clock.advance(1)
        (current,) = sched.done(current)
        got.append(current)
    assert got == ["b0", "a1", "b1", "a2"]


@pytest.mark.parametrize("weights, expected_a_share", [({"a": 1.0, "b": 1.0}, 0.5), ({"a": 2.0, "b": 1.0}, 2 / 3)])
def test_weights_split_running_time(weights: dict[str, float], expected_a_share: float) -> None:
    # Capacity above keys x soft_max: the soft max is met for both and the weights decide.
    sched, clock = scheduler(4, weights=weights, max_pending_per_key=10_000, max_pending_per_executor=10_000)
    running = {}
    for i in range(3000):
        for key in ("a", "b"):
            running.update((r, clock.now) for r in sched.submit((key, i), key))
    busy = {"a": 0.0, "b": 0.0}
    for _ in range(3000):
        clock.advance(0.5)
        oldest = min(running, key=running.__getitem__)
        busy[oldest[0]] += clock.now - running.pop(oldest)
        for r in sched.done(oldest):
            running[r] = clock.now
    share = busy["a"] / (busy["a"] + busy["b"])
    assert share == pytest.approx(expected_a_share, abs=0.02)


def test_soft_max_yields_to_a_waiting_key_but_is_not_a_hard_limit() -> None:
    sched, _ = scheduler(2, soft_max_inflight_per_key=1)
    sched.submit("a0", "a")
    sched.submit("a1", "a")                    # alone: a may use both slots
    assert sched.running == 2
    sched.submit("a2", "a")
    sched.submit("b0", "b")
    assert sched.done("a0") == ["b0"]          # a is at its soft max, b below it


def test_queue_limits_count_waiting_work_only() -> None:
    sched, _ = scheduler(2, max_pending_per_key=2, max_pending_per_executor=3)
    for i in range(4):
        sched.submit(("a", i), "a")            # 2 run, 2 wait
    with pytest.raises(QueueFull) as info:
        sched.submit(("a", 4), "a")
    assert info.value.code == "fairness_key_queue_full" and info.value.retry_after >= 1
    sched.submit(("b", 0), "b")                # executor now holds 3 waiting
    with pytest.raises(QueueFull) as info:
        sched.submit(("c", 0), "c")
    assert info.value.code == "executor_queue_full"


def test_retry_after_follows_the_measured_drain_rate() -> None:
    sched, clock = scheduler(1, max_pending_per_key=3, max_pending_per_executor=100)
    for i in range(12):
        sched.submit(i, "k") if i < 4 else None
    finished = 0
    for i in range(3):
        clock.advance(0.5)                     # one completion every 0.5 s: 2 per second
        sched.done(finished)
        finished += 1
        sched.submit(100 + i, "k")
    with pytest.raises(QueueFull) as fast:
        sched.submit(999, "k")
    sched2, clock2 = scheduler(1, max_pending_per_key=3, max_pending_per_executor=100)
    for i in range(4):
        sched2.submit(i, "k")
    for i in range(3):
        clock2.advance(5.0)                    # one completion every 5 s
        sched2.done(i)
        sched2.submit(100 + i, "k")
    with pytest.raises(QueueFull) as slow:
        sched2.submit(999, "k")
    assert slow.value.retry_after == pytest.approx(10 * fast.value.retry_after)


def test_cancel_while_waiting_leaves_the_queue() -> None:
    sched, _ = scheduler(1)
    sched.submit("r0", "a")
    sched.submit("gone", "b")
    sched.submit("r2", "c")
    assert sched.cancel("gone") == []
    assert sched.waiting == 1
    assert sched.done("r0") == ["r2"]


def test_cancel_while_running_frees_the_slot_and_still_counts_time() -> None:
    sched, clock = scheduler(1, max_pending_per_key=10)
    sched.submit("a0", "a")
    sched.submit("a1", "a")
    clock.advance(10)
    assert sched.cancel("a0") == ["a1"]
    assert sched.keys()["a"]["usage_s"] == pytest.approx(10.0)


def test_capacity_changes_start_waiting_work() -> None:
    sched, _ = scheduler(0)
    assert sched.submit("r", "a") == []
    assert sched.set_capacity(1) == ["r"]


def test_idle_key_is_remembered_for_the_ttl_then_forgotten() -> None:
    sched, clock = scheduler(1, idle_state_ttl_s=60)
    sched.submit("a0", "a")
    clock.advance(30)
    sched.done("a0")
    clock.advance(59)
    sched.submit("b0", "b")
    assert "a" in sched.keys()
    clock.advance(1)
    sched.done("b0")
    sched.submit("b1", "b")
    assert "a" not in sched.keys()


def test_keys_are_trimmed_and_bounded() -> None:
    assert normalize_key("  ui  ") == "ui"
    assert normalize_key("x" * 300) == "x" * 128
    assert normalize_key(None) == ANONYMOUS == normalize_key("   ")


def test_fifo_mode_is_one_shared_queue() -> None:
    sched, _ = scheduler(1, mode="fifo")
    sched.submit("b0", "batch")
    sched.submit("b1", "batch")
    sched.submit("u0", "ui")
    assert sched.done("b0") == ["b1"]


def test_anticipation_holds_a_light_keys_slot_for_its_next_request() -> None:
    sched, clock = scheduler(2, anticipation_ms=50, max_pending_per_key=100)
    sched.submit("ui-0", "ui")
    for i in range(10):
        sched.submit(("batch", i), "batch")
    assert sched.done("ui-0") == []                   # held for ui, though batch waits
    assert sched.next_wakeup() == pytest.approx(clock.now + 0.05)
    clock.advance(0.01)
    assert sched.submit("ui-1", "ui") == ["ui-1"]     # ui is back in time: its slot at once


def test_held_slot_goes_to_the_others_when_the_key_does_not_come_back() -> None:
    sched, clock = scheduler(2, anticipation_ms=50, max_pending_per_key=100)
    sched.submit("ui-0", "ui")
    for i in range(10):
        sched.submit(("batch", i), "batch")
    sched.done("ui-0")
    clock.advance(0.049)
    assert sched.tick() == []
    clock.advance(0.002)
    assert sched.tick() == [("batch", 1)]
    assert sched.next_wakeup() is None


def test_no_slot_is_held_for_a_heavy_key_or_when_nobody_waits() -> None:
    sched, _ = scheduler(2, anticipation_ms=50, max_pending_per_key=100)
    sched.submit("ui-0", "ui")
    assert sched.done("ui-0") == [] and sched.next_wakeup() is None      # nobody waits: nothing held
    for i in range(6):
        sched.submit(f"b{i}", "batch")
    assert sched.done("b0") == ["b2"] and sched.next_wakeup() is None    # batch is at its soft max
