"""The usage ledger on a real SQLite file: sums with rows queued and written, the usage report's
groups and bounds, minted keys, a restart, the schema's migration and refusal, and a SIGKILL."""
from __future__ import annotations

import contextlib
import os
import random
import selectors
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from proxy.tenants.ledger import BATCH_ROWS, GROUP_FIELDS, MintedKey, Spent, SqliteLedger, UsageRow
from proxy.tenants.schema import MIGRATIONS, SCHEMA_VERSION

REPO = Path(__file__).resolve().parents[3]
DAY1 = 1_767_225_600.0        # 2026-01-01T00:00:00Z
DAY2 = DAY1 + 86_400          # 2026-01-02
# Long enough that nothing is written while a test looks, unless it flushes or fills a batch.
NEVER_S = 3600.0


def row(time: float, tenant: str = "webui", model: str = "qwen", *, key_id: str = "k1", backend: str = "llama_server",
        host: str = "local", status: int = 200, prompt: int = 10, cached: int = 0, output: int = 5,
        cost: float = 0.0, queue_wait_ms: float = 0.0, duration_ms: float = 0.0, estimated: bool = False) -> UsageRow:
    return UsageRow(time=time, tenant=tenant, key_id=key_id, model=model, backend=backend, host=host, status=status,
                    prompt_tokens=prompt, cached_tokens=cached, output_tokens=output, cost=cost,
                    queue_wait_ms=queue_wait_ms, duration_ms=duration_ms, estimated=estimated)


def rows_on_disk(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        count: int = conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0]
        return count
    finally:
        conn.close()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "usage.sqlite3"


@pytest.fixture
def ledger(path: Path) -> Iterator[SqliteLedger]:
    ledger = SqliteLedger(path, flush_interval_s=NEVER_S)
    yield ledger
    ledger.close()


def test_spent_counts_queued_rows_then_the_same_rows_on_disk(ledger: SqliteLedger, path: Path) -> None:
    ledger.record(row(DAY1 + 10, prompt=100, cached=40, output=20, cost=0.5))
    ledger.record(row(DAY1 + 20, prompt=200, cached=0, output=30, cost=0.25))
    ledger.record(row(DAY1 + 30, tenant="batch", prompt=1000, output=1000, cost=9.0))
    assert rows_on_disk(path) == 0
    expected = Spent(requests=2, prompt_tokens=300, cached_tokens=40, output_tokens=50, cost=0.75)
    assert ledger.spent("webui", DAY1) == expected
    assert ledger.spent("webui", DAY1).tokens == 350

    ledger.flush()
    assert rows_on_disk(path) == 3
    assert ledger.spent("webui", DAY1) == expected
    assert ledger.spent("webui", DAY1 + 15) == Spent(1, 200, 0, 30, 0.25)
    assert ledger.spent("batch", DAY1) == Spent(1, 1000, 0, 1000, 9.0)
    assert ledger.spent("nobody", DAY1) == Spent(0, 0, 0, 0, 0.0)


def test_spent_adds_rows_recorded_after_an_earlier_sum_of_the_same_window(ledger: SqliteLedger) -> None:
    # The budget's period start recurs on every request: its sum is kept and only new rows added.
    ledger.record(row(DAY1 + 1, output=1))
    ledger.flush()
    assert ledger.spent("webui", DAY1).requests == 1
    ledger.record(row(DAY1 + 2, output=2))
    assert ledger.spent("webui", DAY1) == Spent(2, 20, 0, 3, 0.0)
    ledger.flush()
    ledger.record(row(DAY1 + 3, output=4))
    ledger.record(row(DAY1 - 5, output=100))    # before the window: recorded late, still not counted
    ledger.record(row(DAY1 + 4, tenant="other", output=100))
    assert ledger.spent("webui", DAY1) == Spent(3, 30, 0, 7, 0.0)
    ledger.flush()
    assert ledger.spent("webui", DAY1) == Spent(3, 30, 0, 7, 0.0)
    assert ledger.spent("webui", DAY1 - 10) == Spent(4, 40, 0, 107, 0.0)


