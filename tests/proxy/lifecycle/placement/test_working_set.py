"""A working set bigger than the budget (proxy/lifecycle/placement/working_set.py): thrashes, counted
each time and said once per window per set of models, and devices over their budget. Pure, with
the time an argument."""
from __future__ import annotations

from proxy.lifecycle.placement.rules import COUNT, MIB, Limits, ModelView
from proxy.lifecycle.placement.working_set import WorkingSet

CPU = "cpu"
ROOM_FOR_TWO = Limits(budgets={CPU: 100 * MIB})
WINDOW_S = 60.0
NOW = 10_000.0     # wall clock


def view(name: str, status: str = "loaded", mib: int = 40, used_s_ago: float = 1.0, **kw: object) -> ModelView:
    return ModelView(name=name, status=status, needs={CPU: mib * MIB},  # type: ignore[arg-type]
                     last_used=NOW - used_s_ago, **kw)


def swap_in(name: str, evicted: str, resident: str) -> list[ModelView]:
    """The picture as `name` loads, evicting `evicted`, beside `resident`: all three used within seconds."""
    return [view(name, "loading", used_s_ago=0), view(evicted, "unloading"), view(resident, running=1)]


def test_a_model_evicted_and_loaded_again_within_the_window_names_the_models_and_the_budget() -> None:
    watch = WorkingSet(WINDOW_S)
    watch.evicted("a", mono=0.0)                                        # for c, say
    said = watch.swap("a", ("b",), swap_in("a", "b", "c"), ROOM_FOR_TWO, NOW, mono=8.0)
    assert said is not None
    assert (said.model, said.evicts, said.models) == ("a", ("b",), ("a", "b", "c"))
    assert (said.device, said.needed, said.budget) == (CPU, 120 * MIB, 100 * MIB)
    assert said.after_s == 8.0 and watch.counts == {"a": 1}
    assert said.sentence(WINDOW_S) == (
        "model a is loaded again 8.0s after its eviction (thrash_window_s 60), evicting b: the models in use "
        "(a, b, c) need 120.0 MiB together on cpu, more than its budget of 100.0 MiB (a budget of 120.0 MiB "
        "would hold them); each swap is a reload")
    assert watch.recent(mono=8.0 + WINDOW_S) == said and watch.recent(mono=8.1 + WINDOW_S) is None


def test_each_swap_of_the_same_models_is_counted_but_said_once_per_window() -> None:
    watch = WorkingSet(WINDOW_S)
    watch.evicted("a", 0.0)
    assert watch.swap("a", ("b",), swap_in("a", "b", "c"), ROOM_FOR_TWO, NOW, 8.0) is not None
    watch.evicted("b", 8.0)
    assert watch.swap("b", ("c",), swap_in("b", "c", "a"), ROOM_FOR_TWO, NOW, 16.0) is None
    watch.evicted("c", 16.0)
    assert watch.swap("c", ("a",), swap_in("c", "a", "b"), ROOM_FOR_TWO, NOW, 24.0) is None
    assert watch.counts == {"a": 1, "b": 1, "c": 1} and watch.last is not None and watch.last.model == "c"
    # Past the window since it was said: said again.
    watch.evicted("a", 60.0)
    again = watch.swap("a", ("b",), swap_in("a", "b", "c"), ROOM_FOR_TWO, NOW, 70.0)
    assert again is not None and again.models == ("a", "b", "c") and watch.counts["a"] == 2


def test_a_reload_after_the_window_or_one_that_evicts_nothing_is_no_thrash() -> None:
    watch = WorkingSet(WINDOW_S)
    watch.evicted("a", 0.0)
    assert watch.swap("a", ("b",), swap_in("a", "b", "c"), ROOM_FOR_TWO, NOW, 61.0) is None
    watch.evicted("a", 100.0)
    assert watch.swap("a", (), [view("a", "loading"), view("c")], ROOM_FOR_TWO, NOW, 101.0) is None
    assert watch.counts == {}


def test_a_swap_that_evicts_a_model_idle_longer_than_the_window_is_no_thrash() -> None:
    # a, b and c need more than the budget, but b has not been used for ten minutes: what is in
    # use (a and c) fits, and evicting b was the right call.
    watch = WorkingSet(WINDOW_S)
    watch.evicted("a", 0.0)
    views = [view("a", "loading"), view("b", "unloading", used_s_ago=600), view("c")]
    assert watch.swap("a", ("b",), views, ROOM_FOR_TWO, NOW, 8.0) is None


def test_under_a_count_cap_the_thrash_names_the_cap() -> None:
    watch = WorkingSet(WINDOW_S)
    watch.evicted("a", 0.0)
    views = [view("a", "loading", mib=1), view("b", "unloading", mib=1)]
    said = watch.swap("a", ("b",), views, Limits(max_loaded=1), NOW, 5.0)
    assert said is not None and (said.device, said.needed, said.budget) == (COUNT, 2, 1)
    assert "need 2 models loaded together, more than max_loaded_models (1)" in said.sentence(WINDOW_S)


def test_a_window_of_0_says_nothing() -> None:
    watch = WorkingSet(0.0)
    watch.evicted("a", 0.0)
    assert watch.swap("a", ("b",), swap_in("a", "b", "c"), ROOM_FOR_TWO, NOW, 0.0) is None


def test_a_device_over_its_budget_is_said_once_until_it_is_back_within_it() -> None:
    watch = WorkingSet(WINDOW_S)
    over = [view("a", mib=60), view("b", "asleep", mib=30), view("c", "cold", mib=90)]
    (overrun,) = watch.over_budget(over, {CPU: 80 * MIB})
    assert (overrun.device, overrun.held, overrun.budget, overrun.models) == (CPU, 90 * MIB, 80 * MIB, ("a", "b"))
    assert overrun.sentence() == ("device cpu holds 90.0 MiB of loaded models (a, b), 10.0 MiB more than its "
                                  "budget of 80.0 MiB: the next load there first evicts until it fits")
    assert watch.over_budget(over, {CPU: 80 * MIB}) == []
    assert watch.over_budget([view("a", mib=60)], {CPU: 80 * MIB}) == []
    assert [o.device for o in watch.over_budget(over, {CPU: 80 * MIB})] == [CPU]
