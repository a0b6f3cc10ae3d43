"""What keeps a llama-server model's conversations across a swap (issue 33): its replicas started
with a --slot-save-path of the store's, their slots saved before the pool unloads the model (idle,
or evicted for another), and restored into the next replicas of the same index before they serve.

Saving is bounded twice: by the store's disk budget, the most recently used slots first, and by
time, so that it never holds a waiting load past its swap bound (the caller says how long it may
take; a save still running then is cut short and its file removed). Restoring never fails a
request: a file of other settings, model file or engine (its fingerprint), or one the engine
refuses, is a miss, removed, and that conversation is prefilled again as it would have been.

With tenants (`scoped`) every llama-server replica that generates text gets a table of its slots,
store or not, each slot a tenant's (proxy/lifecycle/state/slots.py), and runs without llama-server's
RAM prompt cache (--cache-ram), which hands a slot the saved state of whichever slot's prompt
matched best, another tenant's too (measured on the pinned build).

A restore is checked, not assumed: llama-server can answer a restore with its token count and then
reuse none of it (sliding-window and recurrent models, llama.cpp's known bugs). The first
request of the conversation in a restored slot must show cached tokens in its answer. A model's
first such check decides (`checked`): no reuse, and the model is `restore_unverified` (an event
says why, its stored slots go, and it saves no more until the proxy restarts); reuse, and it is
verified, and a later answer without reuse is a conversation that changed its history, only counted.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from launchers.spec import ProgramSpec
from proxy.config.model import ModelConfig
from proxy.events import KV_STORE, Events
from proxy.lifecycle.kvcache import slots_api
from proxy.lifecycle.kvcache.slots_api import SlotError, SlotInfo
from proxy.lifecycle.kvcache.store import Saved, SlotStore, new_file_name
from proxy.lifecycle.placement.footprints import settings_key
from proxy.lifecycle.state.replicas import Replica, ReplicaState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.lifecycle.state.slots import SlotTable, adapter_of
from proxy.upstream.client import UpstreamHttp

log = logging.getLogger(__name__)

BACKEND = "llama_server"
STORE_FOLDER = "kv"
# Flags whose files shape what a slot holds, beside the engine binary itself.
FILE_FLAGS = frozenset({"--model", "-m", "--mmproj", "--lora", "--model-draft", "-md"})
SCALED_FILE_FLAG = "--lora-scaled"   # FILE:SCALE (a model's lora_adapters)
RESULTS = ("hit", "miss", "stale")
CHECKS = ("verified", "unverified")
# llama-server's --cache-ram, as its environment variable: a binary without the option ignores it.
NO_RAM_CACHE = ("LLAMA_ARG_CACHE_RAM", "0")


def fingerprint(key: str, spec: ProgramSpec) -> str:
    """What a slot file must have been saved under to be restored into a replica of `spec`: the
    settings key, and the size and time of the engine binary and of every model file it loads."""
    argv = spec.argv
    files = [shutil.which(argv[0]) or argv[0]] + [argv[i + 1] for i in range(len(argv) - 1) if argv[i] in FILE_FLAGS]
    files += [argv[i + 1].rsplit(":", 1)[0] for i in range(len(argv) - 1) if argv[i] == SCALED_FILE_FLAG]
    parts = [key]
    for name in files:
        try:
            st = os.stat(name)
            parts.append(f"{name}\x00{st.st_size}\x00{st.st_mtime_ns}")
        except OSError:
            parts.append(f"{name}\x00missing")
    return hashlib.sha256("\x01".join(parts).encode()).hexdigest()[:24]


@dataclass
class Counts:
    """One model's saves and restores since the proxy started (the admin view, /metrics)."""

    saved: int = 0
    cut_short: int = 0        # slots not saved because the time bound ran out
    over_budget: int = 0      # slots not saved because the budget was full of newer ones
    restored: Counter[str] = field(default_factory=Counter)   # by RESULTS
    # How long the last unload's saves and the last replica's restores took, all told: what a swap waited.
    last_save_s: float | None = None
    last_restore_s: float | None = None
    # Restored slots whose conversation's next answer showed reuse, or none (`KvKeeper.checked`).
    checks: Counter[str] = field(default_factory=Counter)   # by CHECKS
    restore_unverified: bool = False   # its first check showed none: it saves no more


