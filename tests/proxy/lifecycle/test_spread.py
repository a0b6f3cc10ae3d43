"""placement.spread: the host of each new replica, by the memory rules (README: Several hosts)."""
from __future__ import annotations

from proxy.lifecycle.memory import qualify
from proxy.lifecycle.placement import MIB, spread

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