@pytest.mark.parametrize("flush_interval_s", [NEVER_S, 0.001], ids=["flushed_by_the_test", "writer_racing"])
def test_spent_of_budgets_and_sliding_windows_matches_a_plain_sum(path: Path, flush_interval_s: float) -> None:
    # The edge's pattern, requests interleaved with writes: a budget's period (a fixed start) and a
    # per-minute window (a start moving forward, now and then back) for each of two tenants, some
    # rows arriving late. Each answer is checked against the sum of every row recorded; with the
    # writer writing all the while, rows go to disk between (and during) the reads.
    ledger = SqliteLedger(path, flush_interval_s=flush_interval_s)
    try:
        _match_plain_sums(ledger)
    finally:
        ledger.close()


def _match_plain_sums(ledger: SqliteLedger) -> None:
    rng = random.Random(32)
    recorded: list[UsageRow] = []
    now = DAY1
    for step in range(3000):
        now += rng.uniform(0.0, 0.5)
        tenant = rng.choice(["webui", "batch"])
        late = rng.random() < 0.05
        recorded.append(row(now - (rng.uniform(0, 120) if late else 0), tenant, prompt=rng.randrange(100),
                            cached=rng.randrange(10), output=rng.randrange(100), cost=rng.randrange(8) / 8))
        ledger.record(recorded[-1])
        if rng.random() < 0.1:
            ledger.flush()
        # Whole seconds, as the edge asks: a row sums a second's requests, and carries its last one's time.
        window = float(int(now - 60 - (rng.uniform(0, 30) if rng.random() < 0.05 else 0)))
        for since in (DAY1, window):
            rows_in = [r for r in recorded if r.tenant == tenant and r.time >= since]
            expected = Spent(len(rows_in), sum(r.prompt_tokens for r in rows_in),
                             sum(r.cached_tokens for r in rows_in), sum(r.output_tokens for r in rows_in),
                             sum(r.cost for r in rows_in))
            assert ledger.spent(tenant, since) == expected, (step, since)
        if step % 250 == 0:
            by_tenant = {g["tenant"]: (g["requests"], g["output_tokens"]) for g in ledger.usage(None, None, ["tenant"])}
            assert by_tenant == {t: (sum(1 for r in recorded if r.tenant == t),
                                     sum(r.output_tokens for r in recorded if r.tenant == t))
                                 for t in {r.tenant for r in recorded}}, step


def test_a_full_batch_is_written_without_waiting_for_the_interval(ledger: SqliteLedger, path: Path) -> None:
    for i in range(BATCH_ROWS):
        ledger.record(row(DAY1 + i))
    deadline = time.monotonic() + 60
    while rows_on_disk(path) < BATCH_ROWS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rows_on_disk(path) == BATCH_ROWS
    assert ledger.spent("webui", DAY1).requests == BATCH_ROWS


def test_the_requests_of_a_second_are_one_row_that_sums_them(ledger: SqliteLedger, path: Path) -> None:
    for i in range(300):
        ledger.record(row(DAY1 + i / 1000, prompt=1, output=2, cost=0.25, queue_wait_ms=1.0, duration_ms=10.0,
                          status=500 if i % 3 == 0 else 200, estimated=i % 2 == 0))
    ledger.record(row(DAY1 + 1, prompt=5))                 # the next second: a row of its own
    ledger.record(row(DAY1 + 0.5, tenant="batch"))        # another tenant: its own row
    ledger.flush()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT tenant, time, status, estimated, requests, prompt_tokens, output_tokens, cost, "
                            "queue_wait_ms, duration_ms FROM usage ORDER BY id").fetchall()
    # One row per status and `estimated`, in the order each began, with the time of its last request.
    assert rows == [("webui", DAY1 + 0.294, 500, 1, 50, 50, 100, 12.5, 50.0, 500.0),
                    ("webui", DAY1 + 0.299, 200, 0, 100, 100, 200, 25.0, 100.0, 1000.0),
                    ("webui", DAY1 + 0.298, 200, 1, 100, 100, 200, 25.0, 100.0, 1000.0),
                    ("webui", DAY1 + 0.297, 500, 0, 50, 50, 100, 12.5, 50.0, 500.0),
                    ("webui", DAY1 + 1, 200, 0, 1, 5, 5, 0.0, 0.0, 0.0),
                    ("batch", DAY1 + 0.5, 200, 0, 1, 10, 5, 0.0, 0.0, 0.0)]
    assert ledger.spent("webui", DAY1) == Spent(301, 305, 0, 605, 75.0)
    [total] = ledger.usage(None, None, ["tenant"])[1:]
    assert (total["requests"], total["errors"], total["estimated"]) == (301, 100, 150)


