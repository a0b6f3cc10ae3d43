"""Which models may be resident together, and what the pool does next: load, evict, wait or refuse.

Pure, synchronous and free of I/O, like fairness.py: a picture of the models (their state, what
each needs on each device, usage, queue) and the limits (budgets per device, a count cap, the swap
bound) go in, a decision comes out, and the pool (pool.py) carries it out. The clock is an argument.

The rules (docs/lifecycle.md: More models than memory):
- A load fits when every limited device it uses has its need free (the budget minus what loaded,
  loading and unloading models hold there) and `max_loaded_models` is not reached.
- To make room, idle, unpinned, loaded models that hold what is short are evicted, least recently
  used first; of two that have been idle about as long (within CLOSE of each other), the one
  cheaper to reload (its last load was shorter) goes first. Nothing is evicted unless the load
  then fits.
- A busy model (requests running or waiting) is evicted only when idle ones would not make room and
  the cold model's load has waited the swap bound for that room: until then the busy one serves
  what is queued for it (the swap-aware order: A B A A C costs three loads, not four), after that it
  is drained and swapped out, so reordering never holds a request longer than the bound. A model
  swapped in is not swapped out busy before the bound either: it serves what queued for it. The bound
  is `swap_max_wait_s`, or the busy models' reload time where that is shorter: holding a request
  longer than it takes to load the busy model again later saves nothing.
- A model is evicted for a load on demand only once it has been loaded `min_residence_s`
  (busy or idle; beyond the swap bound's rules for busy ones): each eviction is a reload later, and
  two models that take each other's room would otherwise swap on every request. When the next idle
  model in the order is too young, the load waits for it rather than evict one used more recently.
  An admin's load is not held by it (`room_for`'s default).
- A model that would not fit even with only pinned models loaded is too large: refused at once.
- Idle unload: a loaded, unpinned model with nothing running or waiting, `idle_unload_s` after its
  last use. Pinned models are never unloaded by the pool.
- Cold models with waiters are considered oldest waiter first.
- An asleep model (evicted into vLLM's sleep mode) holds only its weights in host RAM: it counts
  there (not on its GPU, not toward max_loaded_models), is evicted like an idle loaded model (a real
  stop, to free that RAM) and idle-unloaded like one; a request for it is a load that needs what
  it holds awake (`wake_needs`), its host RAM being given back by the wake.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Literal, Mapping, Sequence

MIB = 1024 * 1024
# Idle times within this fraction of each other count as equally long: the cheaper reload goes first.
CLOSE = 0.1
# The pseudo-device of the count cap (engine.lifecycle.max_loaded_models) in a Shortfall.
COUNT = "count"

Status = Literal["cold", "loading", "loaded", "unloading", "asleep"]
HOLDING: frozenset[str] = frozenset({"loading", "loaded", "unloading", "asleep"})
# What may be evicted (and idle-unloaded): an asleep model is stopped for real.
RESIDENT: frozenset[str] = frozenset({"loaded", "asleep"})


@dataclass(frozen=True)
class ModelView:
    """One model as placement sees it."""

    name: str
    status: Status
    needs: Mapping[str, int] = field(default_factory=dict)   # bytes per device, all replicas together
    pinned: bool = False
    running: int = 0
    waiting: int = 0
    waited_s: float = 0.0             # how long its oldest waiting request has waited
    # How long its load has waited for room that busy models hold: what the swap bound limits. Not
    # waited_s: a request that queued while its model was loaded (and was then swapped out) has
    # waited long already, and would otherwise evict each model the moment it loaded.
    blocked_s: float = 0.0
    resident_s: float = 0.0           # how long it has been loaded
    last_used: float = 0.0            # clock time of its last use (a request, an admin load)
    reload_s: float | None = None     # how long its last load took
    idle_unload_s: float | None = None
    wants_load: bool = False          # cold, with waiters, loads on demand, not backing off
    counted: bool = True              # counts toward max_loaded_models (remote endpoints and asleep models do not)
    # An asleep model's needs once awake (`needs` is what it holds asleep); None for any other.
    wake_needs: Mapping[str, int] | None = None

    @property
    def busy(self) -> bool:
        return self.running > 0 or self.waiting > 0


@dataclass(frozen=True)
class Limits:
    budgets: Mapping[str, int] = field(default_factory=dict)   # bytes per device; others are unlimited
    max_loaded: int | None = None
    swap_max_wait_s: float = 10.0
    min_residence_s: float = 0.0     # how long a model stays loaded before a load on demand may evict it


@dataclass(frozen=True)
class Shortfall:
    """Why a load does not fit: on `device` (or COUNT) it needs `needed`, `free` is free, and
    evicting every unpinned model there (busy ones too) would free `freeable` more."""

    device: str
    needed: int
    free: int
    freeable: int
    budget: int

    def describe(self) -> str:
        if self.device == COUNT:
            return (f"max_loaded_models is {self.budget}: {self.budget - self.free} models are loaded or loading, "
                    f"{self.freeable} of them could be unloaded")
        return (f"{self.device}: needs {_mib(self.needed)} MiB, {_mib(self.free)} MiB free of a budget of "
                f"{_mib(self.budget)} MiB, {_mib(self.freeable)} MiB more could be freed")

    def as_dict(self) -> dict[str, object]:
        if self.device == COUNT:
            return {"device": COUNT, "max_loaded_models": self.budget, "loaded": self.budget - self.free,
                    "could_unload": self.freeable}
        return {"device": self.device, "needed_mib": _mib(self.needed), "free_mib": _mib(self.free),
                "freeable_mib": _mib(self.freeable), "budget_mib": _mib(self.budget)}


@dataclass(frozen=True)
class Room:
    """The answer for one load: evict these first and it fits; or it waits; or it never fits."""

    evict: tuple[str, ...] = ()
    blocked: Shortfall | None = None     # does not fit now (only busy models, or loads in flight, hold it)
    too_large: Shortfall | None = None   # would not fit with only pinned models loaded

    @property
    def fits(self) -> bool:
        return self.blocked is None and self.too_large is None


@dataclass
class Plan:
    loads: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)   # (model, models to evict first)
    idle_unloads: list[str] = field(default_factory=list)
    waiting: dict[str, Shortfall] = field(default_factory=dict)     # cold models whose load waits for room
    too_large: dict[str, Shortfall] = field(default_factory=dict)
    wake_in_s: float | None = None       # plan again then at the latest (an idle deadline, a swap bound)


def room_for(name: str, models: Iterable[ModelView], limits: Limits, now: float,
             may_evict_busy: bool = False, may_evict: bool = True, busy_after_s: float = 0.0,
             resident_after_s: float = 0.0) -> Room:
    """What loading `name` takes now: the models to evict first, or why it cannot load.
    `may_evict` False: only what fits beside the models loaded now (a load at startup). Only a
    model loaded `resident_after_s` may be evicted; a busy one only with `may_evict_busy`, once it
    has been loaded `busy_after_s`."""
    views = {m.name: m for m in models}
    target = awake(views[name])
    holding = [m for m in views.values() if m.status in HOLDING and m.name != name]
    devices = [d for d in target.needs if d in limits.budgets]
    free = {d: limits.budgets[d] - sum(m.needs.get(d, 0) for m in holding) for d in devices}
    cap = limits.max_loaded if target.counted else None
    count_free = None if cap is None else cap - sum(1 for m in holding if m.counted)

    pinned = [m for m in holding if m.pinned]
    for d in devices:
        if target.needs[d] > limits.budgets[d] - sum(m.needs.get(d, 0) for m in pinned):
            return Room(too_large=_shortfall(d, target, free, holding, limits))
    if cap is not None and sum(1 for m in pinned if m.counted) >= cap:
        return Room(too_large=_count_shortfall(cap, holding))

    def short() -> list[str]:
        out = [d for d in devices if target.needs[d] > free[d]]
        if count_free is not None and count_free < 1:
            out.append(COUNT)
        return out

    evictable = [m for m in holding if m.status in RESIDENT and not m.pinned and may_evict]
    idle = _eviction_order([m for m in evictable if not m.busy], now)
    busy = sorted((m for m in evictable if m.busy and m.resident_s >= max(busy_after_s, resident_after_s)),
                  key=lambda m: m.last_used)
    evict: list[str] = []
    for candidate in idle + (busy if may_evict_busy else []):
        missing = short()
        if not missing:
            break
        if not any(candidate.needs.get(d, 0) > 0 for d in missing if d != COUNT) and \
                not (COUNT in missing and candidate.counted):
            continue   # it holds nothing that is short
        if candidate.resident_s < resident_after_s:
            # The next to go is too young: the load waits for it to come of age rather than evict
            # one used more recently (the order stays least recently used first).
            break
        evict.append(candidate.name)
        for d in devices:
            free[d] += candidate.needs.get(d, 0)
        if count_free is not None and candidate.counted:
            count_free += 1
    missing = short()
    if not missing:
        return Room(evict=tuple(evict))
    # Evict nothing unless the load then fits: an idle model thrown out in vain is a reload for nothing.
    first = missing[0]
    free = {d: limits.budgets[d] - sum(m.needs.get(d, 0) for m in holding) for d in devices}
    if first == COUNT:
        assert cap is not None
        return Room(blocked=_count_shortfall(cap, holding))
    return Room(blocked=_shortfall(first, target, free, holding, limits))


def plan(models: Iterable[ModelView], limits: Limits, now: float) -> Plan:
    """Everything to do now: idle unloads, then loads for cold models with waiters (oldest first),
    each with what it must evict; and when to plan again at the latest."""
    state = {m.name: m for m in models}
    out = Plan()

    def wake(after_s: float) -> None:
        out.wake_in_s = after_s if out.wake_in_s is None else min(out.wake_in_s, after_s)

    for m in list(state.values()):
        if m.status not in RESIDENT or m.pinned or m.idle_unload_s is None or m.busy:
            continue
        left = m.last_used + m.idle_unload_s - now
        if left <= 0:
            out.idle_unloads.append(m.name)
            state[m.name] = replace(m, status="unloading")
        else:
            wake(left)

    for demand in sorted((m for m in state.values() if m.wants_load), key=lambda m: -m.waited_s):
        bound = swap_bound(state.values(), limits)
        may_evict_busy = demand.blocked_s >= bound
        # A model swapped in gets the bound too, to serve what queued for it while it loaded.
        room = room_for(demand.name, state.values(), limits, now, may_evict_busy, busy_after_s=bound,
                        resident_after_s=limits.min_residence_s)
        if room.too_large is not None:
            out.too_large[demand.name] = room.too_large
            continue
        if room.blocked is not None:
            out.waiting[demand.name] = room.blocked
            if not may_evict_busy:
                wake(bound - demand.blocked_s)
            # Plan again when a model that is too young to evict now comes of age.
            young = [max(bound if m.busy else 0.0, limits.min_residence_s) - m.resident_s for m in state.values()
                     if m.status == "loaded" and not m.pinned
                     and m.resident_s < max(bound if m.busy else 0.0, limits.min_residence_s)]
            if young:
                wake(min(young))
            continue
        out.loads.append((demand.name, room.evict))
        state[demand.name] = replace(awake(demand), status="loading", wants_load=False)
        for victim in room.evict:   # they hold their memory until they are gone
            state[victim] = replace(state[victim], status="unloading")
    return out


def awake(m: ModelView) -> ModelView:
    """`m` as a load sees it: an asleep model needs what it holds awake, and counts again."""
    if m.status != "asleep" or m.wake_needs is None:
        return m
    return replace(m, needs=m.wake_needs, wake_needs=None, counted=True)


def swap_bound(models: Iterable[ModelView], limits: Limits) -> float:
    """How long a cold model's oldest request waits while busy models serve their queues: the
    configured bound, or the longest reload among the busy models that could be evicted if shorter
    (each of them would have to be loaded again for its queue)."""
    reloads = [m.reload_s for m in models
               if m.status == "loaded" and m.busy and not m.pinned and m.reload_s is not None]
    return min(limits.swap_max_wait_s, max(reloads)) if reloads else limits.swap_max_wait_s


def _eviction_order(idle: list[ModelView], now: float) -> list[ModelView]:
    """Least recently used first; of those idle within CLOSE of the longest idle, the cheaper reload first."""
    left = sorted(idle, key=lambda m: m.last_used)
    order = []
    # Idle times are wall clock: a clock set back makes a last use "in the future", which counts as
    # no idle time (found by the property tests: the longest idle went negative and matched nothing).
    def idle_s(m: ModelView) -> float:
        return max(0.0, now - m.last_used)

    while left:
        longest = idle_s(left[0])
        close = [m for m in left if idle_s(m) >= longest * (1 - CLOSE)]
        pick = min(close, key=lambda m: (m.reload_s if m.reload_s is not None else math.inf, m.last_used))
        order.append(pick)
        left.remove(pick)
    return order


def _shortfall(device: str, target: ModelView, free: Mapping[str, int], holding: list[ModelView],
               limits: Limits) -> Shortfall:
    freeable = sum(m.needs.get(device, 0) for m in holding if m.status in RESIDENT and not m.pinned)
    return Shortfall(device=device, needed=target.needs[device], free=free[device], freeable=freeable,
                     budget=limits.budgets[device])


def _count_shortfall(cap: int, holding: list[ModelView]) -> Shortfall:
    unloadable = sum(1 for m in holding if m.counted and m.status in RESIDENT and not m.pinned)
    return Shortfall(device=COUNT, needed=1, free=cap - sum(1 for m in holding if m.counted),
                     freeable=unloadable, budget=cap)


def _mib(n: int) -> float:
    return round(n / MIB, 1)


def spread(count: int, per_replica: Mapping[str, int], hosts: Sequence[str], free: Mapping[str, int],
           budgets: Mapping[str, int], qualify: Callable[[str, str], str],
           already: Sequence[str] = ()) -> tuple[str, ...]:
    """The host of each of `count` new replicas (docs/hosts.md): where it fits beside what
    the hosts hold (`free`, bytes per limited device, host-qualified), fewest of the model's replicas
    there first (`already`: the hosts of those it has), then the most room, then the order of
    `hosts`. A replica that fits nowhere goes where the budget is largest: there, room_for says
    what must be evicted, or why it can never fit."""
    free = dict(free)
    placed = list(already)
    out: list[str] = []

    def limited(host: str) -> list[tuple[str, int]]:
        return [(qualify(host, d), n) for d, n in per_replica.items() if qualify(host, d) in budgets]

    for _ in range(count):
        fitting = [h for h in hosts if all(n <= free.get(q, 0) for q, n in limited(h))]
        if fitting:
            pick = min(fitting, key=lambda h: (placed.count(h), -sum(free.get(q, 0) for q, _ in limited(h)),
                                               hosts.index(h)))
        else:
            pick = max(hosts, key=lambda h: (sum(budgets[q] for q, _ in limited(h)), -hosts.index(h)))
        for q, n in limited(pick):
            free[q] = free.get(q, 0) - n
        placed.append(pick)
        out.append(pick)
    return tuple(out)
