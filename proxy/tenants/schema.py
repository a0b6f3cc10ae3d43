"""The usage ledger's file: its tables, the version they are at, and the steps from one version to
the next.

The version is SQLite's `PRAGMA user_version` (0 in a new, empty file). `MIGRATIONS[n]` turns a file
at version n - 1 into one at version n; opening a file applies the missing steps in order, in one
transaction, so a file is at one version or the next, never between. A file from a newer llm-pool
(a version above the last step) is refused rather than written: an older proxy would not know what
its rows mean.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Callable

# How long a connection waits for another's write lock (the writer thread's, an admin key write)
# before it fails: a batch of rows is written in milliseconds.
BUSY_TIMEOUT_S = 10.0


def _version_1(conn: sqlite3.Connection) -> None:
    # id is the rowid and the ledger's own sequence number (SqliteLedger assigns it when a row is
    # recorded), so a reader can tell which recorded rows a query already saw.
    conn.execute("""
        CREATE TABLE usage (
            id INTEGER PRIMARY KEY,
            time REAL NOT NULL,
            tenant TEXT NOT NULL,
            key_id TEXT NOT NULL,
            model TEXT NOT NULL,
            backend TEXT NOT NULL,
            host TEXT NOT NULL,
            status INTEGER NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            cached_tokens INTEGER NOT NULL,
            output_tokens INTEGER NOT NULL,
            cost REAL NOT NULL,
            queue_wait_ms REAL NOT NULL,
            duration_ms REAL NOT NULL
        )""")
    # Covering what `spent` sums, so a budget's or a limit's window is read from the index alone.
    conn.execute("CREATE INDEX usage_tenant_time ON usage "
                 "(tenant, time, prompt_tokens, cached_tokens, output_tokens, cost)")
    conn.execute("CREATE INDEX usage_time ON usage (time)")
    # A digest names one key of one tenant: the same digest under two tenants would make a key
    # authenticate as either.
    conn.execute("""
        CREATE TABLE keys (
            tenant TEXT NOT NULL,
            key_id TEXT NOT NULL,
            sha256 TEXT NOT NULL UNIQUE,
            created REAL NOT NULL,
            revoked REAL,
            PRIMARY KEY (tenant, key_id)
        )""")


def _version_2(conn: sqlite3.Connection) -> None:
    # 1 where prompt_tokens is the proxy's estimate (a stream that ended before the engine's usage);
    # the rows of version 1 had the engine's figure or nothing.
    conn.execute("ALTER TABLE usage ADD COLUMN estimated INTEGER NOT NULL DEFAULT 0")
    # Where each ledger that opened the file started its ids (SqliteLedger): a reload's successor
    # starts past its predecessor's even when that one has written nothing yet.
    conn.execute("CREATE TABLE writers (base INTEGER PRIMARY KEY, opened REAL NOT NULL)")


def _version_3(conn: sqlite3.Connection) -> None:
    # A row sums the requests of one second that share tenant, key, model, backend, host, status and
    # `estimated` (proxy/tenants/ledger.py); the rows before it were one request each. Its queue_wait_ms
    # and duration_ms are sums too. The covering index takes the count, as `spent` sums it.
    conn.execute("ALTER TABLE usage ADD COLUMN requests INTEGER NOT NULL DEFAULT 1")
    conn.execute("DROP INDEX usage_tenant_time")
    conn.execute("CREATE INDEX usage_tenant_time ON usage "
                 "(tenant, time, requests, prompt_tokens, cached_tokens, output_tokens, cost)")


MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    1: _version_1,
    2: _version_2,
    3: _version_3,
}
SCHEMA_VERSION = max(MIGRATIONS)


def connect(path: Path, *, check_same_thread: bool = True) -> sqlite3.Connection:
    """A connection to the ledger file in autocommit mode (transactions are begun explicitly)."""
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                           check_same_thread=check_same_thread)
    # In WAL mode NORMAL syncs at checkpoints only: a killed process loses no committed row; a power
    # cut may lose the last commits but never leaves the file inconsistent.
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def schema_version(conn: sqlite3.Connection) -> int:
    version: int = conn.execute("PRAGMA user_version").fetchone()[0]
    return version


def _refuse_unknown(path: Path, version: int) -> None:
    if not 0 <= version <= SCHEMA_VERSION:
        raise ValueError(f"{path}: the usage ledger's schema is at version {version}, but this llm-pool "
                         f"knows versions 0 to {SCHEMA_VERSION}; it was written by a newer llm-pool "
                         f"(run that one, or move the file aside to start a new ledger)")


def migrate(conn: sqlite3.Connection, path: Path) -> int:
    """Bring the file to SCHEMA_VERSION (or refuse it: ValueError naming both versions); the version
    it was at."""
    found = schema_version(conn)
    _refuse_unknown(path, found)
    # Persistent in the file; it cannot change inside a transaction.
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("BEGIN IMMEDIATE")
    try:
        # Read again under the write lock: another process may have migrated it meanwhile.
        found = schema_version(conn)
        _refuse_unknown(path, found)
        for version in range(found + 1, SCHEMA_VERSION + 1):
            MIGRATIONS[version](conn)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION:d}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return found