def _report_rows(ledger: SqliteLedger) -> None:
    ledger.record(row(DAY1 + 100, "webui", "qwen", prompt=1, output=2, cost=0.5, queue_wait_ms=3, duration_ms=40))
    ledger.record(row(DAY1 + 200, "webui", "qwen", prompt=10, output=20, status=500, duration_ms=60))
    ledger.record(row(DAY1 + 300, "webui", "gpt", prompt=100, cached=50, output=200, cost=1.5))
    ledger.record(row(DAY2 + 100, "webui", "qwen", prompt=1000, output=2000))
    ledger.record(row(DAY2 + 200, "batch", "qwen", prompt=7, output=7, status=429))


def _group(tenant: str, model: str, day: str, requests: int, prompt: int, cached: int, output: int, cost: float,
           errors: int = 0, queue_wait_ms: float = 0.0, duration_ms: float = 0.0,
           estimated: int = 0) -> dict[str, object]:
    return {"tenant": tenant, "model": model, "day": day, "requests": requests, "prompt_tokens": prompt,
            "cached_tokens": cached, "output_tokens": output, "cost": cost, "errors": errors,
            "estimated": estimated, "queue_wait_ms": queue_wait_ms, "duration_ms": duration_ms}


@pytest.mark.parametrize("flushed", [False, True], ids=["queued", "on_disk"])
def test_usage_groups_by_tenant_model_and_day(ledger: SqliteLedger, flushed: bool) -> None:
    _report_rows(ledger)
    if flushed:
        ledger.flush()
    assert ledger.usage(None, None, ["tenant", "model", "day"]) == [
        _group("batch", "qwen", "2026-01-02", 1, 7, 0, 7, 0.0, errors=1),
        _group("webui", "gpt", "2026-01-01", 1, 100, 50, 200, 1.5),
        _group("webui", "qwen", "2026-01-01", 2, 11, 0, 22, 0.5, errors=1, queue_wait_ms=3.0, duration_ms=100.0),
        _group("webui", "qwen", "2026-01-02", 1, 1000, 0, 2000, 0.0),
    ]
    # From inclusive, to exclusive: the second day alone.
    assert ledger.usage(DAY2, DAY2 + 86_400, ["day", "tenant"]) == [
        {"day": "2026-01-02", "tenant": "batch", "requests": 1, "prompt_tokens": 7, "cached_tokens": 0,
         "output_tokens": 7, "cost": 0.0, "errors": 1, "estimated": 0, "queue_wait_ms": 0.0, "duration_ms": 0.0},
        {"day": "2026-01-02", "tenant": "webui", "requests": 1, "prompt_tokens": 1000, "cached_tokens": 0,
         "output_tokens": 2000, "cost": 0.0, "errors": 0, "estimated": 0, "queue_wait_ms": 0.0,
             "duration_ms": 0.0},
    ]
    assert [g["model"] for g in ledger.usage(DAY1 + 200, DAY1 + 300, ["model"])] == ["qwen"]
    assert ledger.usage(DAY1 + 200, None, ["tenant"])[1]["requests"] == 3
    assert ledger.usage(None, DAY1 + 100, ["tenant"]) == []


