"""The slot store: llama-server slot files under <state_dir>/kv, within a disk budget shared by
every model (engine.lifecycle.kv_store_mib), the least recently saved going first.

Each model's replicas save into the folder of its settings key (the footprints' key: a change to
anything that shapes its cache is another folder), and every file is recorded with a fingerprint
of the settings, the model file and the engine binary it came from: a file is restored only into a
replica with the same fingerprint, so a changed model never restores a stale cache. The index
(`index.json`) is the truth; a file it does not name (a save cut short, a proxy killed meanwhile)
is removed when the store opens. One entry per model, replica and slot: a newer save replaces it.
The folder is the owner's only: the files hold what the conversations said.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable

from proxy.atomic_file import PRIVATE_MODE, read_back, write_atomic

log = logging.getLogger(__name__)

INDEX = "index.json"
PRIVATE_FOLDER = 0o700


@dataclass(frozen=True)
class Saved:
    """One saved slot: whose, from where, and what it holds."""

    model: str
    folder: str          # the settings key: the folder under the store's root
    fingerprint: str     # settings, model file and engine binary (keeper.fingerprint)
    replica: int         # the replica index it was saved from, restored into the same
    slot: int
    key: str | None      # the affinity key of the conversation in it; None: not known
    file: str            # its name in the folder (ours, never a client's)
    bytes: int
    tokens: int
    saved_at: float      # wall clock

    @property
    def ident(self) -> tuple[str, int, int]:
        return self.model, self.replica, self.slot


def new_file_name() -> str:
    # llama-server takes a plain file name in its --slot-save-path (fs_validate_filename).
    return f"slot-{secrets.token_hex(8)}.bin"


class SlotStore:
    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget = budget_bytes
        self._entries: dict[tuple[str, int, int], Saved] = {}
        self._open()

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def folder(self, settings_key: str) -> Path:
        """The folder a model with these settings saves into (made, the owner's only)."""
        path = self.root / settings_key
        path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_FOLDER)
        self.root.chmod(PRIVATE_FOLDER)
        return path

    def path(self, entry: Saved) -> Path:
        return self.root / entry.folder / entry.file

    def total(self) -> int:
        return sum(e.bytes for e in self._entries.values())

    def bytes_of(self, model: str) -> int:
        return sum(e.bytes for e in self._entries.values() if e.model == model)

    def entries(self, model: str | None = None) -> list[Saved]:
        return [e for e in self._entries.values() if model is None or e.model == model]

    def add(self, entry: Saved, keep: Iterable[tuple[str, int, int]] = ()) -> bool:
        """Record a file just saved, making room by removing the least recently saved entries of
        any model but those in `keep` (the ones saved just before it, in the same unload: newer
        than it). False, and its file removed, when it does not fit: the caller stops saving."""
        kept = set(keep)
        replaced = self._entries.pop(entry.ident, None)
        if replaced is not None and replaced.file != entry.file:
            self._remove_file(replaced)
        need = self.total() + entry.bytes - self.budget
        for old in sorted(self._entries.values(), key=lambda e: e.saved_at):
            if need <= 0:
                break
            if old.ident in kept:
                continue
            del self._entries[old.ident]
            self._remove_file(old)
            need -= old.bytes
        if need > 0:
            self._remove_file(entry)
            self._write()
            return False
        self._entries[entry.ident] = entry
        with_mode(self.path(entry))
        self._write()
        return True

    def take(self, model: str, replica: int) -> list[Saved]:
        """The entries saved from replica `replica` of `model`, out of the index (their files stay
        until `discard`): a slot is restored once; a next unload saves it afresh."""
        taken = [e for e in self._entries.values() if e.model == model and e.replica == replica]
        for e in taken:
            del self._entries[e.ident]
        if taken:
            self._write()
        return sorted(taken, key=lambda e: e.slot)

    def discard(self, entry: Saved) -> None:
        self._remove_file(entry)

    def drop_model(self, model: str) -> None:
        """Every entry of `model` goes (it was unloaded by an admin, or its replicas are gone)."""
        for e in [e for e in self._entries.values() if e.model == model]:
            del self._entries[e.ident]
            self._remove_file(e)
        self._write()

    def sweep(self, folder: str, name: str) -> None:
        """Remove a file that was being saved when its save was cut short (not in the index)."""
        if not any(e.folder == folder and e.file == name for e in self._entries.values()):
            _unlink(self.root / folder / name)

    def _open(self) -> None:
        data = read_back(self.root / INDEX)
        names = {f.name for f in fields(Saved)}
        for raw in (data or {}).get("entries", []) if isinstance(data, dict) else []:
            try:
                entry = Saved(**{k: raw[k] for k in names})
            except (KeyError, TypeError):
                continue
            if self.path(entry).is_file():
                self._entries[entry.ident] = entry
        # What the index does not name is a save that never finished: it goes.
        named = {(e.folder, e.file) for e in self._entries.values()}
        if self.root.is_dir():
            for folder in self.root.iterdir():
                if not folder.is_dir():
                    continue
                for file in folder.iterdir():
                    if (folder.name, file.name) not in named:
                        _unlink(file)
                if not any(folder.iterdir()):
                    folder.rmdir()
        if self._entries and self.total() > self.budget:
            for old in sorted(self._entries.values(), key=lambda e: e.saved_at):
                if self.total() <= self.budget:
                    break
                del self._entries[old.ident]
                self._remove_file(old)
        self._write()

    def _remove_file(self, entry: Saved) -> None:
        _unlink(self.path(entry))

    def _write(self) -> None:
        if not self._entries and not (self.root / INDEX).exists():
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=PRIVATE_FOLDER)
            write_atomic(self.root / INDEX, json.dumps(
                {"version": 1, "entries": [asdict(e) for e in self._entries.values()]}, indent=1),
                mode=PRIVATE_MODE)
        except OSError as exc:
            log.warning("could not write %s: %s", self.root / INDEX, exc)


def with_mode(path: Path) -> None:
    """The engine wrote the file with its umask's mode: it holds conversations, so it is the owner's."""
    try:
        os.chmod(path, PRIVATE_MODE)
    except OSError:
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
