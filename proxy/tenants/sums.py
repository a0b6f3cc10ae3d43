"""What a tenant spent since a time, as far as the ledger file holds it: one connection, and the sums
it keeps so that a call per request stays cheap.

Two windows recur on every request: a budget's period (the same start each time: a month's rows)
and a per-minute limit (a start that moves forward a little each time). Summing either afresh reads
every row in it. Instead a sum is kept with the highest row id it covers (its watermark), and the
next call reads only what changed: the rows written since (a range of the rowid), and for a window
that moved, the rows it left (a range of the (tenant, time) index). Rows are only ever appended, and
written in id order, so a sum with its watermark stays true.
"""
from __future__ import annotations

import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass

Totals = tuple[int, int, int, int, float]    # requests, prompt, cached, output tokens, cost (sums of rows)

# Sums kept per tenant (a budget's, a limit's, spares), most recently used last, and tenants kept.
SUMS_PER_TENANT = 4
TENANTS_KEPT = 1024
# A sum moved forward this many times is read afresh: each move subtracts costs, and floats drift.
MAX_MOVES = 1000

_SUMS = ("COALESCE(SUM(requests), 0), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0), "
         "COALESCE(SUM(output_tokens), 0), COALESCE(SUM(cost), 0.0)")
_TOP = "(SELECT COALESCE(MAX(id), 0) FROM usage)"
_FRESH_SQL = f"SELECT {_SUMS}, {_TOP} FROM usage WHERE tenant = ? AND time >= ?"
# The rows written since a watermark: the unary + keeps the planner on the rowid's range, off the
# (tenant, time) index, whose range would be the whole window again.
_ADDED_SQL = f"SELECT {_SUMS}, {_TOP} FROM usage WHERE id > ? AND +tenant = ? AND +time >= ?"
_LEFT_SQL = f"SELECT {_SUMS} FROM usage WHERE tenant = ? AND time >= ? AND time < ? AND id <= ?"


@dataclass
class _Sum:
    since: float
    watermark: int
    totals: Totals
    moves: int = 0


def _combine(base: Totals, plus: tuple[int, int, int, int, float], sign: int = 1) -> Totals:
    return (base[0] + sign * plus[0], base[1] + sign * plus[1], base[2] + sign * plus[2],
            base[3] + sign * plus[3], base[4] + sign * plus[4])


class DiskSums:
    """`totals(tenant, since)` over the rows on disk, with the highest id they cover. Safe to call
    from any thread: one connection, under a lock."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, list[_Sum]] = OrderedDict()

    def totals(self, tenant: str, since: float, latest: float) -> tuple[int, Totals]:
        """The sums of the tenant's rows on disk with time >= since, and the highest row id on disk
        when they were read (every row at or below it is on disk). `latest`: the latest row time
        known, to judge whether moving a kept sum costs less than reading the window afresh."""
        with self._lock:
            kept = self._kept.get(tenant)
            if kept is None:
                kept = self._kept[tenant] = []
            self._kept.move_to_end(tenant)
            if len(self._kept) > TENANTS_KEPT:
                self._kept.popitem(last=False)
            base = self._nearest(kept, since, latest)
            if base is None:
                found = self._conn.execute(_FRESH_SQL, (tenant, since)).fetchall()[0]
                result = _Sum(since, found[5], (found[0], found[1], found[2], found[3], found[4]))
            elif base.since == since:
                found = self._conn.execute(_ADDED_SQL, (base.watermark, tenant, since)).fetchall()[0]
                result = _Sum(since, found[5], _combine(base.totals, found[:5]), base.moves)
            else:
                # Both reads from one snapshot, or a row written between them would count twice or not at all.
                self._conn.execute("BEGIN")
                try:
                    left = self._conn.execute(_LEFT_SQL, (tenant, base.since, since, base.watermark)).fetchall()[0]
                    found = self._conn.execute(_ADDED_SQL, (base.watermark, tenant, since)).fetchall()[0]
                finally:
                    self._conn.execute("COMMIT")
                result = _Sum(since, found[5], _combine(_combine(base.totals, left, -1), found[:5]), base.moves + 1)
            # A window that moved replaces the sum it moved from: that start is not asked for again.
            if base is not None:
                kept.remove(base)
            kept.append(result)
            if len(kept) > SUMS_PER_TENANT:
                del kept[0]
            return result.watermark, result.totals

    @staticmethod
    def _nearest(kept: list[_Sum], since: float, latest: float) -> _Sum | None:
        """The kept sum to start from: the same window's, or the closest one that starts before it
        where the rows it would leave span less time than the window (else a fresh read is cheaper)."""
        below: _Sum | None = None
        for candidate in kept:
            if candidate.since == since:
                return candidate
            if candidate.since < since and (below is None or candidate.since > below.since):
                below = candidate
        if below is None or below.moves >= MAX_MOVES or since - below.since > latest - since:
            return None
        return below

    def close(self) -> None:
        with self._lock:
            self._conn.close()
