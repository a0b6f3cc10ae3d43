"""A usage ledger's rows: what `record()` is given (UsageRow, one request), the check of its numbers,
the row it is added to (a Sum: the requests of one second that share tenant, key, model, backend,
host, status and `estimated`), and the INSERT of those rows.

The ledger (proxy/tenants/ledger.py) checks each request's UsageRow once, on the event loop, where
it is recorded, and adds it to its second's Sum; a Sum is the INSERT's parameters (id first, then
the table's columns in order), a list while requests are added to it, a tuple once the writer took it.
"""
from __future__ import annotations

import itertools
import logging
import math
import sqlite3
from collections.abc import Sequence
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

# The largest token count a row may hold (docs/tenants.md): more is an engine's or a provider's
# nonsense, and past 2**63 SQLite cannot store it at all.
MAX_COUNT = 2 ** 31
# Rows per INSERT statement: one statement binds many rows, so the writer releases and takes back
# the GIL once per statement instead of once per row (each a wait of the event loop's thread).
_ROWS_PER_INSERT = (256, 64, 16, 4, 1)


class UsageRow(NamedTuple):
    """One finished request. A tuple in the INSERT's order (after the id): recording one per request
    builds no other object."""

    time: float            # unix seconds, when the request finished
    tenant: str            # "" when tenants are off
    key_id: str            # a short id of the key, never the key
    model: str
    backend: str
    host: str
    status: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    cost: float
    queue_wait_ms: float
    duration_ms: float
    estimated: bool = False   # prompt_tokens is the proxy's estimate, not the engine's figure


# A ledger row as it waits to be written: the INSERT's parameters, id first (a list while requests
# are added to it). Plain values only: a tuple of them is left alone by the garbage collector.
Params = Sequence[Any]
ID, TIME, TENANT = 0, 1, 2
COLUMN = {"tenant": 2, "key_id": 3, "model": 4, "backend": 5, "host": 6}
STATUS, PROMPT, CACHED, OUTPUT, COST, QUEUE_WAIT, DURATION, ESTIMATED, REQUESTS = 7, 8, 9, 10, 11, 12, 13, 14, 15
# A UsageRow's fields are the row's columns after the id, in order.
_COUNTS = (("status", STATUS - 1), ("prompt_tokens", PROMPT - 1), ("cached_tokens", CACHED - 1),
           ("output_tokens", OUTPUT - 1))
_AMOUNTS = (("time", TIME - 1), ("cost", COST - 1), ("queue_wait_ms", QUEUE_WAIT - 1), ("duration_ms", DURATION - 1))
_INSERT_HEAD = ("INSERT INTO usage (id, time, tenant, key_id, model, backend, host, status, prompt_tokens, "
                "cached_tokens, output_tokens, cost, queue_wait_ms, duration_ms, estimated, requests) VALUES ")
_INSERT_SQL = {n: _INSERT_HEAD + ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"] * n)
               for n in _ROWS_PER_INSERT}
# What a row the file refuses on its own raises (a value SQLite cannot bind or store, a taken id):
# that row is skipped. Any other sqlite3.Error is the file's (full, read-only, locked): all are kept.
ROW_ERRORS = (sqlite3.IntegrityError, sqlite3.InterfaceError, sqlite3.ProgrammingError, OverflowError,
               TypeError, ValueError)


def checked(row: UsageRow) -> UsageRow:
    """The request's row with each count an int in 0..MAX_COUNT and each amount a finite float >= 0
    (time included); what is not is logged and taken as 0. The usage of an engine or a provider is
    checked where it is read (proxy/edge/response_metrics.py): this is the ledger's own guard."""
    at, _, _, _, _, _, status, prompt, cached, output, spent, waited, took, estimated = row
    # One expression for the row every request makes (ints and floats in range): it runs on the event loop.
    if type(status) is int and type(prompt) is int and type(cached) is int and type(output) is int \
            and type(at) is float and type(spent) is float and type(waited) is float and type(took) is float \
            and 0 <= status <= MAX_COUNT and 0 <= prompt <= MAX_COUNT and 0 <= cached <= MAX_COUNT \
            and 0 <= output <= MAX_COUNT and 0.0 <= at < math.inf and 0.0 <= spent < math.inf \
            and 0.0 <= waited < math.inf and 0.0 <= took < math.inf and type(estimated) is bool:
        return row
    fixed: list[Any] = list(row)
    for name, i in _COUNTS:
        value = row[i]
        if type(value) is not int or not 0 <= value <= MAX_COUNT:
            log.warning("usage ledger: a row of tenant %r has %s = %.40r; recorded as 0", row.tenant, name, value)
            fixed[i] = 0
    for name, i in _AMOUNTS:
        fixed[i] = _amount(row[i])
        if fixed[i] is None:
            log.warning("usage ledger: a row of tenant %r has %s = %.40r; recorded as 0", row.tenant, name, row[i])
            fixed[i] = 0.0
    fixed[ESTIMATED - 1] = bool(estimated) if type(estimated) in (bool, int) else False
    return UsageRow(*fixed)


def _amount(value: Any) -> float | None:
    """`value` as a finite float >= 0, or None."""
    if type(value) not in (int, float):
        return None
    try:
        value = float(value)
    except OverflowError:   # an int past what a float holds
        return None
    return value if 0.0 <= value < math.inf else None


def insert_rows(conn: sqlite3.Connection, batch: Sequence[Params]) -> None:
    """INSERT the batch's rows in statements of _ROWS_PER_INSERT (within the caller's transaction)."""
    at = 0
    for size in _ROWS_PER_INSERT:
        while len(batch) - at >= size:
            conn.execute(_INSERT_SQL[size], list(itertools.chain.from_iterable(batch[at:at + size])))
            at += size

