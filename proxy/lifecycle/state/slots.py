"""Which llama-server slot holds which conversation on one replica (the KV store, issue 33). Pure.

A replica started with --parallel N has N slots, and the proxy never sends it more than N requests
at once. A request with an affinity key goes to its key's slot (`id_slot`) when that slot is free,
else to the free slot used least recently, which is then the key's. Without this, which slot a
conversation sat in is known only to llama-server (its OpenAI answers do not say), so a slot saved
before an eviction could not be given back to its conversation by name after the reload.

With tenants, a slot's cache is also a tenant's: a request reuses the prefix a slot holds, and its
answer's cached-token count (and its speed) says how much of another tenant's prompt it repeated.
So a key names its scope (the tenant, after SCOPE_MARK; no tenants: one scope, ""), every slot
remembers the scope whose cache it holds, and a request given a slot of another scope, or of an
unknown one (a fresh table with tenants, an adopted replica, a restore of no key), is told so: it
must not reuse that cache (the caller sends llama-server `cache_prompt: false`).

A LoRA adapter's cache is its own too (docs/adapters.md): llama-server clears a slot's cache when a
request names other adapters than the slot last ran with, but not when a request names none after
one that named some (measured on the pinned build's code: `launch_slot_with_task`), so a base
request there would reuse what was computed under the adapter. So the scope is the tenant and the
adapter (`cache_scope`), and a request given a slot of another adapter's, or of the base's, reuses
nothing there either.

A slot a restore filled is checked by the first request that runs there: when that request is its
conversation's, its answer must show cached tokens (`checked`, and the KV store's rule); any other
request there first leaves nothing to check, since the restored cache is no longer what it reads.
"""
from __future__ import annotations

import time
from collections import OrderedDict

SCOPE_MARK = "@"


def cache_scope(tenant: str | None, adapter: str | None, adapters: bool) -> str | None:
    """Whose cache a request's slot may reuse: its tenant's, computed under its adapter (a tenant's
    name has no ':'); None for a model without adapters in a pool without tenants, whose keyless
    requests go where llama-server puts them."""
    if tenant is None and not adapters:
        return None
    return f"{tenant or ''}:{adapter}" if adapter is not None else tenant or ""


def adapter_of(key: str) -> str | None:
    """The adapter whose cache a key's slot holds (`cache_scope`), or None for the base's."""
    _, colon, adapter = scope_of(key).partition(":")
    return adapter if colon else None


def scoped(key: str, scope: str) -> str:
    """`key` (never holding SCOPE_MARK) in `scope`: two tenants' equal keys are different keys."""
    return f"{key}{SCOPE_MARK}{scope}" if scope else key


def scope_of(key: str) -> str:
    return key.partition(SCOPE_MARK)[2]


class SlotTable:
    def __init__(self, slots: int, scoped: bool = False) -> None:
        self.slots = max(1, slots)
        # The scope whose cache each slot holds; None: unknown. Without tenants there is one scope.
        self._scope: dict[int, str | None] = {s: None if scoped else "" for s in range(self.slots)}
        self._key_of: dict[int, str] = {}             # slot -> the key whose cache it holds
        self._slot_of: dict[str, int] = {}            # key -> its slot
        self._busy: dict[int, int] = {}               # slot -> requests the proxy has there now
        # Least recently used first: the order a new key takes a slot in.
        self._used: OrderedDict[int, None] = OrderedDict((s, None) for s in range(self.slots))
        self._at: dict[int, float] = {}               # slot -> when a request of ours last went there
        self._restored: set[int] = set()              # restored, no request there since
        self._checking: set[int] = set()              # its conversation's first request there runs now

    def take(self, key: str) -> tuple[int, bool]:
        """The slot for one request of `key`, marked busy until `release`, and whether it holds
        the cache of another scope (or an unknown one), which that request must not reuse."""
        slot = self._slot_of.get(key)
        if slot is None or self._busy.get(slot):
            free = [s for s in self._used if not self._busy.get(s)]
            # Every slot busy cannot happen while the proxy sends at most `slots` at once; should
            # it (a request the client left, still ending there), the least recent one waits.
            slot = free[0] if free else next(iter(self._used))
        foreign = self._scope[slot] != scope_of(key)
        first = slot in self._restored and self._slot_of.get(key) == slot
        self._restored.discard(slot)
        if first:
            self._checking.add(slot)
        else:
            self._checking.discard(slot)   # a second request there before the first's answer said
        self.assign(key, slot)
        if foreign:
            # Still the other scope's cache until this request has run there (`ran`): one that the
            # engine refused, or that never reached it, left that cache as it was.
            self._scope[slot] = None
        self._busy[slot] = self._busy.get(slot, 0) + 1
        self._at[slot] = time.monotonic()
        return slot, foreign

    def release(self, slot: int) -> None:
        left = self._busy.get(slot, 0) - 1
        if left > 0:
            self._busy[slot] = left
        else:
            self._busy.pop(slot, None)

    def assign(self, key: str, slot: int) -> None:
        """`slot` holds `key`'s cache now (a request sent there, or a restore)."""
        old_key = self._key_of.get(slot)
        if old_key is not None:
            self._slot_of.pop(old_key, None)
        old_slot = self._slot_of.get(key)
        if old_slot is not None:
            self._key_of.pop(old_slot, None)
        self._key_of[slot], self._slot_of[key] = key, slot
        self._scope[slot] = scope_of(key)
        self._used.move_to_end(slot)

    def restored(self, key: str, slot: int) -> None:
        """A restore put `key`'s saved cache in `slot`: its next request there is the check."""
        self.assign(key, slot)
        self._restored.add(slot)

    def checked(self, slot: int) -> bool:
        """Whether an answer of a request that ran in `slot` is its restore's check: the first
        request there since the restore, and its conversation's. True once."""
        if slot not in self._checking:
            return False
        self._checking.discard(slot)
        return True

    def ran(self, slot: int, key: str) -> None:
        """The engine answered 200 to a request of `key` in `slot` (llama-server answers once the
        prompt is in the slot): the slot holds that key's scope's cache, unless another key took it since."""
        if self._key_of.get(slot) == key:
            self._scope[slot] = scope_of(key)

    def key_of(self, slot: int) -> str | None:
        return self._key_of.get(slot)

    def last_used(self, slot: int) -> float:
        """When a request of ours last went to `slot` (monotonic); 0 if none did (an unkeyed
        request's slot is llama-server's choice, and then its own task ids order it)."""
        return self._at.get(slot, 0.0)
