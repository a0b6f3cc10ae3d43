"""The events feed: a bounded ring, ids that only grow, filters, and a log line per event."""
import logging

import pytest

from proxy import events as ev
from proxy.events import Events


def test_record_gives_growing_ids_and_logs_the_message(caplog: pytest.LogCaptureFixture) -> None:
    feed = Events(clock=lambda: 42.0)
    with caplog.at_level(logging.INFO, logger="proxy.events"):
        first = feed.record(ev.UNLOAD, "unloaded c: evicted for s", model="c", reason="evicted", cause="s")
        second = feed.record(ev.HOST_DOWN, "host b stopped answering", host="b", level=logging.WARNING)
    assert (first.id, second.id, feed.last_id) == (1, 2, 2)
    assert first.to_json() == {"id": 1, "time": 42.0, "kind": "unload", "message": "unloaded c: evicted for s",
                               "model": "c", "replica": None, "host": None, "reason": "evicted", "cause": "s",
                               "actor": None}
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "unloaded c: evicted for s"), (logging.WARNING, "host b stopped answering")]


def test_an_unknown_kind_is_a_bug() -> None:
    with pytest.raises(ValueError, match="unknown event kind"):
        Events().record("exploded", "no")


def test_the_ring_keeps_the_newest_and_ids_go_on() -> None:
    feed = Events(capacity=3)
    for i in range(5):
        feed.record(ev.LOAD, f"loaded m{i}", model=f"m{i}")
    assert [e.id for e in feed.since()] == [3, 4, 5]
    assert [e.id for e in feed.since(after=4)] == [5]
    assert feed.since(after=5) == []


def test_filters_and_limit_take_the_newest_matching() -> None:
    feed = Events()
    feed.record(ev.LOAD, "a", model="a")
    feed.record(ev.UNLOAD, "b", model="b")
    feed.record(ev.UNLOAD, "a again", model="a")
    feed.record(ev.CRASH, "a crashed", model="a", replica=0)
    assert [e.message for e in feed.since(model="a")] == ["a", "a again", "a crashed"]
    assert [e.message for e in feed.since(kinds=frozenset({ev.UNLOAD}))] == ["b", "a again"]
    assert [e.message for e in feed.since(model="a", limit=2)] == ["a again", "a crashed"]
    assert feed.since(limit=0) == []
