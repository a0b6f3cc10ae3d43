"""The slot store: its disk budget across models, the least recently saved first; a batch's newer
entries never pushed out by its older ones; what survives a restart; and what does not."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from proxy.lifecycle.kvcache.store import INDEX, Saved, SlotStore, new_file_name


def saved(store: SlotStore, model: str, slot: int, size: int, at: float, replica: int = 0,
          folder: str = "k1") -> Saved:
    """An entry whose file exists, `size` bytes, as the engine would have written it."""
    name = new_file_name()
    (store.folder(folder) / name).write_bytes(b"x" * size)
    return Saved(model=model, folder=folder, fingerprint="fp", replica=replica, slot=slot, key=f"s:{slot}",
                 file=name, bytes=size, tokens=size // 10, saved_at=at)


def files(root: Path) -> set[str]:
    return {p.name for p in root.rglob("slot-*.bin")}


def test_the_budget_holds_across_models_and_the_oldest_go_first(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", budget_bytes=1000)
    a0 = saved(store, "a", 0, 400, at=1.0)
    b0 = saved(store, "b", 0, 400, at=2.0, folder="k2")
    assert store.add(a0) and store.add(b0)
    a1 = saved(store, "a", 1, 400, at=3.0)
    assert store.add(a1)
    # a0 was the oldest, of any model: it went, file and all.
    assert {e.ident for e in store.entries()} == {b0.ident, a1.ident}
    assert store.total() == 800 <= store.budget
    assert files(store.root) == {b0.file, a1.file}
    assert store.bytes_of("a") == 400 and store.bytes_of("b") == 400


def test_a_save_never_pushes_out_the_newer_ones_of_its_own_unload(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", budget_bytes=1000)
    first = saved(store, "a", 0, 600, at=5.0)
    assert store.add(first)
    # Saved next in the same unload, so older in use: it may not push `first` out, and does not fit.
    second = saved(store, "a", 1, 600, at=6.0)
    assert not store.add(second, keep=[first.ident])
    assert [e.ident for e in store.entries()] == [first.ident]
    assert files(store.root) == {first.file}


def test_one_bigger_than_the_budget_is_not_kept(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", budget_bytes=100)
    big = saved(store, "a", 0, 101, at=1.0)
    assert not store.add(big)
    assert store.entries() == [] and files(store.root) == set()


def test_a_newer_save_of_the_same_slot_replaces_the_older(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", budget_bytes=1000)
    old = saved(store, "a", 0, 100, at=1.0)
    new = saved(store, "a", 0, 200, at=2.0)
    assert store.add(old) and store.add(new)
    assert store.entries() == [new] and files(store.root) == {new.file}


def test_entries_survive_a_restart_and_what_the_index_does_not_name_goes(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", budget_bytes=1000)
    kept, lost = saved(store, "a", 0, 100, at=1.0), saved(store, "a", 1, 100, at=2.0)
    assert store.add(kept) and store.add(lost)
    (store.root / lost.folder / lost.file).unlink()        # its file went missing
    orphan = store.folder("k1") / new_file_name()           # a save cut short, never recorded
    orphan.write_bytes(b"half")
    again = SlotStore(tmp_path / "kv", budget_bytes=1000)
    assert again.entries() == [kept]
    assert files(again.root) == {kept.file}


def test_a_corrupt_index_costs_the_saved_slots_not_the_proxy(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", budget_bytes=1000)
    entry = saved(store, "a", 0, 100, at=1.0)
    assert store.add(entry)
    (store.root / INDEX).write_text("{not json")
    again = SlotStore(tmp_path / "kv", budget_bytes=1000)
    assert again.entries() == [] and files(again.root) == set()
    (store.root / INDEX).write_text(json.dumps({"entries": [{"model": "a"}, "x", {**entry.__dict__, "slot": None}]}))
    assert SlotStore(tmp_path / "kv", budget_bytes=1000).entries() == []


def test_a_smaller_budget_after_a_restart_drops_the_oldest(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", budget_bytes=1000)
    old, new = saved(store, "a", 0, 400, at=1.0), saved(store, "b", 0, 400, at=2.0)
    assert store.add(old) and store.add(new)
    again = SlotStore(tmp_path / "kv", budget_bytes=500)
    assert again.entries() == [new] and files(again.root) == {new.file}


def test_take_hands_a_replicas_entries_over_once(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", budget_bytes=10_000)
    entries = [saved(store, "a", s, 10, at=float(s), replica=r) for r in (0, 1) for s in (1, 0)]
    for e in entries:
        assert store.add(e)
    taken = store.take("a", 0)
    assert [(e.replica, e.slot) for e in taken] == [(0, 0), (0, 1)]
    assert store.take("a", 0) == []
    assert all(store.path(e).exists() for e in taken)   # until discarded: the engine reads them
    for e in taken:
        store.discard(e)
    assert files(store.root) == {e.file for e in entries if e.replica == 1}
    store.drop_model("a")
    assert store.entries() == [] and files(store.root) == set()


def test_the_files_are_the_owners_only(tmp_path: Path) -> None:
    store = SlotStore(tmp_path / "kv", budget_bytes=1000)
    entry = saved(store, "a", 0, 10, at=1.0)
    os.chmod(store.path(entry), 0o644)   # as the engine writes it, with its umask
    assert store.add(entry)
    assert stat.S_IMODE(store.path(entry).stat().st_mode) == 0o600
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    assert stat.S_IMODE((store.root / "k1").stat().st_mode) == 0o700
    assert stat.S_IMODE((store.root / INDEX).stat().st_mode) == 0o600
