"""The events feed's journal: the events in a file of the state folder, one JSON object a line, so
that a reload or a restart after a crash keeps the record (proxy/events.py).

Each event is appended with one write(2) as it is recorded (a few hundred bytes into the page cache;
what the kernel has is kept when the proxy is killed). The file stays bounded: once it holds twice
the feed's capacity, it is replaced by the feed's ring (a temporary file renamed over it), at most
once per `capacity` events. Neither fsyncs: on a busy disk an fsync can hold the event loop for
long, and the record is worth less than that (a power loss may take its last events). Reading it
back skips what is not an event, such as a line cut short by a crash.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

from proxy.atomic_file import PRIVATE_MODE, write_atomic
from proxy.events import Event

log = logging.getLogger(__name__)
EVENTS_FILE = "events.jsonl"


class EventJournal:
    """One state folder's events file, holding at least the last `capacity` events."""

    def __init__(self, path: Path, capacity: int) -> None:
        self.path = path
        self.capacity = capacity
        self._fd: int | None = None
        self._lines = 0
        self._failing = False

    def read(self) -> list[Event]:
        """The last `capacity` events of the file, oldest first, their ids growing (none when there is
        no file)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning("events: cannot read %s (%s); the feed starts empty", self.path, exc)
            return []
        events: list[Event] = []
        skipped = 0
        for line in raw.splitlines():
            try:
                event = Event.from_json(json.loads(line))
            except ValueError:
                event = None
            if event is None or (events and event.id <= events[-1].id):
                skipped += 1
                continue
            events.append(event)
        if skipped:
            log.warning("events: skipped %d line(s) of %s that are not events (a line cut short by a crash, say)",
                        skipped, self.path)
        return events[-self.capacity:] if self.capacity > 0 else []

    def rewrite(self, events: Iterable[Event]) -> None:
        """Replace the file with `events`, and append to the new one from now on."""
        text = "".join(_line(e) for e in events)
        self.close()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, text, PRIVATE_MODE, sync=False)
            self._lines = text.count("\n")
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            self._failed(exc)
            return
        self._written()

    def append(self, event: Event, recent: Sequence[Event]) -> None:
        """Add `event`; or, once the file holds 2 x capacity events, replace it with `recent` (the
        feed's ring, `event` included)."""
        if self._fd is None or self._lines >= 2 * self.capacity:
            self.rewrite(recent)
            return
        try:
            os.write(self._fd, _line(event).encode())
        except OSError as exc:
            self._failed(exc)
            return
        self._lines += 1
        self._written()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _failed(self, exc: OSError) -> None:
        # The feed goes on in memory: a full disk must not fail whatever recorded the event.
        if not self._failing:
            log.warning("events: cannot write %s (%s); the feed is kept in memory only until it can", self.path, exc)
        self._failing = True
        self.close()

    def _written(self) -> None:
        if self._failing:
            log.info("events: writing %s again", self.path)
        self._failing = False


def _line(event: Event) -> str:
    return json.dumps(event.to_json(), separators=(",", ":")) + "\n"
