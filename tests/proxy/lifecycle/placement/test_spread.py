"""placement.spread: the host of each new replica, by the memory rules (docs/hosts.md)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from proxy.lifecycle.placement.memory import qualify
from proxy.lifecycle.placement.rules import MIB, spread

NEED = {"cpu": 30 * MIB}


def test_a_replica_goes_to_the_host_where_it_fits() -> None:
    budgets = {"a:cpu": 10 * MIB, "b:cpu": 100 * MIB}
    assert spread(1, NEED, ["a", "b"], budgets, budgets, qualify) == ("b",)


def test_two_replicas_land_on_two_hosts_when_both_have_room() -> None:
    budgets = {"a:cpu": 100 * MIB, "b:cpu": 100 * MIB}
    assert sorted(spread(2, NEED, ["a", "b"], budgets, budgets, qualify)) == ["a", "b"]


def test_replicas_share_a_host_when_only_one_has_room() -> None:
    budgets = {"a:cpu": 100 * MIB, "b:cpu": 10 * MIB}
    assert spread(2, NEED, ["a", "b"], budgets, budgets, qualify) == ("a", "a")


def test_a_replica_that_fits_nowhere_goes_to_the_largest_budget_for_room_for_to_judge() -> None:
    budgets = {"a:cpu": 20 * MIB, "b:cpu": 25 * MIB}
    assert spread(1, NEED, ["a", "b"], budgets, budgets, qualify) == ("b",)


def test_unlimited_hosts_take_replicas_in_turn_and_local_devices_keep_their_names() -> None:
    assert spread(3, NEED, ["local", "b"], {}, {}, qualify) == ("local", "b", "local")
    assert qualify("local", "gpu0") == "gpu0" and qualify("b", "gpu0") == "b:gpu0"


# -- properties (hypothesis) ------------------------------------------------------------------------

HOSTS = ("local", "a", "b", "c")
DEVICES = ("cpu", "gpu0", "gpu1")


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, dict[str, int], list[str], dict[str, int], dict[str, int], list[str]]:
    allowed = draw(st.lists(st.sampled_from(HOSTS), min_size=1, max_size=len(HOSTS), unique=True))  # model's hosts
    needs = draw(st.dictionaries(st.sampled_from(DEVICES), st.integers(0, 64).map(lambda n: n * MIB), max_size=2))
    budgets: dict[str, int] = {}
    free: dict[str, int] = {}
    for host in HOSTS:
        for device in DEVICES:
            if draw(st.booleans()):   # a device left out of the budgets does not limit
                q = qualify(host, device)
                budgets[q] = draw(st.integers(0, 128)) * MIB
                free[q] = budgets[q] - draw(st.integers(0, 128)) * MIB   # held by other models (may be over)
    already = draw(st.lists(st.sampled_from(allowed), max_size=3))
    return draw(st.integers(1, 6)), needs, allowed, free, budgets, already


def fits(host: str, needs: dict[str, int], free: dict[str, int], budgets: dict[str, int]) -> bool:
    return all(n <= free.get(qualify(host, d), 0) for d, n in needs.items() if qualify(host, d) in budgets)


@settings(max_examples=500, deadline=None)
@given(cases())
def test_spread_keeps_the_hosts_constraint_the_budgets_and_spreads_before_doubling_up(
        case: tuple[int, dict[str, int], list[str], dict[str, int], dict[str, int], list[str]]) -> None:
    count, needs, allowed, free, budgets, already = case
    picks = spread(count, needs, allowed, free, budgets, qualify, already)
    assert len(picks) == count
    assert set(picks) <= set(allowed)                 # a model's `hosts` always holds
    left, placed = dict(free), list(already)
    for pick in picks:
        fitting = [h for h in allowed if fits(h, needs, left, budgets)]
        if fitting:
            # Where it fits somewhere, it goes where it fits: never over a host's budget.
            assert pick in fitting, (pick, fitting, left)
            # Among the hosts where it fits, one with fewest of the model's replicas: spread first.
            assert placed.count(pick) == min(placed.count(h) for h in fitting), (pick, placed, fitting)
        for device, n in needs.items():
            q = qualify(pick, device)
            if q in budgets:
                left[q] = left.get(q, 0) - n
                if fitting:
                    assert left[q] >= 0
        placed.append(pick)
