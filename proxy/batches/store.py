"""What the Batch API keeps (docs/batches.md): the uploaded files and the ones a batch writes, on
disk under the state folder (0600), and in one SQLite file beside them each file's record, each
batch (its OpenAI object) and each of its lines with where it stands.

Why a line is a row: a batch must survive a restart and a reload without losing a line or running
one twice. A line is `pending`, `running` (claimed by the process `owner_pid`, in flight there) or
`done` (its answer kept here, written in the same transaction as the batch's counts). A process
that stops gracefully lets its lines in flight end and records them; one that was killed leaves
lines `running` under a PID no process has, and whoever runs the batches next puts them back to
`pending` (`recover`): they are sent again, as a client whose connection broke would send them (a
killed proxy is the one case an engine may have run a line twice; its output still holds it once).
A reload's two processes share the file (WAL): the successor leaves the predecessor's lines alone
while that process lives, and a batch's counts are the table's own columns, added to in the line's
transaction, so that both processes' ends count (a batch's object as one of them last saved it
would miss the other's).

Why SQLite: as the ledger (proxy/tenants/ledger.py), one local file, transactions, no server. The
calls are short (a claim, a line's end) and made on the event loop; the whole-file ones (an upload's
thousands of lines, an output file) run in a thread.
"""
from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL, status TEXT NOT NULL,
    model TEXT NOT NULL, doc TEXT NOT NULL, completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, input_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending', owner_pid INTEGER, ok INTEGER, result TEXT,
    PRIMARY KEY (batch, idx)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (batch, state, idx);
