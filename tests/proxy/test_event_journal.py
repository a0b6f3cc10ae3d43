"""The events feed's journal (proxy/event_journal.py): the record a reload or a restart after a crash
goes on from, ids that never repeat, a file that stays bounded, and a reload's old process that
sends its events on instead of writing them."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from proxy import events as ev
from proxy.event_journal import EventJournal
from proxy.events import Event, Events


def continued(path: Path, capacity: int = 10, feed: Events | None = None) -> Events:
    feed = feed or Events(capacity=capacity, clock=lambda: 7.0)
    journal = EventJournal(path, feed.capacity)
    feed.continue_from(journal.read(), journal)
    return feed


def test_a_new_feed_goes_on_from_the_journal_with_the_same_ids(tmp_path: Path) -> None:
    path = tmp_path / "state" / "events.jsonl"   # the folder is made when first written
    first = continued(path)
    first.record(ev.UNLOAD, "unloaded a: evicted for b", model="a", reason="evicted", cause="b")
    first.record(ev.CRASH, "a crashed", model="a", replica=0)
    second = continued(path)
    assert [e.to_json() for e in second.since()] == [e.to_json() for e in first.since()]
    assert second.record(ev.LOAD, "loaded a", model="a").id == 3
    assert [e.id for e in continued(path).since()] == [1, 2, 3]


def test_events_recorded_before_the_feed_continued_are_numbered_after_the_journal(tmp_path: Path) -> None:
    """A reload's successor records its adoption before it is handed the service (and the journal)."""
    path = tmp_path / "events.jsonl"
    old = continued(path)
    for i in range(3):
        old.record(ev.LOAD, f"loaded m{i}", model=f"m{i}")
    successor = Events(capacity=10)
    successor.record(ev.LOAD, "model m0 loaded (adopted)", model="m0", reason="adopted")
    continued(path, feed=successor)
    assert [(e.id, e.message) for e in successor.since()] == [
        (1, "loaded m0"), (2, "loaded m1"), (3, "loaded m2"), (4, "model m0 loaded (adopted)")]
    assert [e.id for e in continued(path).since()] == [1, 2, 3, 4]   # written, renumbered


def test_the_journal_stays_bounded_and_keeps_the_newest(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    feed = continued(path, capacity=3)
    for i in range(20):
        feed.record(ev.LOAD, f"loaded m{i}")
        assert len(path.read_text().splitlines()) <= 2 * 3
    assert [e.id for e in continued(path, capacity=3).since()] == [18, 19, 20]


def test_a_line_cut_short_by_a_crash_is_skipped_and_the_file_mended(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "events.jsonl"
    feed = continued(path)
    feed.record(ev.LOAD, "loaded a", model="a")
    feed.record(ev.LOAD, "loaded b", model="b")
    with path.open("a") as f:
        f.write('{"id":3,"time":1.0,"kind":"lo')   # killed mid-write
    with caplog.at_level(logging.WARNING, logger="proxy.event_journal"):
        after = continued(path)
    assert [e.message for e in after.since()] == ["loaded a", "loaded b"]
    assert "skipped 1 line(s)" in caplog.text
    after.record(ev.LOAD, "loaded c", model="c")
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == [1, 2, 3]


@pytest.mark.parametrize("line", ["[]", '{"id": 0, "time": 1, "kind": "load", "message": "m"}',
                                  '{"id": 1, "time": "x", "kind": "load", "message": "m"}',
                                  '{"id": 1, "time": 1, "kind": "load", "message": "m", "replica": "0"}',
                                  '{"id": 1, "time": 1, "kind": "load", "message": "m", "model": 5}'])
def test_what_is_not_an_event_is_no_event(line: str) -> None:
    assert Event.from_json(json.loads(line)) is None


def test_a_handed_over_feed_sends_its_events_on_and_the_successor_records_them_with_its_ids(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "events.jsonl"
    old = continued(path)
    old.record(ev.LOAD, "loaded a", model="a")
    sent: list[Event] = []
    old.hand_over(sent.append)
    successor = continued(path)   # as it takes over: the journal is its to write from now on
    drained = old.record(ev.EJECT, "replica 0 of a ejected", model="a", replica=0)
    assert sent == [drained] and len(path.read_text().splitlines()) == 1   # sent, not written
    successor.record(ev.RELOAD, "took over", reason="took_over")
    with caplog.at_level(logging.INFO, logger="proxy.events"):
        got = successor.received(drained.to_json())
        assert successor.received({"id": "x"}) is None
    assert caplog.records == []   # the old process logged it
    assert got is not None and (got.id, got.time, got.message, got.replica) == (3, drained.time, drained.message, 0)
    assert [e.id for e in continued(path).since()] == [1, 2, 3]


def test_a_journal_that_cannot_be_written_leaves_the_feed_working(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="proxy.event_journal"):
        feed = continued(blocker / "events.jsonl")
        feed.record(ev.LOAD, "loaded a", model="a")
        feed.record(ev.LOAD, "loaded b", model="b")
    assert [e.id for e in feed.since()] == [1, 2]
    assert caplog.text.count("cannot write") == 1
