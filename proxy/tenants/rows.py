"""A usage ledger's row: what `record()` is given (UsageRow), the INSERT parameters it becomes (id
first, then the row's fields in the table's order), the check of its numbers, and the INSERT itself.

The ledger (proxy/tenants/ledger.py) keeps rows as these parameter tuples from `record()` until
they are on disk; each is checked once, on the event loop, where it is recorded.
"""
from __future__ import annotations

import itertools
import logging
import math
import sqlite3
from collections.abc import Sequence
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

# The largest token count a row may hold (README: Tenants): more is an engine's or a provider's
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


# A recorded row as it waits to be written: the INSERT's parameters, id first. Plain values only: a
# tuple of them is left alone by the garbage collector, however many are queued.
Params = tuple[Any, ...]
ID, TIME, TENANT = 0, 1, 2
COLUMN = {"tenant": 2, "key_id": 3, "model": 4, "backend": 5, "host": 6}
PROMPT, CACHED, OUTPUT, COST, STATUS, QUEUE_WAIT, DURATION, ESTIMATED = 8, 9, 10, 11, 7, 12, 13, 14
_COUNTS = (("status", STATUS), ("prompt_tokens", PROMPT), ("cached_tokens", CACHED), ("output_tokens", OUTPUT))
_AMOUNTS = (("time", TIME), ("cost", COST), ("queue_wait_ms", QUEUE_WAIT), ("duration_ms", DURATION))
_INSERT_HEAD = ("INSERT INTO usage (id, time, tenant, key_id, model, backend, host, status, prompt_tokens, "
                "cached_tokens, output_tokens, cost, queue_wait_ms, duration_ms, estimated) VALUES ")
_INSERT_SQL = {n: _INSERT_HEAD + ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"] * n)
               for n in _ROWS_PER_INSERT}
# What a row the file refuses on its own raises (a value SQLite cannot bind or store, a taken id):
# that row is skipped. Any other sqlite3.Error is the file's (full, read-only, locked): all are kept.
ROW_ERRORS = (sqlite3.IntegrityError, sqlite3.InterfaceError, sqlite3.ProgrammingError, OverflowError,
               TypeError, ValueError)


def checked(params: Params) -> Params:
    """The row's parameters with each count an int in 0..MAX_COUNT and each amount a finite float >= 0
    (time included); what is not is logged and taken as 0. The usage of an engine or a provider is
    checked where it is read (proxy/serving/response_metrics.py): this is the ledger's own guard."""
    status, prompt, cached, output = params[STATUS], params[PROMPT], params[CACHED], params[OUTPUT]
    at, spent, waited, took = params[TIME], params[COST], params[QUEUE_WAIT], params[DURATION]
    # One expression for the row every request makes (ints and floats in range): it runs on the event loop.
    if type(status) is int and type(prompt) is int and type(cached) is int and type(output) is int \
            and type(at) is float and type(spent) is float and type(waited) is float and type(took) is float \
            and 0 <= status <= MAX_COUNT and 0 <= prompt <= MAX_COUNT and 0 <= cached <= MAX_COUNT \
            and 0 <= output <= MAX_COUNT and 0.0 <= at < math.inf and 0.0 <= spent < math.inf \
            and 0.0 <= waited < math.inf and 0.0 <= took < math.inf and type(params[ESTIMATED]) is bool:
        return params
    bad = [name for name, i in _COUNTS if type(params[i]) is not int or not 0 <= params[i] <= MAX_COUNT]
    bad += [name for name, i in _AMOUNTS if type(params[i]) not in (int, float) or not 0 <= params[i] < math.inf]
    if not bad and type(params[ESTIMATED]) is bool:
        return params
    fixed = list(params)
    for name, i in (*_COUNTS, *_AMOUNTS):
        if name in bad:
            log.warning("usage ledger: a row of tenant %r has %s = %.40r; recorded as 0", params[TENANT], name,
                        params[i])
            fixed[i] = 0 if i in (STATUS, PROMPT, CACHED, OUTPUT) else 0.0
    fixed[ESTIMATED] = bool(fixed[ESTIMATED]) if type(fixed[ESTIMATED]) in (bool, int) else False
    return tuple(fixed)


def insert_rows(conn: sqlite3.Connection, batch: Sequence[Params]) -> None:
    """INSERT the batch in statements of _ROWS_PER_INSERT rows (within the caller's transaction)."""
    at = 0
    for size in _ROWS_PER_INSERT:
        while len(batch) - at >= size:
            conn.execute(_INSERT_SQL[size], list(itertools.chain.from_iterable(batch[at:at + size])))
            at += size