"""
BUSY_TIMEOUT_S = 10.0
# A batch's states (OpenAI's): those in which it still has lines to run or an end to write.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FILE_ID_CHARS = 24


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(FILE_ID_CHARS // 2)


@dataclass(frozen=True)
class FileRow:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's File object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


class StorageFull(Exception):
    """A file would take the kept files past engine.batches.max_storage_bytes."""

    def __init__(self, used: int, adding: int, budget: int) -> None:
        super().__init__(f"{used} bytes kept, {adding} more asked, budget {budget}")
        self.used, self.adding, self.budget = used, adding, budget


class BatchStore:
    """The files folder and the database of one state folder (state_dir/batches)."""

    def __init__(self, folder: Path, max_storage_bytes: int, clock: Any = time.time) -> None:
        self.folder = folder
        self.files = folder / "files"
        self.files.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
        self.max_storage_bytes = max_storage_bytes
        self.clock = clock
        self.path = folder / "batches.sqlite3"
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)   # the database's lines are requests: 0600 too
        os.close(fd)
        # The event loop's connection. A call that runs in a thread (a whole file) opens its own.
        self.db = self._connect()
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def close(self) -> None:
        self.db.close()

    # -- files -----------------------------------------------------------------------------------

    def path_of(self, row: FileRow) -> Path:
        # The id is this store's own (new_id), never a request's: a path is never made of one.
        return self.files / f"{row.id}.jsonl"

    def used_bytes(self) -> int:
        return _used(self.db)

    def read(self, row: FileRow) -> bytes:
        return self.path_of(row).read_bytes()

    def add_file(self, owner: str, filename: str, purpose: str, data: bytes) -> FileRow:
        """Keep an uploaded file (in a thread: its own connection), within max_storage_bytes."""
        db = self._connect()
        row: FileRow | None = None
        try:
            used = _used(db)
            if used + len(data) > self.max_storage_bytes:   # before the write: no disk spent for nothing
                raise StorageFull(used, len(data), self.max_storage_bytes)
            row = FileRow(new_id("file-"), owner, filename, purpose, len(data), int(self.clock()))
            fd = os.open(self.path_of(row), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            # The write lock only for the sum and the row (not the file's write, which the loop's
            # short writes would wait on): two uploads at once cannot both pass the budget.
            with _Transaction(db):
                used = _used(db)
                if used + len(data) > self.max_storage_bytes:
                    raise StorageFull(used, len(data), self.max_storage_bytes)
                db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                           (row.id, row.owner, row.filename, row.purpose, row.bytes, row.created_at))
        except BaseException:
            if row is not None:
                self.path_of(row).unlink(missing_ok=True)
            raise
        finally:
            db.close()
        return row

    def file(self, file_id: str, owner: str | None) -> FileRow | None:
        """The file `file_id` if `owner` may see it (None: any owner, for the admin's view)."""
        found = self.db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if found is None or (owner is not None and found[1] != owner):
            return None
        return FileRow(*found)

    def list_files(self, owner: str, purpose: str | None = None) -> list[FileRow]:
        rows = self.db.execute("SELECT * FROM files WHERE owner = ? AND (? IS NULL OR purpose = ?) "
                               "ORDER BY created_at DESC, id", (owner, purpose, purpose)).fetchall()
        return [FileRow(*r) for r in rows]

    def delete_file(self, row: FileRow) -> None:
        self.db.execute("DELETE FROM files WHERE id = ?", (row.id,))
        self.path_of(row).unlink(missing_ok=True)

    # -- batches ---------------------------------------------------------------------------------

    def create_batch(self, owner: str, doc: dict[str, Any], model: str, lines: Iterable[tuple[str, str]]) -> None:
        """A new batch (`doc`: its OpenAI object) with its lines (custom_id, the request body's JSON),
        all in one transaction (in a thread: its own connection)."""
        db = self._connect()
        try:
            with _Transaction(db):
                db.execute("INSERT INTO batches (id, owner, created_at, status, model, doc) VALUES (?, ?, ?, ?, ?, ?)",
                       (doc["id"], owner, doc["created_at"], doc["status"], model, json.dumps(doc)))
                db.executemany("INSERT INTO lines (batch, idx, custom_id, body) VALUES (?, ?, ?, ?)",
                               ((doc["id"], i, cid, body) for i, (cid, body) in enumerate(lines)))
        finally:
            db.close()

    def batch(self, batch_id: str, owner: str | None) -> dict[str, Any] | None:
        found = self.db.execute(f"SELECT owner, {DOC} FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if found is None or (owner is not None and found[0] != owner):
            return None
        return _doc(*found[1:])

    def owner_of(self, batch_id: str) -> str:
        return str(self.db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()[0])

    def list_batches(self, owner: str | None, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, from just past `after`; and whether more follow. `owner` None: every batch."""
        start = None
        if after is not None:
            start = self.db.execute("SELECT created_at, id FROM batches WHERE id = ?", (after,)).fetchone()
        rows = self.db.execute(
            f"SELECT {DOC} FROM batches WHERE (? IS NULL OR owner = ?) AND "
            "(? IS NULL OR created_at < ? OR (created_at = ? AND id > ?)) ORDER BY created_at DESC, id LIMIT ?",
            (owner, owner, start and start[0], start and start[0], start and start[0], start and start[1],
             limit + 1)).fetchall()
        return [_doc(*r) for r in rows[:limit]], len(rows) > limit

    def active(self) -> list[tuple[dict[str, Any], str, str]]:
        """Every batch with lines to run or an end to write, oldest first: (doc, owner, model)."""
        marks = ",".join("?" * len(ACTIVE))
        rows = self.db.execute(f"SELECT owner, model, {DOC} FROM batches WHERE status IN ({marks}) "
                               "ORDER BY created_at, id", ACTIVE).fetchall()
        return [(_doc(*r[2:]), r[0], r[1]) for r in rows]

    def save(self, doc: dict[str, Any]) -> None:
        """Its status and timestamps (its counts are the table's: `finish`)."""
        self.db.execute("UPDATE batches SET status = ?, doc = ? WHERE id = ?", (doc["status"], json.dumps(doc),
                                                                               doc["id"]))

    # -- lines -----------------------------------------------------------------------------------

    def claim(self, batch_id: str, count: int, pid: int) -> list[tuple[int, str, str]]:
        """Up to `count` pending lines, in order, now `running` under `pid`: (idx, custom_id, body)."""
        if count <= 0:
            return []
        # RETURNING's rows come in no order SQLite promises: sorted, they go out in the input's.
        return sorted(self.db.execute(
            "UPDATE lines SET state = 'running', owner_pid = ? WHERE batch = ? AND idx IN "
            "(SELECT idx FROM lines WHERE batch = ? AND state = 'pending' ORDER BY idx LIMIT ?) "
            "RETURNING idx, custom_id, body", (pid, batch_id, batch_id, count)).fetchall())

    def finish(self, batch_id: str, idx: int, ok: bool, result: dict[str, Any],
               tokens: tuple[int, int, int] = (0, 0, 0)) -> None:
        """A line's answer (`result`: its line of the output or error file), and the batch's counts
        with it (a line, its prompt, cached and output tokens), in one transaction."""
        with self._transaction():
            self.db.execute("UPDATE lines SET state = 'done', ok = ?, result = ?, owner_pid = NULL "
                            "WHERE batch = ? AND idx = ?", (int(ok), json.dumps(result), batch_id, idx))
            column = "completed" if ok else "failed"
            self.db.execute(f"UPDATE batches SET {column} = {column} + 1, input_tokens = input_tokens + ?, "
                            "cached_tokens = cached_tokens + ?, output_tokens = output_tokens + ? WHERE id = ?",
                            (*tokens, batch_id))

    def unclaim(self, batch_id: str, idx: int) -> None:
        """A line that did not run (the pool would not take it now): pending again."""
        self.db.execute("UPDATE lines SET state = 'pending', owner_pid = NULL WHERE batch = ? AND idx = ? "
                        "AND state = 'running'", (batch_id, idx))

    def expire(self, doc: dict[str, Any], result_of: Any) -> int:
        """Every line not yet sent ends as `result_of(custom_id)` says (an error line). Their number."""
        with self._transaction():
            rows = self.db.execute("SELECT idx, custom_id FROM lines WHERE batch = ? AND state = 'pending'",
                                   (doc["id"],)).fetchall()
            self.db.executemany("UPDATE lines SET state = 'done', ok = 0, result = ?, owner_pid = NULL "
                                "WHERE batch = ? AND idx = ?",
                                ((json.dumps(result_of(cid)), doc["id"], idx) for idx, cid in rows))
            self.db.execute("UPDATE batches SET failed = failed + ? WHERE id = ?", (len(rows), doc["id"]))
            self.save(doc)
        return len(rows)

    def counts(self, batch_id: str) -> dict[str, int]:
        """Lines by state: pending, running, done."""
        rows = self.db.execute("SELECT state, COUNT(*) FROM lines WHERE batch = ? GROUP BY state",
                               (batch_id,)).fetchall()
        return {"pending": 0, "running": 0, "done": 0, **dict(rows)}

    def write_results(self, batch_id: str, owner: str, ok: bool, filename: str) -> FileRow | None:
        """The batch's output file (`ok`) or error file, as a file of `owner`; None where it has no
        such line. Written whatever max_storage_bytes says: the budget refuses uploads, never answers."""
        row = FileRow(new_id("file-"), owner, filename, "batch_output", 0, int(self.clock()))
        db = self._connect()   # in a thread: its own connection
        try:
            size = 0
            fd = os.open(self.path_of(row), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for (result,) in db.execute("SELECT result FROM lines WHERE batch = ? AND state = 'done' AND ok = ? "
                                            "ORDER BY idx", (batch_id, int(ok))):
                    size += f.write(result + "\n")
            if size == 0:
                self.path_of(row).unlink()
                return None
            row = FileRow(row.id, owner, filename, row.purpose, self.path_of(row).stat().st_size, row.created_at)
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                       (row.id, row.owner, row.filename, row.purpose, row.bytes, row.created_at))
        finally:
            db.close()
        return row

    def close_batch(self, doc: dict[str, Any]) -> None:
        """The batch has ended, its files written: its lines' answers are in them now."""
        with self._transaction():
            self.save(doc)
            self.db.execute("DELETE FROM lines WHERE batch = ?", (doc["id"],))

    def running_owners(self, pid: int) -> list[int]:
        """The other processes with lines `running`."""
        return [r[0] for r in self.db.execute("SELECT DISTINCT owner_pid FROM lines WHERE state = 'running' "
                                              "AND owner_pid != ?", (pid,)).fetchall()]

    def recover(self, dead_pid: int) -> int:
        """The lines a process that is gone left `running`: pending again. Their number."""
        return self.db.execute("UPDATE lines SET state = 'pending', owner_pid = NULL WHERE state = 'running' "
                               "AND owner_pid = ?", (dead_pid,)).rowcount

    def _transaction(self) -> "_Transaction":
        return _Transaction(self.db)


# A batch's object and the counts kept beside it (`_doc` takes them in this order).
DOC = "doc, completed, failed, input_tokens, cached_tokens, output_tokens"


def _doc(text: str, completed: int, failed: int, prompt: int, cached: int, output: int) -> dict[str, Any]:
    """A batch's object, with its counts as the table holds them (OpenAI's `usage` of a batch)."""
    doc: dict[str, Any] = json.loads(text)
    doc["request_counts"] = {**doc["request_counts"], "completed": completed, "failed": failed}
    doc["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                    "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": prompt + output}
    return doc


def _used(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()[0])


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")