def test_usage_half_queued_half_on_disk_sums_each_row_once(ledger: SqliteLedger) -> None:
    ledger.record(row(DAY1 + 1, output=1))
    ledger.record(row(DAY2 + 1, output=2))
    ledger.flush()
    ledger.record(row(DAY1 + 2, output=4))
    ledger.record(row(DAY2 + 2, tenant="batch", output=8))
    assert [(g["day"], g["requests"], g["output_tokens"]) for g in ledger.usage(None, None, ["day"])] == [
        ("2026-01-01", 2, 5), ("2026-01-02", 2, 10)]


def test_usage_without_groups_is_one_total_and_nothing_for_an_empty_range(ledger: SqliteLedger) -> None:
    _report_rows(ledger)
    ledger.flush()
    [total] = ledger.usage(None, None, [])
    assert (total["requests"], total["prompt_tokens"], total["output_tokens"], total["errors"]) == (5, 1118, 2229, 2)
    assert ledger.usage(DAY2 * 2, None, []) == []


def test_usage_groups_by_key_backend_and_host(ledger: SqliteLedger) -> None:
    ledger.record(row(DAY1, key_id="k2", backend="vllm", host="gpu2"))
    ledger.record(row(DAY1, key_id="k1", backend="llama_server", host="local"))
    ledger.record(row(DAY1, key_id="k1", backend="llama_server", host="local"))
    assert [(g["key_id"], g["backend"], g["host"], g["requests"])
            for g in ledger.usage(None, None, ["key_id", "backend", "host"])] == [
        ("k1", "llama_server", "local", 2), ("k2", "vllm", "gpu2", 1)]
    assert set(GROUP_FIELDS) == {"tenant", "model", "day", "key_id", "backend", "host"}


def test_usage_refuses_an_unknown_group_by_field(ledger: SqliteLedger) -> None:
    with pytest.raises(ValueError, match="'status'"):
        ledger.usage(None, None, ["tenant", "status"])
    with pytest.raises(ValueError, match="unknown"):
        ledger.usage(None, None, ["tenant; DROP TABLE usage"])


def test_keys_are_minted_listed_and_revoked_once(ledger: SqliteLedger) -> None:
    ledger.add_key("webui", "a1b2", "d" * 64, created=DAY1)
    ledger.add_key("batch", "c3d4", "e" * 64, created=DAY1 + 5)
    with pytest.raises(ValueError, match="already minted"):
        ledger.add_key("webui", "a1b2", "f" * 64, created=DAY1)
    with pytest.raises(ValueError, match="already minted"):
        ledger.add_key("other", "zz", "d" * 64, created=DAY1)   # the same digest under another tenant
    assert ledger.keys() == [MintedKey("batch", "c3d4", "e" * 64, DAY1 + 5, None),
                             MintedKey("webui", "a1b2", "d" * 64, DAY1, None)]

    assert ledger.revoke_key("batch", "a1b2", revoked=DAY2) is False    # another tenant's key
    assert ledger.revoke_key("webui", "nope", revoked=DAY2) is False
    assert ledger.revoke_key("webui", "a1b2", revoked=DAY2) is True
    assert ledger.revoke_key("webui", "a1b2", revoked=DAY2 + 1) is False
    assert ledger.keys() == [MintedKey("batch", "c3d4", "e" * 64, DAY1 + 5, None),
                             MintedKey("webui", "a1b2", "d" * 64, DAY1, DAY2)]


def test_a_restart_keeps_rows_and_keys_and_goes_on_counting(path: Path) -> None:
    first = SqliteLedger(path, flush_interval_s=NEVER_S)
    _report_rows(first)
    first.add_key("webui", "a1b2", "d" * 64, created=DAY1)
    first.revoke_key("webui", "a1b2", revoked=DAY2)
    first.add_key("webui", "c3d4", "e" * 64, created=DAY2)
    before = (first.usage(None, None, ["tenant", "model", "day"]), first.spent("webui", DAY1), first.keys())
    first.close()    # closing writes what was queued: nothing was flushed before

    second = SqliteLedger(path, flush_interval_s=NEVER_S)
    try:
        assert (second.usage(None, None, ["tenant", "model", "day"]), second.spent("webui", DAY1),
                second.keys()) == before
        second.record(row(DAY2 + 300, output=1))
        assert second.spent("webui", DAY1).requests == 5
        second.flush()
        assert second.spent("webui", DAY1).requests == 5
        assert rows_on_disk(path) == 6
    finally:
        second.close()


