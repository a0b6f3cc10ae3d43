"""Which slot a conversation's requests go to on one llama-server replica."""
from __future__ import annotations

from proxy.lifecycle.state.slots import SlotTable


def test_a_key_keeps_its_slot_and_new_keys_take_the_least_recently_used() -> None:
    table = SlotTable(3)
    a = table.take("a")[0]
    table.release(a)
    b = table.take("b")[0]
    table.release(b)
    assert a != b
    assert table.take("a")[0] == a      # its own slot, while free
    table.release(a)
    c = table.take("c")[0]               # the one slot never used
    assert c not in (a, b)
    table.release(c)
    d = table.take("d")[0]               # then the least recently used: b's
    assert d == b and table.key_of(b) == "d"
    table.release(d)
    assert table.take("b")[0] == a       # b lost its slot; a's is now the least recently used


def test_a_busy_slot_is_never_given_to_a_second_request() -> None:
    table = SlotTable(2)
    first = table.take("a")[0]
    second = table.take("a")[0]          # the same conversation twice at once: another slot
    assert first != second
    assert table.key_of(second) == "a" and table.key_of(first) is None
    table.release(first)
    table.release(second)
    assert table.take("a")[0] == second


def test_a_restore_assigns_a_slot_and_recency_follows_our_requests() -> None:
    table = SlotTable(4)
    table.assign("x", 2)
    assert table.take("x")[0] == 2
    assert table.last_used(2) > 0 and table.last_used(3) == 0.0
    assert table.take("y")[0] == 0


def test_a_restored_slot_is_checked_by_its_conversations_first_request_there_once() -> None:
    table = SlotTable(3)
    table.restored("x", 1)
    assert not table.checked(1)          # no request has run there yet
    slot = table.take("x")[0]
    assert slot == 1 and table.checked(1)
    assert not table.checked(1)          # its answer is the check, once
    table.release(1)
    assert table.take("x")[0] == 1 and not table.checked(1)   # a later turn reads its own cache


def test_a_restored_slot_another_request_reached_first_has_nothing_to_check() -> None:
    table = SlotTable(1)
    table.restored("x", 0)
    assert table.take("y")[0] == 0 and not table.checked(0)   # y's prompt replaced x's cache
    table.release(0)
    assert table.take("x")[0] == 0 and not table.checked(0)


def test_a_second_request_in_a_restored_slot_before_the_first_answered_ends_its_check() -> None:
    table = SlotTable(1)
    table.restored("x", 0)
    table.take("x")
    table.release(0)                     # ended; its answer's usage not counted yet (a translated route)
    table.take("x")                      # the slot now holds what the first request left there
    assert not table.checked(0)
