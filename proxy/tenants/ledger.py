"""The usage ledger: what every finished request used, and the keys minted for tenants.

A row sums the requests that finished in one second for one tenant and key (a short id, never the
key), on one model, backend and host, with one outcome (the HTTP status) and whether their prompt
count is the proxy's estimate (a stream that ended before the engine's usage came): how many, their
prompt, cached and output tokens, their cost, and how long they queued and ran. Budgets and
per-minute limits are sums over these rows (`spent`), so they survive a restart; the admin's usage
report groups them (`usage`). The keys an admin mints are kept beside them as digests (`add_key`,
`revoke_key`, `keys`).

Why a row per second and not per request: a row per request cost the proxy more CPU than all the
rest of a tenant's checks (a tuple kept per request, its INSERT, and a writer thread taking the GIL
from the event loop thousands of times a second), and grows the file by a row per request (at 1,000
requests a second, 2.6 billion rows a month). Summed by second, a busy tenant is a few rows a
second, and every figure the report and the budgets read is the same sum.

Why SQLite, and one writer thread: the ledger must outlive the process and be queried by time range
and group, and the standard library's sqlite3 does both in one local file with no server to run.
The proxy records from its event loop, where a disk write would stall every request in flight, so
`record()` only adds to a row in memory; one background thread, on its own connection, takes the
rows and writes them in one transaction every `flush_interval_s` (or as soon as BATCH_ROWS are
waiting); a request that finishes after that starts a new row, so a second may be two rows. Reads
run on their own connection; the file is in WAL mode, so they never wait for the writer. A row not
yet written is counted by `spent` and `usage` all the same: each row's id is its place in the order
rows were begun, and a query that reads the highest id on disk in the same snapshot as its sums adds
exactly the rows in memory above it.

What a crash loses: a process killed at any moment (SIGKILL, the OOM killer) loses the requests
recorded since the last write, at most `flush_interval_s` plus one write's time (well under a second by
default); every committed transaction is in the file. With `synchronous=NORMAL` a power cut may also
lose the last transactions since a checkpoint, but never leaves the file inconsistent.

What a bad row or a bad disk does: a request's numbers are checked when it is recorded (a count
that is not an integer in 0..2**31, a cost that is not a finite number >= 0, is logged and taken as
0; see proxy/tenants/rows.py), and a row the file still refuses is logged and skipped, never the
writer thread. A write the file refuses as a whole (a full disk, a read-only or locked file) keeps
its rows and tries again; `failing()` says why meanwhile (the proxy's /ready shows it), and
`close()` names the rows it leaves.

One `SqliteLedger` writes a file: the ids it hands out start past the highest on disk and past where
the last ledger to open the file started (the `writers` table). Two proxies must not share one file
(each has its own state_dir); a reload is the one time two processes write it, and the successor
reads what its predecessor records while it drains with `others()` (the rows below its own ids and
above those it found on disk).

Where one proxy is not enough: proxies that share budgets need one store they all write to, and the
`Ledger` protocol is what they would share. A `PostgresLedger` would implement it with a writer
thread batching `INSERT`s (or `COPY`) into a shared `usage` table as this one does; `spent` would
sum that table (with an index on (tenant, time), or a per-tenant, per-period rollup table updated in
the same transaction, so a month's budget is one row read), plus this proxy's own queued rows, and
accept that other proxies' last second of rows is not yet seen; `keys`/`revoke_key` would live in a
shared `keys` table, and each proxy would learn of a revocation at once through `LISTEN`/`NOTIFY`
(or by re-reading the table every second), since a revoked key must fail on its next request
whichever proxy it reaches.
"""
from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from proxy.tenants.rows import (CACHED as _CACHED, COLUMN as _COLUMN, COST as _COST, DURATION as _DURATION,
                                ESTIMATED as _ESTIMATED, ID as _ID, OUTPUT as _OUTPUT, PROMPT as _PROMPT,
                                QUEUE_WAIT as _QUEUE_WAIT, REQUESTS as _REQUESTS, ROW_ERRORS as _ROW_ERRORS,
                                STATUS as _STATUS,
                                TENANT as _TENANT, TIME as _TIME, Params as _Params, UsageRow as UsageRow,
                                checked as _checked, insert_rows as _insert_rows)
