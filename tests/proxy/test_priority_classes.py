"""Priority classes in the fairness scheduler (issue 44): a strict order, fairness by key inside a
class, and the aging bound; each with a fake clock and no sleeping."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.fairness import DEFAULT_CLASSES, FairnessPolicy, FairScheduler, PriorityClass, QueueFull
from fakes import FakeClock

INTERACTIVE, DEFAULT, BATCH = 0, 1, 2


def scheduler(capacity: int, **policy: object) -> tuple[FairScheduler, FakeClock]:
    clock = FakeClock(mono=1000.0)
    sched = FairScheduler(FairnessPolicy(**{"max_pending_per_key": 1000, "max_pending_per_executor": 1000,
                                            **policy}), clock.monotonic)  # type: ignore[arg-type]
    sched.set_capacity(capacity)
    return sched, clock


def test_the_defaults_are_interactive_default_and_a_batch_class_that_ages_at_600_s() -> None:
    policy = FairnessPolicy()
    assert [(c.name, c.max_wait_s) for c in policy.classes] == [("interactive", None), ("default", None),
                                                                ("batch", 600.0)]
    assert policy.default_rank == DEFAULT
    with pytest.raises(ValueError, match="no priority class 'gold'"):
        policy.rank("gold")


def test_a_request_without_a_class_is_default() -> None:
    sched, _ = scheduler(1)
    sched.submit("running", "k")
    sched.submit("d", "k")
    sched.submit("b", "k", BATCH)
    assert sched.done("running") == ["d"]
    assert sched.classes()["default"]["running"] == 1 and sched.classes()["batch"]["waiting"] == 1


def test_a_free_slot_goes_to_the_highest_class_with_work_waiting_whatever_the_arrival_order() -> None:
    sched, clock = scheduler(1)
    sched.submit("first", "x", BATCH)
    for i in range(3):
        sched.submit(f"b{i}", "bulk", BATCH)
    clock.advance(1)
    sched.submit("d0", "svc", DEFAULT)
    sched.submit("i0", "ui", INTERACTIVE)
    sched.submit("d1", "svc", DEFAULT)
    order = []
    current = "first"
    for _ in range(6):
        (current,) = sched.done(current)
        order.append(current)
    assert order == ["i0", "d0", "d1", "b0", "b1", "b2"]


def test_inside_a_class_keys_share_by_weight_as_before() -> None:
    sched, clock = scheduler(1, weights={"gold": 2.0})
    sched.submit("warm", "w", BATCH)
    for i in range(30):
        sched.submit(("gold", i), "gold", BATCH)
        sched.submit(("plain", i), "plain", BATCH)
    current = "warm"
    served = []
    for _ in range(30):
        clock.advance(1)   # every request runs 1 s
        (current,) = sched.done(current)
        served.append(current[0])
    assert served.count("gold") == 20 and served.count("plain") == 10


def test_a_fairness_key_in_two_classes_is_two_keys() -> None:
    sched, clock = scheduler(1)
    sched.submit("warm", "w")
    sched.submit("svc-batch", "svc", BATCH)
    sched.submit("svc-default", "svc", DEFAULT)
    keys = sched.keys()
    assert keys["svc"]["class"] == "default" and keys["svc [batch]"]["class"] == "batch"
    clock.advance(1)
    assert sched.done("warm") == ["svc-default"]   # its own batch request does not hold it back


def test_a_lower_class_that_waited_max_wait_s_takes_the_next_free_slot_under_a_flood() -> None:
    sched, clock = scheduler(2, classes=(PriorityClass("interactive"), PriorityClass("default"),
                                         PriorityClass("batch", 10.0)))
    sched.submit("i-a", "ui", INTERACTIVE)
    sched.submit("i-b", "ui", INTERACTIVE)
    sched.submit("batch", "job", BATCH)
    running, n = ["i-a", "i-b"], 0
    starts: dict[str, float] = {}
    while "batch" not in starts:
        # The flood: more interactive work always waits than the slots can take.
        for _ in range(3):
            sched.submit(f"i{n}", "ui", INTERACTIVE)
            n += 1
        clock.advance(3)   # each request runs 3 s
        done = running.pop(0)
        for started in sched.done(done):
            starts[started] = clock.mono
            running.append(started)
    waited = starts["batch"] - 1000.0
    assert 10.0 <= waited <= 10.0 + 3.0   # max_wait_s, plus one request's service time at most
    assert sched.classes()["interactive"]["waiting"] > 0   # it was still a flood when the batch ran


def test_a_class_without_max_wait_s_waits_while_higher_classes_are_busy() -> None:
    sched, clock = scheduler(1)
    sched.submit("run", "ui", INTERACTIVE)
    sched.submit("d", "svc", DEFAULT)
    current = "run"
    for i in range(50):
        sched.submit(f"i{i}", "ui", INTERACTIVE)
        clock.advance(100)
        (current,) = sched.done(current)
        assert current != "d"


def test_no_slot_is_held_for_a_key_while_a_higher_class_waits() -> None:
    sched, clock = scheduler(1, anticipation_ms=500)
    sched.submit("b0", "job", BATCH)
    sched.submit("i0", "ui", INTERACTIVE)
    sched.submit("b1", "other", BATCH)
    assert sched.done("b0") == ["i0"]
    # The batch key finished below its soft max while interactive work waited: nothing was held for it.
    assert sched.next_wakeup() is None


def test_the_bounds_on_waiting_hold_across_classes() -> None:
    sched, _ = scheduler(1, max_pending_per_key=1, max_pending_per_executor=2)
    sched.submit("run", "a")
    sched.submit("b", "k", BATCH)
    with pytest.raises(QueueFull) as full:
        sched.submit("b2", "k", BATCH)
    assert full.value.code == "fairness_key_queue_full"
    sched.submit("d", "k", DEFAULT)   # the same key of another class has a queue of its own
    with pytest.raises(QueueFull) as full:
        sched.submit("i", "ui", INTERACTIVE)
    assert full.value.code == "executor_queue_full"


def test_fifo_mode_has_one_queue_whatever_the_class() -> None:
    sched, _ = scheduler(1, mode="fifo")
    sched.submit("run", "a")
    sched.submit("b", "k", BATCH)
    sched.submit("i", "ui", INTERACTIVE)
    assert sched.done("run") == ["b"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["arrive", "finish", "tick"]), st.integers(0, 2), st.integers(0, 3),
                          st.floats(0.0, 5.0)), min_size=1, max_size=120))
def test_no_request_of_an_aging_class_waits_past_its_bound_while_a_slot_frees(steps: list) -> None:
    """Whatever arrives and finishes: while a request of the batch class (max_wait_s 4) has waited
    4 s, the next to start is the oldest such request, whatever waits in the classes above."""
    sched, clock = scheduler(2, classes=(*DEFAULT_CLASSES[:2], PriorityClass("batch", 4.0)))
    since: dict[tuple[int, int], float] = {}
    running: list[tuple[int, int]] = []
    n = 0
    for action, rank, key, gap in steps:
        clock.advance(gap)
        if action == "arrive":
            request = (rank, n)
            n += 1
            since[request] = clock.mono
            started = sched.submit(request, f"k{key}", rank)
        elif action == "finish" and running:
            started = sched.done(running.pop(0))
        else:
            started = sched.tick()
        for request in started:
            aged = [r for r in since if r[0] == BATCH and clock.mono - since[r] >= 4.0]
            if aged:   # the oldest of them starts first
                assert request == min(aged, key=since.__getitem__), (request, aged)
            since.pop(request)
            running.append(request)


def test_retry_after_of_a_full_queue_counts_what_waits_in_the_class_and_above() -> None:
    sched, clock = scheduler(1, max_pending_per_executor=6)
    sched.submit("run", "x")
    for i in range(5):
        sched.submit(("b", i), f"k{i}", BATCH)
    clock.advance(10)
    sched.done("run")   # the first batch request runs, 4 wait
    assert sched.is_running(("b", 0))
    sched.submit("i0", "ui", INTERACTIVE)
    sched.submit("i1", "ui2", INTERACTIVE)
    with pytest.raises(QueueFull) as interactive:
        sched.submit("i2", "ui3", INTERACTIVE)
    with pytest.raises(QueueFull) as batch:
        sched.submit(("b", 9), "k9", BATCH)
    assert "2 of them in class 'interactive' or above" in str(interactive.value)
    assert "6 of them in class 'batch' or above" in str(batch.value)
    assert interactive.value.retry_after < batch.value.retry_after
