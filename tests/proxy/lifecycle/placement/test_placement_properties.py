"""Properties of the placement decision (proxy/lifecycle/placement.plan), on thousands of generated
pools: whatever the models, budgets, usage and queues,

- once its evictions and idle unloads are done, what stays and what it loads fits every budget and
  the count cap (never over budget);
- a pinned model is never evicted nor unloaded for idleness;
- a busy model is evicted only for a load that has waited the swap bound, and only once it has
  been resident that long itself (the bound on reordering);
- a model is evicted for a load on demand only once it has been loaded min_residence_s;
- nothing is evicted for a load that is not made."""
from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from proxy.lifecycle.placement.rules import HOLDING, Limits, ModelView, plan, swap_bound

DEVICES = ("gpu0", "cpu")
GIB = 1024 ** 3


@st.composite
def pools(draw: st.DrawFn) -> tuple[list[ModelView], Limits]:
    budgets = {d: draw(st.integers(1, 16)) * GIB for d in DEVICES if draw(st.booleans())}
    models = []
    for i in range(draw(st.integers(1, 6))):
        status = draw(st.sampled_from(["cold", "cold", "loaded", "loaded", "loading", "unloading"]))
        waiting = draw(st.integers(0, 3))
        models.append(ModelView(
            name=f"m{i}", status=status,
            needs={d: draw(st.integers(0, 12)) * GIB for d in DEVICES if draw(st.booleans())},
            pinned=status == "loaded" and draw(st.booleans()),
            running=draw(st.integers(0, 2)) if status == "loaded" else 0, waiting=waiting,
            waited_s=draw(st.floats(0, 60)), blocked_s=draw(st.floats(0, 60)),
            resident_s=draw(st.floats(0, 60)) if status == "loaded" else 0.0,
            last_used=draw(st.floats(0, 1000)), reload_s=draw(st.none() | st.floats(0.1, 30)),
            idle_unload_s=draw(st.none() | st.floats(1, 600)),
            wants_load=status == "cold" and waiting > 0, counted=draw(st.booleans()) or True))
    cap = draw(st.none() | st.integers(1, 4))
    return models, Limits(budgets=budgets, max_loaded=cap, swap_max_wait_s=draw(st.floats(0, 30)),
                          min_residence_s=draw(st.sampled_from([0.0, 5.0]) | st.floats(0, 60)))


def _fits(models: list[ModelView], limits: Limits) -> bool:
    for d, budget in limits.budgets.items():
        if sum(m.needs.get(d, 0) for m in models) > budget:
            return False
    return limits.max_loaded is None or sum(1 for m in models if m.counted) <= limits.max_loaded


@settings(max_examples=1000, deadline=None)
@given(pools(), st.floats(0, 2000))
def test_a_plan_never_goes_over_budget_evicts_pinned_or_reorders_past_the_bound(
        pool: tuple[list[ModelView], Limits], now: float) -> None:
    models, limits = pool
    holding = [m for m in models if m.status in HOLDING]
    assume(_fits(holding, limits))   # the pool is within its limits before (placement keeps it so)
    by_name = {m.name: m for m in models}
    bound = swap_bound(models, limits)
    out = plan(models, limits, now)

    evicted = {v for _, victims in out.loads for v in victims}
    gone = evicted | set(out.idle_unloads)
    after = [m for m in holding if m.name not in gone and m.status != "unloading"] + \
        [by_name[name] for name, _ in out.loads]
    assert _fits(after, limits), (out, limits)

    for name in gone:
        assert not by_name[name].pinned, f"pinned {name} evicted or unloaded"
        assert by_name[name].status == "loaded"
    for name, victims in out.loads:
        assert by_name[name].wants_load
        for victim in victims:
            v = by_name[victim]
            assert v.resident_s >= limits.min_residence_s, (name, victim, limits.min_residence_s)
            if v.busy:
                assert by_name[name].blocked_s >= bound and v.resident_s >= bound, (name, victim, bound)
    for name in out.idle_unloads:
        m = by_name[name]
        assert not m.busy and m.idle_unload_s is not None and now - m.last_used >= m.idle_unload_s
    assert not (set(out.waiting) | set(out.too_large)) & {n for n, _ in out.loads}


def test_a_last_use_after_now_counts_as_no_idle_time() -> None:
    """The case hypothesis found: the wall clock set back, so a model was last used "after" now.
    Eviction then failed (min() of nothing) and the whole plan with it."""
    idle = ModelView("idle", "loaded", needs={"gpu0": 8 * GIB}, last_used=100.0)
    cold = ModelView("cold", "cold", needs={"gpu0": 8 * GIB}, waiting=1, wants_load=True)
    out = plan([idle, cold], Limits(budgets={"gpu0": 10 * GIB}), now=50.0)
    assert out.loads == [("cold", ("idle",))]
