"""The placement rules (proxy/lifecycle/placement/rules.py), one test each: pure, with the clock an argument."""
from __future__ import annotations

from dataclasses import replace

import pytest

from proxy.lifecycle.placement.rules import COUNT, MIB, Limits, ModelView, plan, room_for

CPU = "cpu"
LIMITS = Limits(budgets={CPU: 100 * MIB}, swap_max_wait_s=10)
NOW = 1000.0


def model(name: str, status: str = "loaded", mib: int = 40, **kw: object) -> ModelView:
    kw.setdefault("resident_s", 3600.0 if status == "loaded" else 0.0)
    return ModelView(name=name, status=status, needs={CPU: mib * MIB}, **kw)  # type: ignore[arg-type]


def cold(name: str, mib: int = 40, waited_s: float = 1.0, **kw: object) -> ModelView:
    kw.setdefault("blocked_s", waited_s)
    return model(name, "cold", mib, waiting=1, waited_s=waited_s, wants_load=True, **kw)


def test_a_load_that_fits_evicts_nothing() -> None:
    assert room_for("c", [model("a"), cold("c")], LIMITS, NOW).evict == ()


def test_the_least_recently_used_idle_model_is_evicted() -> None:
    models = [model("a", last_used=900), model("b", last_used=50), cold("c")]
    assert room_for("c", models, LIMITS, NOW).evict == ("b",)


def test_of_two_idle_about_as_long_the_cheaper_reload_goes() -> None:
    # Idle 950 s and 940 s: about as long; b reloads in 2 s, a in 30 s.
    models = [model("a", last_used=50, reload_s=30), model("b", last_used=60, reload_s=2), cold("c")]
    assert room_for("c", models, LIMITS, NOW).evict == ("b",)
    # Idle 1000 s and 400 s: the least recently used goes, however long it takes to load.
    far_apart = [model("a", last_used=0, reload_s=30), model("b", last_used=600, reload_s=2), cold("c")]
    assert room_for("c", far_apart, LIMITS, NOW).evict == ("a",)


def test_a_busy_model_is_not_evicted_while_an_idle_one_would_do() -> None:
    models = [model("busy", last_used=0, running=1), model("idle", last_used=100), cold("c")]
    assert room_for("c", models, LIMITS, NOW, may_evict_busy=True).evict == ("idle",)


def test_only_busy_models_left_the_load_waits_with_the_numbers() -> None:
    models = [model("a", running=1), model("b", waiting=2), cold("c")]
    room = room_for("c", models, LIMITS, NOW)
    assert room.evict == () and room.blocked is not None and room.too_large is None
    assert room.blocked.as_dict() == {"device": CPU, "needed_mib": 40.0, "free_mib": 20.0, "freeable_mib": 80.0,
                                      "budget_mib": 100.0}
    assert "needs 40.0 MiB, 20.0 MiB free" in room.blocked.describe()


def test_pinned_models_are_never_evicted() -> None:
    models = [model("a", pinned=True, last_used=0), model("b", last_used=100), cold("c")]
    assert room_for("c", models, LIMITS, NOW).evict == ("b",)
    models = [model("a", pinned=True), model("b", pinned=True), cold("c")]
    room = room_for("c", models, LIMITS, NOW)
    assert room.too_large is not None and room.too_large.freeable == 0


def test_a_model_larger_than_its_budget_with_only_pinned_models_is_too_large() -> None:
    assert room_for("huge", [cold("huge", mib=101)], LIMITS, NOW).too_large is not None
    pinned = [model("p", pinned=True, mib=30), cold("big", mib=80)]
    assert room_for("big", pinned, LIMITS, NOW).too_large is not None
    # Without the pin it only has to wait for room (or evict).
    assert room_for("big", [model("p", mib=30), cold("big", mib=80)], LIMITS, NOW).evict == ("p",)


def test_nothing_is_evicted_in_vain() -> None:
    # Evicting the idle one frees 30 of the 60 needed; the busy one is not to be evicted yet.
    models = [model("idle", mib=30), model("busy", mib=50, running=1), cold("c", mib=60)]
    room = room_for("c", models, LIMITS, NOW)
    assert room.evict == () and room.blocked is not None


def test_models_on_other_devices_are_not_evicted_for_memory() -> None:
    limits = Limits(budgets={CPU: 100 * MIB, "gpu0": 100 * MIB})
    models = [ModelView("g", "loaded", {"gpu0": 90 * MIB}, last_used=0), model("a", last_used=10, mib=70),
              cold("c", mib=50)]
    assert room_for("c", models, limits, NOW).evict == ("a",)


def test_an_unlimited_device_fits_anything() -> None:
    assert room_for("c", [model("a", mib=90), cold("c", mib=500)], Limits(), NOW).evict == ()


def test_loads_in_flight_and_unloads_hold_their_memory() -> None:
    models = [model("a", "loading"), model("b", "unloading"), cold("c")]
    room = room_for("c", models, LIMITS, NOW)
    assert room.blocked is not None and room.blocked.freeable == 0


def test_the_count_cap_evicts_like_memory() -> None:
    limits = Limits(max_loaded=2)
    models = [model("a", last_used=5), model("b", last_used=1), cold("c")]
    assert room_for("c", models, limits, NOW).evict == ("b",)
    busy = [model("a", running=1), model("b", running=1), cold("c")]
    room = room_for("c", busy, limits, NOW)
    assert room.blocked is not None and room.blocked.device == COUNT
    assert room.blocked.as_dict() == {"device": COUNT, "max_loaded_models": 2, "loaded": 2, "could_unload": 2}
    remote = replace(cold("r", mib=0), counted=False, needs={})
    assert room_for("r", [*busy, remote], limits, NOW).fits


