"""Affinity routing: which replica a request's affinity key belongs to, bounded by load. Pure.

Rendezvous (highest random weight) hashing: every (key, replica) pair gets a pseudo-random score,
and a key's replicas in order of score are its preference order. The order of the replicas that
remain is the same whichever others come or go, so a replica joining takes only the keys it now
tops, and one leaving gives up only its own keys; nothing else moves. A replica is named by its
index, which survives its process restarting.

The load bound keeps a popular key (or an unlucky spread) from piling onto one replica: the key's
first replica is taken unless it is full or busier than the least loaded one by more than
`max_imbalance`; then the next in the key's order that is neither (a spill).

A key that spilled has its cache on the replica it spilled to, not on its first: that replica comes
first for it from then on (`moved`), while it is READY and within the bound. Without it a spilled
conversation went home next turn, and every spill cost two prefills instead of one; with it, spills
move conversations off a crowded replica and they stay, so an uneven spread of keys (8 keys over 3
replicas is often 4 / 3 / 1) evens out after a few spills instead of spilling on every turn. Keys
that never spilled keep their rendezvous order, so joins and leaves move only what they did.

A full first replica that is still within the bound is waited for by a `patient` request (for
affinity_max_wait_s, ModelRuntime.pick_replica's caller decides): when every replica is nearly
full, whichever frees a slot first is a coin toss, and a request that takes it leaves its cache
behind (a whole prefill there, and another conversation's prefix pushed out of that cache). The
bound still holds while it waits: once another replica is idle enough that the first is beyond it,
the request spills there.
"""
from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Sequence

# Keys remembered per model for the admin view's per-replica count; the least recently used go first.
MAX_KEYS = 4096


def score(key: str, replica: int) -> int:
    """The weight of `replica` for `key`: 64 bits of blake2b, so it is the same in every process
    (Python's own hash() is salted per process) and spreads evenly."""
    digest = hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def order(key: str, replicas: Sequence[int]) -> list[int]:
    """`replicas` (indexes) in `key`'s order of preference, best first."""
    return sorted(replicas, key=lambda r: (-score(key, r), r))


@dataclass(frozen=True)
class Candidate:
    """A READY replica as the choice sees it: its index, its load (Replica.load's first figure)
    and whether it has room for one more request from the proxy."""

    index: int
    load: float
    room: bool


@dataclass(frozen=True)
class Choice:
    index: int          # the replica chosen
    home: int           # the key's first replica among the candidates
    spilled: bool       # the home replica was full or too busy, so another took the request
    wait: bool = False  # the home replica is full but within the bound: wait for it (index == home)
    away: bool = False  # not the key's rendezvous first: its cache is here now (KeyTable's moved)


def choose(key: str, candidates: Sequence[Candidate], max_imbalance: float, patient: bool = False,
           moved: int | None = None) -> Choice | None:
    """The replica for `key`: the first in its order that has room and is at most `max_imbalance`
    busier than the least loaded replica with room. None when no candidate has room. A `patient`
    request whose first replica is full but at most `max_imbalance` busier than that least loaded
    one gets Choice(wait=True) instead of a spill: it waits for a slot there. `moved`: the replica
    the key last spilled to (KeyTable.moved), first in its order while it is a candidate."""
    if not candidates:
        return None
    if len(candidates) == 1:
        # One READY replica (many models run one) is every key's home: no scores to compute.
        only = candidates[0]
        return Choice(index=only.index, home=only.index, spilled=False) if only.room else None
    with_room = [c for c in candidates if c.room]
    if not with_room:
        return None
    floor = min(c.load for c in with_room)
    by_index = {c.index: c for c in candidates}
    ranked = order(key, list(by_index))
    first_by_hash = ranked[0]
    if moved is not None and moved in by_index:
        ranked.remove(moved)
        ranked.insert(0, moved)
    first = by_index[ranked[0]]
    if patient and not first.room and first.load <= floor + max_imbalance:
        return Choice(index=first.index, home=first.index, spilled=False, wait=True)
    for index in ranked:
        c = by_index[index]
        if c.room and c.load <= floor + max_imbalance:
            return Choice(index=index, home=ranked[0], spilled=index != ranked[0], away=index != first_by_hash)
    raise AssertionError("unreachable: the least loaded replica with room always qualifies")


@dataclass(eq=False)
class Wait:
    """One request's readiness to wait for its key's full replica (Choice.wait). Its caller sets
    `patient` before each choice (whether affinity_max_wait_s is still ahead); the runtime sets
    `waited` the first time it makes the request wait, so a wait is counted once however often the
    request is woken to choose again, and `waiting` (and `home`) while it counts among the waiters
    of that replica, which count toward its load."""

    patient: bool = True
    waited: bool = False
    waiting: bool = False
    home: int | None = None   # the replica it waits for, while `waiting`


class KeyTable:
    """Which replica each recently seen key went to, and whether that was away from its rendezvous
    first (a spill, whose cache is there now: choose's `moved`), for routing and for the count of
    keys a replica holds: a bounded LRU of key -> (index, moved) (a client's keys are unbounded;
    this is not)."""

    def __init__(self, limit: int = MAX_KEYS) -> None:
        self.limit = limit
        self._where: OrderedDict[str, tuple[int, bool]] = OrderedDict()

    def note(self, key: str, index: int, moved: bool = False) -> None:
        self._where[key] = (index, moved)
        self._where.move_to_end(key)
        while len(self._where) > self.limit:
            self._where.popitem(last=False)

    def moved(self, key: str) -> int | None:
        """The replica `key` last spilled to, if its last request went to one."""
        index, moved = self._where.get(key, (0, False))
        return index if moved else None

    def forget(self, index: int) -> None:
        """A replica lost its cache (its process stopped or restarted): it holds no key now."""
        for key in [k for k, (i, _) in self._where.items() if i == index]:
            del self._where[key]

    def counts(self) -> Counter[int]:
        return Counter(i for i, _ in self._where.values())