class KvKeeper:
    def __init__(self, store: SlotStore, http: UpstreamHttp, scoped: bool = False,
                 events: Events | None = None) -> None:
        self.store = store
        self.http = http
        self.scoped = scoped   # tenants: slots are tenants' (above)
        self.events = events
        self.counts: dict[str, Counts] = {}
        self._cut: list[tuple[str, str]] = []   # (folder, file) of saves cut short: see `stopped`

    @classmethod
    def under(cls, state_dir: Path, budget_mib: float, http: UpstreamHttp, scoped: bool = False,
              events: Events | None = None) -> "KvKeeper":
        return cls(SlotStore(state_dir / STORE_FOLDER, int(budget_mib * 1024 * 1024)), http, scoped, events)

    def applies(self, config: ModelConfig) -> bool:
        """Whether `config`'s replicas keep their slots: llama-server generating text, with a store
        to keep them in."""
        return self.store.enabled and self.slotted(config)

    @staticmethod
    def slotted(config: ModelConfig) -> bool:
        """llama-server generating text: embeddings and reranking hold nothing between requests."""
        return config.backend == BACKEND and \
            not config.get("llama_server_embeddings") and not config.get("llama_server_reranking")

    def tabled(self, config: ModelConfig) -> bool:
        """Whether the proxy picks the slot of each of `config`'s requests (a table of its slots):
        for the store, and where a slot's cache belongs to a tenant or an adapter."""
        return self.slotted(config) and (self.store.enabled or self.scoped or bool(config.adapters))

    def launch(self, config: ModelConfig, spec: ProgramSpec, local: bool) -> ProgramSpec:
        """`spec` with the store's folder for its settings as --slot-save-path (a replica on this
        machine only: the files must be where the budget is kept); with tenants or adapters, without
        the RAM prompt cache, which puts a saved state in a slot without asking whose it is."""
        if (self.scoped or config.adapters) and self.slotted(config):
            spec = replace(spec, env=(*spec.env, NO_RAM_CACHE))
        if not local or not self.applies(config):
            return spec
        folder = self.store.folder(settings_key(config))
        return replace(spec, argv=(*spec.argv, "--slot-save-path", str(folder)))

    def of(self, model: str) -> Counts:
        return self.counts.setdefault(model, Counts())

    # -- before an unload -------------------------------------------------------------------------

    async def save(self, runtime: ModelRuntime, seconds: float) -> None:
        """Save the slots of `runtime`'s READY replicas that hold a conversation, the most recently
        used first, until the budget is full or `seconds` are up. Nothing raised: what is not saved
        is prefilled again after the reload, as without the store."""
        config = runtime.active or runtime.config
        if not self.applies(config) or self.of(runtime.name).restore_unverified:
            return
        if seconds <= 0:
            log.info("model %s: no slots saved: the load it makes room for has waited its swap bound", runtime.name)
            return
        deadline = time.monotonic() + seconds
        key = settings_key(config)
        counts = self.of(runtime.name)
        held: list[tuple[float, int, Replica, SlotInfo]] = []
        for replica in runtime.replicas:
            if replica.state != ReplicaState.READY or replica.spec is None:
                continue
            try:
                infos = await slots_api.slots(self.http, replica, deadline - time.monotonic())
            except SlotError as exc:
                log.info("model %s replica %d: slots not saved: /slots: %s", runtime.name, replica.index, exc)
                continue
            table = replica.slots
            # A slot restored and not used since shows no tokens (llama-server reports a slot's
            # tokens by its last task), yet holds its conversation: the table knows it.
            held += [(table.last_used(i.id) if table else 0.0, i.task, replica, i) for i in infos
                     if not i.busy and (i.tokens > 0 or (table is not None and table.key_of(i.id) is not None))
                     and not _adapters(table, i.id)]
        batch: list[tuple[str, int, int]] = []
        prints: dict[int, str] = {}
        folder = key
        # Saved in order of use, most recent first: each a little "older" than the one before, so that
        # the budget's least-recently-saved-first order is the order of use, not the order of saving.
        started = time.time()
        for n, (_used, _task, replica, info) in enumerate(sorted(held, key=lambda h: (h[0], h[1]), reverse=True)):
            left = deadline - time.monotonic()
            if left <= 0:
                counts.cut_short += len(held) - n
                break
            name = new_file_name()
            try:
                done = await asyncio.wait_for(slots_api.save(self.http, replica, info.id, name, left), left)
            except (SlotError, asyncio.TimeoutError) as exc:
                self.store.sweep(folder, name)
                self._cut.append((folder, name))   # the engine may still write it: swept again once stopped
                if isinstance(exc, asyncio.TimeoutError) or deadline - time.monotonic() <= 0:
                    counts.cut_short += len(held) - n
                    break
                log.info("model %s replica %d slot %d: not saved: %s", runtime.name, replica.index, info.id, exc)
                continue
            if done.tokens == 0:
                self.store.sweep(folder, name)
                continue
            assert replica.spec is not None
            if replica.index not in prints:   # the files it loads are looked at once per replica
                prints[replica.index] = fingerprint(key, replica.spec)
            conversation = replica.slots.key_of(info.id) if replica.slots else None
            entry = Saved(model=runtime.name, folder=folder, fingerprint=prints[replica.index],
                          replica=replica.index, slot=info.id, key=conversation, file=name,
                          bytes=self._size(folder, name, done.bytes), tokens=done.tokens, saved_at=started - n * 1e-3)
            if not self.store.add(entry, keep=batch):
                counts.over_budget += len(held) - n
                break
            batch.append(entry.ident)
            counts.saved += 1
        counts.last_save_s = round(time.monotonic() - (deadline - seconds), 4)
        if batch:
            log.info("model %s: %d slots saved (%d bytes) in %.3fs before its unload", runtime.name, len(batch),
                     sum(e.bytes for e in self.store.entries(runtime.name)), counts.last_save_s)

    def stopped(self) -> None:
        """The replicas of an unload stopped: a file whose save was cut short, and that the engine
        wrote after all, goes now (the budget counts only what the index names)."""
        for folder, name in self._cut:
            self.store.sweep(folder, name)
        self._cut.clear()

    def _size(self, folder: str, name: str, reported: int) -> int:
        # The file's size on disk is what the budget counts; the engine's figure if it cannot be read.
        try:
            return os.stat(self.store.root / folder / name).st_size
        except OSError:
            return reported

    # -- before a replica serves ------------------------------------------------------------------

    async def restore(self, runtime: ModelRuntime, replica: Replica, seconds: float) -> None:
        """Give a replica that just passed its health check (and warm-up) the slots saved from the
        replica of its index, and its table of which conversation is in which slot. Never raises:
        what does not restore is a miss, and those conversations are prefilled again."""
        config = runtime.active or runtime.config
        if replica.spec is None or not self.tabled(config):
            replica.slots = None
            return
        # A process an earlier proxy started: which conversation sits in which slot died with that
        # proxy, and llama-server's own prefix matching finds them better than a fresh table would;
        # with tenants or adapters, its slots hold caches of unknown tenants or adapters, which no
        # request may reuse.
        adopted, replica.adopted = replica.adopted, False
        unknown = self.scoped or (adopted and bool(config.adapters))
        table = replica.slots = SlotTable(config.target_inflight, scoped=True) if unknown else \
            None if adopted else SlotTable(config.target_inflight)
        if table is None or adopted or not self.applies(config):
            return
        entries = self.store.take(runtime.name, replica.index)
        if not entries:
            return
        deadline = time.monotonic() + seconds
        key = settings_key(config)
        expected = fingerprint(key, replica.spec)
        counts = self.of(runtime.name)
        for entry in entries:
            result = "miss"
            try:
                if entry.folder != key or entry.fingerprint != expected:
                    result = "stale"
                    continue
                if entry.slot >= table.slots:
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    continue
                try:
                    done = await asyncio.wait_for(
                        slots_api.restore(self.http, replica, entry.slot, entry.file, left), left)
                except (SlotError, asyncio.TimeoutError) as exc:
                    log.info("model %s replica %d slot %d: not restored (%s): it is prefilled again",
                             runtime.name, replica.index, entry.slot, str(exc) or "timed out")
                    continue
                if done.tokens != entry.tokens:
                    log.info("model %s replica %d slot %d: restored %d tokens of %d: not used", runtime.name,
                             replica.index, entry.slot, done.tokens, entry.tokens)
                    continue
                result = "hit"
                if entry.key is not None:
                    table.restored(entry.key, entry.slot)
                    runtime.keys.note(entry.key, replica.index, moved=True)
            finally:
                counts.restored[result] += 1
                self.store.discard(entry)
        counts.last_restore_s = round(time.monotonic() - (deadline - seconds), 4)
        log.info("model %s replica %d: %d saved slots given back in %.3fs (%s so far)", runtime.name, replica.index,
                 len(entries), counts.last_restore_s, ", ".join(f"{r} {counts.restored[r]}" for r in RESULTS))

    def checked(self, replica: Replica, slot: int, cached: int | None) -> None:
        """A request that ran in `slot` of `replica` was answered, reading `cached` prompt tokens from
        the cache there (None: the answer did not say). For the first request of a restored slot's
        conversation, that is its restore's check (above)."""
        table = replica.slots
        if cached is None or table is None or not table.checked(slot):
            return
        model = replica.model
        counts = self.of(model)
        counts.checks["verified" if cached > 0 else "unverified"] += 1
        if cached > 0 or counts.checks["verified"] or counts.restore_unverified:
            return
        counts.restore_unverified = True
        self.store.drop_model(model)   # restores that bring nothing: no disk for them
        message = (f"model {model}: replica {replica.index} slot {slot} was restored, yet its conversation's next "
                   "request reused none of it (0 cached tokens); llama-server does not restore this model's slots "
                   "(a sliding-window or recurrent model?): its slots are no longer saved before an unload")
        if self.events is not None:
            self.events.record(KV_STORE, message, model=model, replica=replica.index, reason="restore_unverified",
                               level=logging.WARNING)
        else:
            log.warning("%s", message)

    def forget(self, model: str) -> None:
        """An admin unloaded `model`: what was saved of it is not wanted any more."""
        self.store.drop_model(model)

    def describe(self, model: str) -> dict[str, object]:
        counts = self.of(model)
        entries = self.store.entries(model)
        return {"stored_slots": len(entries), "stored_bytes": sum(e.bytes for e in entries),
                "saved": counts.saved, "cut_short": counts.cut_short, "over_budget": counts.over_budget,
                "restored": {r: counts.restored.get(r, 0) for r in RESULTS},
                "restore_checks": {c: counts.checks.get(c, 0) for c in CHECKS},
                "restore_unverified": counts.restore_unverified,
                "last_save_s": counts.last_save_s, "last_restore_s": counts.last_restore_s}


def _adapters(table: SlotTable | None, slot: int) -> bool:
    """Whether `slot` holds an adapter's conversation: not saved, since llama-server clears a slot's
    restored cache at the first request that names an adapter (measured)."""
    key = table.key_of(slot) if table is not None else None
    return key is not None and adapter_of(key) is not None