def test_a_closed_ledger_refuses_rows(path: Path) -> None:
    ledger = SqliteLedger(path)
    ledger.close()
    with pytest.raises(RuntimeError, match="closed"):
        ledger.record(row(DAY1))
    ledger.close()


def test_an_empty_file_is_migrated_to_the_current_schema(path: Path) -> None:
    path.touch()
    SqliteLedger(path).close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert {"usage", "keys"} <= tables
        indexes = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert "usage_tenant_time" in indexes
    finally:
        conn.close()


def test_the_migration_steps_run_in_order_from_version_1() -> None:
    assert sorted(MIGRATIONS) == list(range(1, SCHEMA_VERSION + 1))


def test_a_file_from_a_newer_schema_is_refused_and_left_alone(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(ValueError, match=f"version {SCHEMA_VERSION + 1}.*versions 0 to {SCHEMA_VERSION}"):
        SqliteLedger(path)
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
        assert conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0
    finally:
        conn.close()


# The child records a row every few milliseconds and prints each row's time once it is recorded.
CHILD = """
import sys, time
from pathlib import Path
from proxy.tenants.ledger import SqliteLedger, UsageRow
ledger = SqliteLedger(Path(sys.argv[1]), flush_interval_s=0.2)
while True:
    t = time.time()
    ledger.record(UsageRow(t, "webui", "k1", "qwen", "llama_server", "local", 200, 10, 0, 5, 0.0, 1.0, 2.0))
    print(repr(t), flush=True)
    time.sleep(0.005)
"""


def test_a_sigkill_loses_at_most_the_last_second(path: Path) -> None:
    rows_before_kill = 400
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    printed: list[float] = []
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            # A guard against a child that hangs, not a pace: the test goes on at the 400th line.
            deadline = time.monotonic() + 120
            while len(printed) < rows_before_kill:
                assert selector.select(timeout=max(0.0, deadline - time.monotonic())), "the child went quiet"
                line = proc.stdout.readline()
                assert line, f"the child exited: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}"
                printed.append(float(line))
        killed_at = time.time()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    older = [t for t in printed if t < killed_at - 1.0]
    assert older, "the child ran less than a second"
    # Rows are begun and written in the order of the requests: those on disk are the first ones printed.
    with contextlib.closing(sqlite3.connect(path)) as conn:
        requests, latest = conn.execute("SELECT COALESCE(SUM(requests), 0), MAX(time) FROM usage").fetchone()
    assert requests >= len(older), f"{len(older) - requests} request(s) older than 1 s lost"
    assert latest >= max(older)
    # And the file opens as a ledger again, with those rows in its sums.
    ledger = SqliteLedger(path)
    try:
        assert ledger.spent("webui", 0.0).requests >= len(older)
    finally:
        ledger.close()


def test_two_processes_on_one_file_during_a_reload_lose_no_row(path: Path) -> None:
    # A reload: the old proxy still records the requests it finishes while its successor, which
    # opened the same file, records the new ones.
    old = SqliteLedger(path)
    old.record(row(1.0))
    old.flush()
    new = SqliteLedger(path)
    try:
        for i in range(50):
            old.record(row(2.0 + i, tenant="old"))
            new.record(row(2.0 + i, tenant="new"))
        old.close()
        new.flush()
        assert rows_on_disk(path) == 101
        assert new.spent("old", 0.0).requests == 50 and new.spent("new", 0.0).requests == 50
    finally:
        new.close()


# -- a bad row, an old file, another process's rows (issue 39) ------------------------------------

def test_a_row_with_counts_that_are_no_counts_is_recorded_with_0_and_the_writer_writes_on(
        ledger: SqliteLedger, path: Path) -> None:
    ledger.record(row(DAY1, prompt=10 ** 30, cached=-1, output=2 ** 31 + 1, cost=float("nan")))
    ledger.record(row(DAY1, prompt=True, output=2.5, cost=float("inf"), duration_ms=float("-inf")))  # type: ignore[arg-type]
    ledger.record(row(DAY1, prompt=3, output=4, cost=0.5))
    ledger.flush()
    assert ledger.usage(None, None, []) == [{"requests": 3, "prompt_tokens": 3, "cached_tokens": 0, "output_tokens": 4,
                                             "cost": 0.5, "errors": 0, "estimated": 0, "queue_wait_ms": 0.0,
                                             "duration_ms": 0.0}]
    assert ledger.failing() is None


def test_a_row_the_file_refuses_is_skipped_and_the_writer_lives(ledger: SqliteLedger, path: Path) -> None:
    ledger.record(row(DAY1, tenant="webui"))
    ledger.record(row(DAY1, tenant="\ud800"))   # a lone surrogate: no UTF-8 for SQLite to store
    ledger.record(row(DAY1, tenant="batch"))
    ledger.flush()
    assert rows_on_disk(path) == 2
    ledger.record(row(DAY1, tenant="webui"))
    ledger.flush()   # the thread is still there to write it
    assert rows_on_disk(path) == 3 and ledger.failing() is None


def test_a_version_1_file_is_migrated_with_its_rows_one_request_each_not_estimated(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    MIGRATIONS[1](conn)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO usage (id, time, tenant, key_id, model, backend, host, status, prompt_tokens, "
                 "cached_tokens, output_tokens, cost, queue_wait_ms, duration_ms) "
                 "VALUES (1, ?, 'webui', 'k1', 'qwen', 'sim', 'local', 200, 10, 0, 5, 0.0, 0.0, 0.0)", (DAY1,))
    conn.close()
    ledger = SqliteLedger(path, flush_interval_s=NEVER_S)
    try:
        ledger.record(row(DAY1 + 1, estimated=True))
        for flushed in (False, True):
            (total,) = ledger.usage(None, None, [])
            assert (total["requests"], total["prompt_tokens"], total["estimated"]) == (2, 20, 1), flushed
            assert ledger.spent("webui", DAY1) == Spent(2, 20, 0, 10, 0.0), flushed
            ledger.flush()
    finally:
        ledger.close()


@pytest.mark.parametrize("old_wrote", [True, False], ids=["old_wrote_first", "old_wrote_nothing_yet"])
def test_others_are_the_rows_a_predecessor_writes_after_this_ledger_opened(path: Path, old_wrote: bool) -> None:
    old = SqliteLedger(path, flush_interval_s=NEVER_S)
    if old_wrote:
        old.record(row(DAY1, tenant="before"))
        old.flush()
    new = SqliteLedger(path, flush_interval_s=NEVER_S)
    try:
        assert new.others() == []
        old.record(row(DAY1 + 1, tenant="old", prompt=3, output=4, cost=0.25))
        old.record(row(DAY1 + 1.5, tenant="old", prompt=3, output=4, cost=0.25))   # the same second: one row
        new.record(row(DAY1 + 2, tenant="new"))   # its own: never among the others
        new.flush()
        assert new.others() == []                  # not on disk yet
        old.close()
        assert new.others() == [("old", DAY1 + 1.5, 2, 14, 0.5)]
        assert new.others() == []                  # each row once
        assert rows_on_disk(path) == 2 + old_wrote   # no id of one met the other's
    finally:
        new.close()


def test_a_ledger_that_read_others_closes_from_another_thread(path: Path) -> None:
    ledger = SqliteLedger(path, flush_interval_s=NEVER_S)
    assert ledger.others() == []
    with ThreadPoolExecutor(1) as pool:   # as the app closes it: asyncio.to_thread
        pool.submit(ledger.close).result(30)