from proxy.tenants.schema import connect, migrate
from proxy.tenants.sums import DiskSums, Totals

log = logging.getLogger(__name__)

# The writer does not wait for the interval once this many rows wait; it is also the most rows one
# transaction takes, so the event loop never waits long for the lock.
BATCH_ROWS = 1000
# How far a newly opened ledger's ids start past the highest on disk and the last ledger's start (see
# SqliteLedger.__init__).
PROCESS_ID_GAP = 2 ** 32
# What `usage` may group by, and how each is read from a row on disk.
GROUP_FIELDS = ("tenant", "model", "day", "key_id", "backend", "host")
_GROUP_SQL = {"tenant": "tenant", "model": "model", "day": "strftime('%Y-%m-%d', CAST(time AS INTEGER), 'unixepoch')",
              "key_id": "key_id", "backend": "backend", "host": "host"}




@dataclass(frozen=True)
class Spent:
    """What a tenant used in a window: the figures budgets and limits compare."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    cost: float

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class MintedKey:
    """A key an admin minted: its digest only; the key itself was shown once and never kept."""

    tenant: str
    key_id: str
    sha256: str
    created: float
    revoked: float | None


class Ledger(Protocol):
    """Where usage and minted keys are kept. Times are passed in, never read from a clock here."""

    def record(self, row: UsageRow) -> None:
        """Add one finished request to its second's row; never blocks (called on the event loop)."""

    def spent(self, tenant: str, since: float) -> Spent:
        """The tenant's requests with time >= since, those not yet written included."""

    def usage(self, start: float | None, end: float | None, group_by: Sequence[str]) -> list[dict[str, Any]]:
        """Rows with start <= time < end (None: unbounded), summed by the `group_by` fields (a subset
        of GROUP_FIELDS; "day" is the UTC date "YYYY-MM-DD"), ordered by them. Each dict holds the
        grouped fields and requests, prompt_tokens, cached_tokens, output_tokens, cost, errors
        (status >= 400), estimated (requests whose prompt count is an estimate), queue_wait_ms and
        duration_ms (sums). ValueError for an unknown field."""

    def others(self) -> list[tuple[str, float, int, int, float]]:
        """Rows another process recorded to the same store since the last call (a reload's
        predecessor while it drains): (tenant, time, requests, tokens, cost) each, oldest first."""

    def failing(self) -> str | None:
        """Why recorded rows cannot be written now (they are kept and tried again), or None."""

    def add_key(self, tenant: str, key_id: str, sha256: str, created: float) -> None:
        """Keep a minted key's digest; ValueError when the id or the digest is taken."""

    def revoke_key(self, tenant: str, key_id: str, revoked: float) -> bool:
        """Revoke a live key; False when the tenant has no such live key."""

    def keys(self) -> list[MintedKey]:
        """Every minted key, revoked ones with `revoked` set."""

    def flush(self) -> None:
        """Wait until every row recorded so far is on disk."""

    def close(self) -> None:
        """Flush and stop writing."""




def _plus(totals: Totals, rows: Iterable[_Params]) -> Totals:
    requests, prompt, cached, output, cost = totals
    for params in rows:
        requests += params[_REQUESTS]
        prompt += params[_PROMPT]
        cached += params[_CACHED]
        output += params[_OUTPUT]
        cost += params[_COST]
    return requests, prompt, cached, output, cost


def _day(t: float) -> str:
    # Whole seconds, as the SQL above reads them, so a row falls on the same day queued or on disk.
    return datetime.fromtimestamp(int(t), timezone.utc).strftime("%Y-%m-%d")


