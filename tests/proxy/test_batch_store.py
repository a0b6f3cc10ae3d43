"""What the Batch API keeps (proxy/batches/store.py), on a real SQLite file in a temporary folder:
files within their budget and 0600, a batch's lines claimed once, counted once, recovered from a
process that is gone, expired, and written out in the input's order."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from proxy.batches.store import BatchStore, StorageFull, new_id


def store(tmp_path: Path, budget: int = 10_000) -> BatchStore:
    return BatchStore(tmp_path / "batches", budget, clock=lambda: 1_800_000_000.0)


def batch(s: BatchStore, lines: int, owner: str = "a") -> dict[str, Any]:
    doc = {"id": new_id("batch_"), "object": "batch", "status": "in_progress", "created_at": 1,
           "request_counts": {"total": lines, "completed": 0, "failed": 0}}
    s.create_batch(owner, doc, "m", ((f"c{i}", json.dumps({"i": i})) for i in range(lines)))
    return doc


def test_a_file_is_kept_0600_and_seen_only_by_its_owner(tmp_path: Path) -> None:
    s = store(tmp_path)
    row = s.add_file("a", "in.jsonl", "batch", b"{}\n")
    assert s.read(row) == b"{}\n" and os.stat(s.path_of(row)).st_mode & 0o777 == 0o600
    assert os.stat(s.path).st_mode & 0o777 == 0o600 and os.stat(tmp_path / "batches").st_mode & 0o777 == 0o700
    assert s.file(row.id, "a") == row and s.file(row.id, "b") is None and s.file(row.id, None) == row
    assert [r.id for r in s.list_files("a")] == [row.id] and s.list_files("b") == []
    s.delete_file(row)
    assert s.file(row.id, "a") is None and not s.path_of(row).exists()


def test_an_upload_past_the_budget_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    s = store(tmp_path, budget=10)
    s.add_file("a", "x", "batch", b"123456")
    with pytest.raises(StorageFull) as full:
        s.add_file("a", "y", "batch", b"12345")
    assert (full.value.used, full.value.adding, full.value.budget) == (6, 5, 10)
    assert len(list(s.files.iterdir())) == 1 and s.used_bytes() == 6


def test_lines_are_claimed_once_in_order_and_counted_once(tmp_path: Path) -> None:
    s = store(tmp_path)
    doc = batch(s, 5)
    first = s.claim(doc["id"], 2, 100)
    assert [(i, c) for i, c, _ in first] == [(0, "c0"), (1, "c1")]
    assert [i for i, _, _ in s.claim(doc["id"], 10, 200)] == [2, 3, 4]
    assert s.claim(doc["id"], 10, 100) == []
    s.finish(doc["id"], 0, True, {"custom_id": "c0"}, (10, 4, 3))
    s.finish(doc["id"], 1, False, {"custom_id": "c1"})
    assert s.batch(doc["id"], "a")["request_counts"] == {"total": 5, "completed": 1, "failed": 1}
    assert s.batch(doc["id"], "a")["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4},
                                                "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                                                "total_tokens": 13}
    assert s.batch(doc["id"], "b") is None
    assert s.counts(doc["id"]) == {"pending": 0, "running": 3, "done": 2}


def test_a_gone_process_lines_are_pending_again_and_an_unclaimed_line_too(tmp_path: Path) -> None:
    s = store(tmp_path)
    doc = batch(s, 4)
    s.claim(doc["id"], 2, 100)
    s.claim(doc["id"], 1, 200)
    assert sorted(s.running_owners(200)) == [100]
    assert s.recover(100) == 2
    s.unclaim(doc["id"], 2)
    assert s.counts(doc["id"]) == {"pending": 4, "running": 0, "done": 0}
    assert [i for i, _, _ in s.claim(doc["id"], 10, 300)] == [0, 1, 2, 3]


def test_expiry_fails_the_pending_lines_only_and_the_files_hold_the_input_order(tmp_path: Path) -> None:
    s = store(tmp_path)
    doc = batch(s, 4)
    s.claim(doc["id"], 2, 100)
    s.finish(doc["id"], 1, True, {"custom_id": "c1"})
    assert s.expire(doc, lambda cid: {"custom_id": cid, "error": "expired"}) == 2   # c2, c3; c0 runs on
    s.finish(doc["id"], 0, True, {"custom_id": "c0"})
    out = s.write_results(doc["id"], "a", True, "out.jsonl")
    errors = s.write_results(doc["id"], "a", False, "errors.jsonl")
    assert out is not None and errors is not None
    assert [json.loads(x)["custom_id"] for x in s.read(out).splitlines()] == ["c0", "c1"]
    assert [json.loads(x)["custom_id"] for x in s.read(errors).splitlines()] == ["c2", "c3"]
    assert s.batch(doc["id"], None)["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert s.write_results(batch(s, 1)["id"], "a", True, "none.jsonl") is None   # no such line: no file
    s.close_batch({**doc, "status": "completed"})
    assert s.counts(doc["id"]) == {"pending": 0, "running": 0, "done": 0} and s.active()[0][0]["id"] != doc["id"]


def test_batches_list_newest_first_by_page(tmp_path: Path) -> None:
    s = store(tmp_path)
    docs = []
    for created in (1, 2, 3):
        doc = {"id": new_id("batch_"), "status": "in_progress", "created_at": created,
               "request_counts": {"total": 0, "completed": 0, "failed": 0}}
        s.create_batch("a", doc, "m", ())
        docs.append(doc["id"])
    page, more = s.list_batches("a", None, 2)
    assert [d["id"] for d in page] == docs[:0:-1] and more
    page, more = s.list_batches("a", page[-1]["id"], 2)
    assert [d["id"] for d in page] == [docs[0]] and not more
    assert s.list_batches("b", None, 10) == ([], False)