def test_idle_unload_after_idle_unload_s_and_never_for_a_busy_or_pinned_model() -> None:
    models = [model("old", last_used=0, idle_unload_s=60), model("young", last_used=50, idle_unload_s=60),
              model("busy", last_used=0, idle_unload_s=60, running=1),
              model("pinned", last_used=0, idle_unload_s=60, pinned=True), model("never", last_used=0)]
    out = plan(models, Limits(), now=100)
    assert out.idle_unloads == ["old"]
    assert out.wake_in_s == 10    # young's deadline


def test_the_oldest_waiter_is_planned_first() -> None:
    models = [model("a", last_used=0), cold("young", waited_s=1), cold("old", waited_s=5), model("b", last_used=1)]
    out = plan(models, LIMITS, now=100)
    # old takes a's room (LRU); young then waits: b is idle but a is still unloading, so b alone is not enough.
    assert out.loads[0] == ("old", ("a",))


def test_swap_aware_order_keeps_serving_the_resident_model_until_the_bound() -> None:
    limits = Limits(budgets={CPU: 50 * MIB}, swap_max_wait_s=10)
    resident = model("a", waiting=2, running=1, last_used=99)
    early = plan([resident, cold("b", waited_s=3)], limits, now=100)
    assert early.loads == [] and "b" in early.waiting and early.wake_in_s == 7
    late = plan([resident, cold("b", waited_s=10)], limits, now=100)
    assert late.loads == [("b", ("a",))]
    # Requests that waited long in a queue before (their model was swapped out) have not waited
    # for this room: the bound counts from when the load began to wait for it.
    swapped_back = plan([resident, cold("b", waited_s=30, blocked_s=3)], limits, now=100)
    assert swapped_back.loads == [] and swapped_back.wake_in_s == 7
    # Once a's queue has drained, b takes its place without waiting for the bound.
    drained = plan([replace(resident, waiting=0, running=0), cold("b", waited_s=3)], limits, now=100)
    assert drained.loads == [("b", ("a",))]


def test_a_too_large_model_is_reported_not_loaded() -> None:
    out = plan([cold("huge", mib=200)], LIMITS, now=0)
    assert out.loads == [] and set(out.too_large) == {"huge"}


def test_the_swap_bound_is_never_longer_than_reloading_the_busy_model() -> None:
    limits = Limits(budgets={CPU: 50 * MIB}, swap_max_wait_s=10)
    cheap = model("a", waiting=2, running=1, reload_s=0.5)
    assert plan([cheap, cold("b", waited_s=0.4)], limits, now=100).wake_in_s == pytest.approx(0.1)
    assert plan([cheap, cold("b", waited_s=0.6)], limits, now=100).loads == [("b", ("a",))]
    slow = replace(cheap, reload_s=60)
    assert plan([slow, cold("b", waited_s=9)], limits, now=100).loads == []


def test_a_model_swapped_in_serves_its_queue_for_the_bound_before_it_is_swapped_out_busy() -> None:
    limits = Limits(budgets={CPU: 50 * MIB}, swap_max_wait_s=10)
    fresh = model("a", waiting=3, running=1, resident_s=2)
    out = plan([fresh, cold("b", blocked_s=30)], limits, now=100)
    assert out.loads == [] and out.wake_in_s == 8
    assert plan([replace(fresh, resident_s=10), cold("b", blocked_s=30)], limits, now=100).loads == [("b", ("a",))]


def test_a_model_loaded_less_than_min_residence_is_not_evicted_for_a_load_on_demand() -> None:
    # Before: two models with room for one swapped on every request, each load evicting the other
    # the moment it was loaded (issue 29: 8 evictions in 3 s).
    limits = Limits(budgets={CPU: 50 * MIB}, swap_max_wait_s=10, min_residence_s=5)
    fresh = model("a", resident_s=2, last_used=0)
    out = plan([fresh, cold("b")], limits, now=100)
    assert out.loads == [] and "b" in out.waiting and out.wake_in_s == 3
    assert plan([replace(fresh, resident_s=5), cold("b")], limits, now=100).loads == [("b", ("a",))]
    # The order stays least recently used first: an older idle model used since is not evicted
    # instead of the young one, the load waits; one used less recently makes room at once.
    small = Limits(budgets={CPU: 50 * MIB}, min_residence_s=5)
    assert plan([fresh, model("c", mib=10, last_used=50), cold("b", mib=10)], small, now=100).loads == []
    assert plan([replace(fresh, last_used=60), model("c", mib=10, last_used=50), cold("b", mib=10)], small,
                now=100).loads == [("b", ("c",))]
    # An admin's load is not held by it.
    assert room_for("b", [fresh, cold("b")], limits, now=100).evict == ("a",)


def test_a_busy_model_waits_for_the_longer_of_the_swap_bound_and_min_residence() -> None:
    limits = Limits(budgets={CPU: 50 * MIB}, swap_max_wait_s=2, min_residence_s=8)
    busy = model("a", waiting=2, running=1, resident_s=3)
    out = plan([busy, cold("b", blocked_s=30)], limits, now=100)
    assert out.loads == [] and out.wake_in_s == 5
    assert plan([replace(busy, resident_s=8), cold("b", blocked_s=30)], limits, now=100).loads == [("b", ("a",))]