def _group_fields(group_by: Sequence[str]) -> list[str]:
    unknown = [field for field in group_by if field not in GROUP_FIELDS]
    if unknown:
        raise ValueError(f"group_by: unknown field(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(GROUP_FIELDS)}")
    return list(dict.fromkeys(group_by))


class SqliteLedger:
    """The ledger in one SQLite file, written by one background thread (see the module docstring).

    On the caller's thread: `record()` does no I/O; `spent()` reads the file with one or two indexed
    queries over the rows that changed since its last call (tens of microseconds: fine on the event
    loop, per request); `usage()`, `keys()`, `add_key()` and `revoke_key()` open a connection per
    call, and `flush()` and `close()` wait for the writer: on a busy loop, call those in a thread.
    """

    def __init__(self, path: Path, flush_interval_s: float = 0.5) -> None:
        if not flush_interval_s > 0:
            raise ValueError(f"flush_interval_s: must be > 0, not {flush_interval_s!r}")
        self._path = path
        self._flush_interval_s = flush_interval_s
        conn = connect(path)
        try:
            migrate(conn, path)
            # Past every id on disk and every other ledger's start, by a gap no proxy's rows fill:
            # during a reload the old process still records the requests it finishes, on its own
            # sequence, while this one records from here, and neither's ids can meet the other's.
            conn.execute("BEGIN IMMEDIATE")
            try:
                last_id, latest, claimed = conn.execute(
                    "SELECT COALESCE(MAX(id), 0), COALESCE(MAX(time), 0.0), "
                    "(SELECT COALESCE(MAX(base), 0) FROM writers) FROM usage").fetchone()
                base = max(last_id, claimed) + PROCESS_ID_GAP
                conn.execute("INSERT INTO writers (base, opened) VALUES (?, ?)", (base, time.time()))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        finally:
            conn.close()
        # Everything below `_lock` is shared by the callers' thread(s) and the writer; it is held
        # only to move rows in memory, never across I/O.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)      # the writer waits on it
        self._written_cond = threading.Condition(self._lock)   # flush() waits on it
        self._last_id: int = base                         # the id the last recorded row got
        # Rows between the two are another process's: a reload's predecessor, still recording.
        self._others_after, self._own_from = last_id, self._last_id
        self._others_conn: sqlite3.Connection | None = None
        self._latest: float = latest                      # the latest row time recorded
        self._written = last_id                           # the highest id on disk
        # Rows requests are still added to, by their key (second, tenant, key id, model, backend,
        # host, status, estimated), in id order; the writer takes them all at once.
        self._open: dict[tuple[Any, ...], list[Any]] = {}
        self._queue: deque[_Params] = deque()             # taken by the writer, not yet written
        self._unwritten: dict[str, deque[_Params]] = {}   # not yet on disk (open or queued), by tenant, in id order
        self._flush_wanted = 0
        self._attempts = 0
        self._failure: sqlite3.Error | None = None
        self._failing_since: float | None = None
        self._closing = False
        self._writer_done = False
        # `spent` is per request: one connection kept open for it, and the sums it keeps.
        self._sums = DiskSums(connect(path, check_same_thread=False))
        writer_conn = connect(path, check_same_thread=False)
        self._writer = threading.Thread(target=self._write_loop, args=(writer_conn,),
                                        name=f"usage-ledger-writer {path.name}", daemon=True)
        self._writer.start()

    # -- recording (the event loop) ------------------------------------------------------------

    def record(self, row: UsageRow) -> None:
        row = _checked(row)
        (at, tenant, key_id, model, backend, host, status, prompt, cached, output, spent, waited, took,
         estimated) = row
        key = (int(at), tenant, key_id, model, backend, host, status, estimated)
        with self._lock:
            if self._closing:
                raise RuntimeError(f"usage ledger {self._path} is closed")
            sums = self._open.get(key)
            if sums is not None:
                if at > sums[_TIME]:
                    sums[_TIME] = at
                sums[_PROMPT] += prompt
                sums[_CACHED] += cached
                sums[_OUTPUT] += output
                sums[_COST] += spent
                sums[_QUEUE_WAIT] += waited
                sums[_DURATION] += took
                sums[_REQUESTS] += 1
                return
            self._last_id += 1
            sums = self._open[key] = [self._last_id, *row, 1]
            unwritten = self._unwritten.get(tenant)
            if unwritten is None:
                unwritten = self._unwritten[tenant] = deque()
            unwritten.append(sums)
            if at > self._latest:
                self._latest = at
            # The first row starts the writer's interval; a full batch ends it early.
            waiting = len(self._open) + len(self._queue)
            if waiting == 1 or waiting >= BATCH_ROWS:
                self._wake.notify()

    # -- reading -------------------------------------------------------------------------------

    def spent(self, tenant: str, since: float) -> Spent:
        with self._lock:   # copies: record() adds to an open row from another thread
            unwritten = [tuple(p) for p in self._unwritten.get(tenant, ())]
        top, on_disk = self._sums.totals(tenant, since, self._latest)
        # Taken before the query: every row above `top` in it was not on disk when the query ran.
        totals = _plus(on_disk, (p for p in unwritten if p[_ID] > top and p[_TIME] >= since))
        return Spent(*totals)

    def usage(self, start: float | None, end: float | None, group_by: Sequence[str]) -> list[dict[str, Any]]:
        fields = _group_fields(group_by)
        exprs = [_GROUP_SQL[field] for field in fields]
        where: list[str] = []
        params: list[float] = []
        if start is not None:
            where.append("time >= ?")
            params.append(start)
        if end is not None:
            where.append("time < ?")
            params.append(end)
        sql = ("SELECT " + "".join(e + ", " for e in exprs)
               + "COALESCE(SUM(requests), 0), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0), "
                 "COALESCE(SUM(output_tokens), 0), COALESCE(SUM(cost), 0.0), "
                 "COALESCE(SUM((status >= 400) * requests), 0), COALESCE(SUM(queue_wait_ms), 0.0), "
                 "COALESCE(SUM(duration_ms), 0.0), COALESCE(SUM(estimated * requests), 0) FROM usage"
               + (" WHERE " + " AND ".join(where) if where else "")
               + (" GROUP BY " + ", ".join(exprs) if exprs else ""))
        with self._lock:
            unwritten = [tuple(p) for rows in self._unwritten.values() for p in rows]
        conn = connect(self._path)
        try:
            # One read transaction: the highest id and the sums from the same snapshot.
            conn.execute("BEGIN")
            top: int = conn.execute("SELECT COALESCE(MAX(id), 0) FROM usage").fetchone()[0]
            found = conn.execute(sql, params).fetchall()
            conn.execute("COMMIT")
        finally:
            conn.close()
        n = len(fields)
        groups: dict[tuple[str, ...], list[Any]] = {}
        for values in found:
            if values[n]:   # without GROUP BY an empty range still gives one row, of zeros
                groups[tuple(values[:n])] = list(values[n:])
        for p in unwritten:
            t = p[_TIME]
            if p[_ID] <= top or (start is not None and t < start) or (end is not None and t >= end):
                continue
            group = tuple(_day(t) if field == "day" else p[_COLUMN[field]] for field in fields)
            sums = groups.setdefault(group, [0, 0, 0, 0, 0.0, 0, 0.0, 0.0, 0])
            n_requests = p[_REQUESTS]
            for i, value in enumerate((n_requests, p[_PROMPT], p[_CACHED], p[_OUTPUT], p[_COST],
                                       n_requests if p[_STATUS] >= 400 else 0, p[_QUEUE_WAIT], p[_DURATION],
                                       n_requests if p[_ESTIMATED] else 0)):
                sums[i] += value
        # All grouped fields are text: Python's order of str is SQLite's BINARY collation on UTF-8.
        return [{**dict(zip(fields, group)), "requests": sums[0], "prompt_tokens": sums[1],
                 "cached_tokens": sums[2], "output_tokens": sums[3], "cost": float(sums[4]),
                 "errors": sums[5], "estimated": sums[8], "queue_wait_ms": float(sums[6]),
                 "duration_ms": float(sums[7])}
                for group, sums in sorted(groups.items())]

    def others(self) -> list[tuple[str, float, int, int, float]]:
        # A range of the rowid: nothing to read is one seek. Called from one thread (the event loop);
        # closed from another (close() runs in a thread on a busy loop).
        if self._others_conn is None:
            self._others_conn = connect(self._path, check_same_thread=False)
        found = self._others_conn.execute(
            "SELECT id, tenant, time, requests, prompt_tokens + output_tokens, cost FROM usage "
            "WHERE id > ? AND id <= ? ORDER BY id", (self._others_after, self._own_from)).fetchall()
        if not found:
            return []
        self._others_after = found[-1][0]
        return [(tenant, t, requests, tokens, cost) for _, tenant, t, requests, tokens, cost in found]

    def failing(self) -> str | None:
        with self._lock:
            failure, since, queued = self._failure, self._failing_since, len(self._queue) + len(self._open)
        if failure is None or since is None:
            return None
        return (f"the usage ledger {self._path} cannot be written since "
                f"{time.strftime('%H:%M:%S', time.gmtime(since))} UTC ({failure}); {queued} row(s) wait in memory")

    # -- keys ----------------------------------------------------------------------------------

    def add_key(self, tenant: str, key_id: str, sha256: str, created: float) -> None:
        conn = connect(self._path)
        try:
            conn.execute("INSERT INTO keys (tenant, key_id, sha256, created, revoked) VALUES (?, ?, ?, ?, NULL)",
                         (tenant, key_id, sha256, created))
        except sqlite3.IntegrityError:
            raise ValueError(f"tenant {tenant!r}: key id {key_id!r} or its digest is already minted") from None
        finally:
            conn.close()

    def revoke_key(self, tenant: str, key_id: str, revoked: float) -> bool:
        conn = connect(self._path)
        try:
            cursor = conn.execute("UPDATE keys SET revoked = ? WHERE tenant = ? AND key_id = ? AND revoked IS NULL",
                                  (revoked, tenant, key_id))
            return cursor.rowcount == 1
        finally:
            conn.close()

    def keys(self) -> list[MintedKey]:
        conn = connect(self._path)
        try:
            found = conn.execute("SELECT tenant, key_id, sha256, created, revoked FROM keys "
                                 "ORDER BY tenant, created, key_id").fetchall()
        finally:
            conn.close()
        return [MintedKey(*values) for values in found]

    # -- writing (the writer thread) -----------------------------------------------------------

    def flush(self) -> None:
        with self._lock:
            target = self._last_id
            attempts = self._attempts
            self._flush_wanted = max(self._flush_wanted, target)
            self._wake.notify()
            self._written_cond.wait_for(lambda: self._written >= target or self._writer_done
                                        or (self._failure is not None and self._attempts > attempts))
            if self._written < target:
                raise RuntimeError(f"usage ledger {self._path}: {target - self._written} row(s) not written: "
                                   f"{self._failure or 'the writer stopped'}") from self._failure

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._wake.notify()
        self._writer.join()
        self._sums.close()
        if self._others_conn is not None:
            self._others_conn.close()
        with self._lock:
            left = len(self._queue) + len(self._open)
            if left:
                raise RuntimeError(f"usage ledger {self._path}: {left} row(s) not written: "
                                   f"{self._failure}") from self._failure

    def _write_now(self) -> bool:
        waiting = len(self._queue) + len(self._open)
        return waiting >= BATCH_ROWS or self._closing or (self._flush_wanted > self._written and waiting > 0)

    def _write_loop(self, conn: sqlite3.Connection) -> None:
        try:
            while True:
                with self._lock:
                    while not self._queue and not self._open and not self._closing:
                        self._wake.wait()
                    if self._failure is not None:
                        # Pause after a failed write rather than spin on a full disk; close() still
                        # gets its last attempt.
                        self._wake.wait_for(lambda: self._closing, timeout=self._flush_interval_s)
                    elif not self._write_now():
                        self._wake.wait_for(self._write_now, timeout=self._flush_interval_s)
                    # The open rows are closed here: a request that ends from now on begins a new one.
                    self._queue.extend(tuple(sums) for sums in self._open.values())
                    self._open.clear()
                    if len(self._queue) <= BATCH_ROWS:
                        batch = list(self._queue)
                        self._queue.clear()
                    else:
                        batch = [self._queue.popleft() for _ in range(BATCH_ROWS)]
                    closing = self._closing
                if batch:
                    try:
                        failure = self._insert(conn, batch)
                    except Exception as exc:   # a bug, not the file: the rows are kept, the thread lives
                        log.exception("usage ledger %s: writing %d row(s) failed", self._path, len(batch))
                        failure = sqlite3.DatabaseError(f"{type(exc).__name__}: {exc}")
                    self._written_back(batch, failure)
                    if failure is not None and closing:
                        log.error("usage ledger %s: giving up on %d unwritten row(s) at close: %s",
                                  self._path, len(self._queue), failure)
                        return
                with self._lock:
                    if self._closing and not self._queue and not self._open:
                        return
        finally:
            conn.close()
            with self._lock:
                self._writer_done = True
                self._written_cond.notify_all()

    def _insert(self, conn: sqlite3.Connection, batch: list[_Params]) -> sqlite3.Error | None:
        """Write the batch in one transaction: the file's failure (the rows are kept), or None. A row
        the file refuses on its own is logged and left out, and the others are written."""
        try:
            try:
                self._transaction(conn, batch)
            except _ROW_ERRORS:
                self._transaction(conn, batch, one_by_one=True)
        except sqlite3.Error as exc:
            if self._failure is None:
                log.error("usage ledger %s: could not write %d row(s), will retry: %s", self._path, len(batch), exc)
            return exc
        return None

    def _transaction(self, conn: sqlite3.Connection, batch: list[_Params], one_by_one: bool = False) -> None:
        conn.execute("BEGIN")
        try:
            if not one_by_one:
                _insert_rows(conn, batch)
            else:
                for params in batch:
                    try:
                        _insert_rows(conn, (params,))
                    except _ROW_ERRORS as exc:
                        log.error("usage ledger %s: skipped a row the file refuses (id %s, tenant %.80r): %s: %s",
                                  self._path, params[_ID], params[_TENANT], type(exc).__name__, exc)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:   # SQLite rolls some failures back itself (a full disk)
                conn.execute("ROLLBACK")
            raise

    def _written_back(self, batch: list[_Params], failure: sqlite3.Error | None) -> None:
        last: int = batch[-1][0]
        tenants = {params[_TENANT] for params in batch}
        with self._lock:
            self._attempts += 1
            if failure is not None and self._failure is None:
                self._failing_since = time.time()
            elif failure is None and self._failure is not None:
                log.warning("usage ledger %s: writing again", self._path)
            self._failure = failure
            if failure is not None:
                self._queue.extendleft(reversed(batch))
            else:
                self._written = last
                for tenant in tenants:
                    unwritten = self._unwritten[tenant]
                    while unwritten and unwritten[0][_ID] <= last:
                        unwritten.popleft()
                    if not unwritten:
                        del self._unwritten[tenant]
            self._written_cond.notify_all()
