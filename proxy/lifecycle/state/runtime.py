"""What the pool knows about one public model at run time: state, replicas, admission; and the
runner half of the `Kind` seam it holds (`KindRunner`, `Kind`; the rules half is state/kind.py),
declared here beside the ModelRuntime it acts on so that neither module names the other's types."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

from proxy.admission import DEFAULT_MAX_QUEUE_WAIT_S, Admission
from proxy.capabilities import Capabilities, Traits, capabilities
from proxy.config.merge import changed
from proxy.config.model import ModelConfig
from proxy.config.settings import Settings
from proxy.errors import PoolError
from proxy.fairness import FairnessPolicy
from proxy.lifecycle.state import affinity
from proxy.lifecycle.state.kind import KindRules
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState, model_transition


@dataclass(eq=False)
class LoadRetry:
    """A failed load at startup that the pool tries again (proxy/lifecycle/startup.py)."""

    attempts: int = 0                 # tries that failed so far
    next_at: float | None = None      # when the next try starts (monotonic); None while one runs
    stopped: asyncio.Event = field(default_factory=asyncio.Event)   # an admin loaded or unloaded it

    def describe(self) -> dict[str, object]:
        left = None if self.next_at is None else round(max(0.0, self.next_at - time.monotonic()), 1)
        return {"attempts": self.attempts, "next_retry_in_s": left}


@dataclass(eq=False)
class Backoff:
    """A failed on-demand load: requests are refused with its error until `until` (wall clock),
    then the next request tries again; each failure doubles the wait (no load storm)."""

    attempts: int
    until: float
    error: PoolError

    def left_s(self, now: float) -> float:
        return max(0.0, self.until - now)

    def describe(self, now: float) -> dict[str, object]:
        return {"attempts": self.attempts, "until": round(self.until, 3),
                "next_attempt_in_s": round(self.left_s(now), 1), "reason": self.error.message}


@dataclass(eq=False)
class ModelRuntime:
    config: ModelConfig                     # as configured
    policy: FairnessPolicy = field(default_factory=FairnessPolicy)
    active: ModelConfig | None = None       # as loaded, with temporary overrides applied
    state: ModelState = ModelState.UNLOADED
    replicas: list[Replica] = field(default_factory=list)
    admission: Admission = field(default_factory=Admission)
    last_error: str | None = None
    kind: Kind | None = None                # how its replicas start, stop and are reached; None: unsupported
    traits: Traits = field(default_factory=Traits)  # what its backend can do
    load_s: float | None = None             # how long its last load and unload took (for /metrics)
    unload_s: float | None = None
    load_retry: LoadRetry | None = None     # its failed startup load, while it is tried again
    backoff: Backoff | None = None          # its failed on-demand load, until it may be tried again
    unload_reason: str | None = None        # why it is unloading: admin, idle, evicted, shutdown
    loads: dict[str, int] = field(default_factory=dict)     # finished loads by reason
    unloads: dict[str, int] = field(default_factory=dict)   # finished unloads by reason
    loaded_at: float = 0.0                  # when it last became LOADED (monotonic)
    # Evictions into sleep and wakes from it (proxy/lifecycle/sleeping.py), and how long the last took.
    sleeps: int = 0
    wakes: int = 0
    sleep_s: float | None = None
    wake_s: float | None = None
    # The settings its running replicas were started with, as the last proxy kept them
    # (proxy/lifecycle/kept.py): how to reach one that runs other settings than `active`. None: unknown.
    kept: ModelConfig | None = None
    _turn: int = 0
    # Requests waiting for their affinity key's full replica, per replica index (affinity.Wait).
    _waiters: Counter[int] = field(default_factory=Counter)
    keys: affinity.KeyTable = field(default_factory=affinity.KeyTable)   # where recent affinity keys went
    # Serialises admin operations on this model; request routing never takes it.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    # (settings, traits, what they serve): every request checks its route against it.
    _capabilities: tuple[ModelConfig, Traits, Capabilities] | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def target_inflight(self) -> int:
        return self.model.target_inflight

    @property
    def model(self) -> ModelConfig:
        """The settings requests are served with: as loaded, else as configured."""
        return self.active or self.config

    @property
    def last_used(self) -> float:
        """Wall-clock time of its last request's arrival or end, or of an admin load."""
        return self.admission.last_used

    def capabilities(self) -> Capabilities:
        model, traits, known = self.model, self.traits, self._capabilities
        if known is None or known[0] is not model or known[1] is not traits:
            # Settings and traits are replaced, never changed in place: the same pair serves the same.
            known = self._capabilities = (model, traits, capabilities(model, traits))
        return known[2]

    def with_replicas(self, count: int) -> ModelConfig:
        """The active settings with `count` replicas (a live scale): shown as an override unless it
        is the configured count, so that a load asking for the same count finds the same settings."""
        active = self.model
        options = {k: v for k, v in active.options.items() if k != "replicas"}
        if count != self.config.replicas:
            options["replicas"] = count
        return replace(active, options=options, replicas=count)

    def ready(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == ReplicaState.READY]

    def move(self, new: ModelState, error: str | None = None) -> None:
        """The one place the model's state changes (the pool's decisions call it); `error`, when
        given, is the reason shown with it."""
        self.state = model_transition(self.name, self.state, new)
        if error is not None:
            self.last_error = error

    def set_replica_state(self, replica: Replica, new: ReplicaState, error: str | None = None) -> None:
        """The one place replica states change, so capacity and waiters always follow."""
        if replica.move(new, error):
            if new not in (ReplicaState.READY, ReplicaState.UNHEALTHY):
                self.keys.forget(replica.index)   # no process, or a new one: its KV cache is gone
            self._set_capacity()
            self._changed.set()
            self._changed = asyncio.Event()

    def _set_capacity(self) -> None:
        """Admission lets in target_inflight requests per READY replica, and one more for each request
        that waits for its key's full replica (up to as many again): a waiter is queued at its
        replica, not using a place, and holding its ticket would leave a place elsewhere idle while
        the requests queued behind it, some of them that place's own conversations, could use it.
        The admitted requests that have no replica yet are then at most the places free."""
        places = len(self.ready()) * self.target_inflight
        self.admission.set_capacity(places + min(self._waiters.total(), places))

    def release(self, replica: Replica) -> None:
        """A request sent to `replica` ended: its place there is free for one that waits for it."""
        replica.inflight -= 1
        self._changed.set()
        self._changed = asyncio.Event()

    def stop_waiting(self, wait: affinity.Wait | None) -> None:
        """The request of `wait` no longer waits for its key's replica (it took a replica, or left)."""
        if wait is not None and wait.waiting:
            wait.waiting = False
            assert wait.home is not None
            self._waiters[wait.home] -= 1
            wait.home = None
            self._set_capacity()

    async def wait_changed(self, timeout: float) -> None:
        # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation (the client left)
        # that lands as the event is set, and the caller would go on to send the request.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._changed.wait()

    @property
    def affinity_routing(self) -> bool:
        """Whether requests to this model carry an affinity key (routing: affinity)."""
        return bool(self.model.get("routing") == "affinity")

    def max_imbalance(self) -> float:
        """affinity_max_imbalance, or its default: target_inflight (docs/routing.md: why)."""
        margin = self.model.get("affinity_max_imbalance")
        return float(margin) if margin is not None else float(self.target_inflight)

    def max_wait_s(self) -> float:
        """affinity_max_wait_s: how long a request may wait for its key's full replica; null: as long
        as the load bound holds (first_byte_timeout_s still ends it)."""
        wait = self.model.get("affinity_max_wait_s")
        return float("inf") if wait is None else float(wait)

    def pick_replica(self, key: str | None = None, wait: affinity.Wait | None = None) -> Replica | None:
        """The replica for a request, among READY replicas with fewer than `target_inflight` requests
        from the proxy (gauges steer, but never past a replica's own cap); None when every READY
        replica is full. With an affinity `key` (routing: affinity), the key's own replica by
        rendezvous hashing, unless it is full or busier than the least loaded by more than
        affinity_max_imbalance: then the next in the key's order (proxy/lifecycle/state/affinity.py);
        but a request whose `wait` is patient gets None while its key's replica is full and within
        that bound, and waits for it. Without a key, the least loaded (see Replica.load); ties
        rotate, so idle replicas share sequential traffic."""
        cap = self.target_inflight
        ready = self.ready()
        if len(ready) == 1:
            # One READY replica (most models run one) is every request's choice: nothing to weigh,
            # and this runs once per request.
            only = ready[0]
            if only.inflight >= cap:
                return None
            if key is not None and self.affinity_routing:
                self.stop_waiting(wait)
                only.affinity_picks += 1
                self.keys.note(key, only.index)
            return only
        if key is not None and self.affinity_routing:
            return self._affine(key, cap, wait)
        ready = [r for r in ready if r.inflight < cap]
        if not ready:
            return None
        self._turn += 1
        return min(ready, key=lambda r: (*r.load(), (r.index - self._turn) % len(self.replicas)))

    def _affine(self, key: str, cap: int, wait: affinity.Wait | None) -> Replica | None:
        ready = {r.index: r for r in self.ready()}
        # The requests waiting for a replica are its load too (a queue there), this one's own aside:
        # a key that many requests share spills as soon as one of them waits.
        own = wait.home if wait is not None and wait.waiting else None
        candidates = [affinity.Candidate(i, r.load()[0] + self._waiters[i] - (i == own), r.inflight < cap)
                      for i, r in ready.items()]
        choice = affinity.choose(key, candidates, self.max_imbalance(), patient=wait is not None and wait.patient,
                                 moved=self.keys.moved(key))
        if choice is None:
            return None
        replica = ready[choice.index]
        if choice.wait:
            assert wait is not None
            if not wait.waited:
                wait.waited = True
                replica.affinity_waits += 1
            if wait.home != choice.index:
                self.stop_waiting(wait)   # its home changed while it waited (a replica came or went)
                wait.waiting, wait.home = True, choice.index
                self._waiters[choice.index] += 1
                self._set_capacity()
            return None
        self.stop_waiting(wait)
        if choice.spilled:
            ready[choice.home].affinity_spills += 1
        else:
            replica.affinity_picks += 1
        # Away from its rendezvous first (a spill now or before): its cache is here from now on.
        self.keys.note(key, choice.index, moved=choice.away)
        return replica

    def describe(self) -> dict[str, object]:
        cfg = self.model
        held = self.keys.counts()
        return {
            "id": self.name,
            "backend": cfg.backend,
            "enabled": self.config.enabled,
            "state": self.state.value,
            "replicas": [{**r.describe(), "affinity_keys": held.get(r.index, 0)} for r in self.replicas],
            "routing": cfg.get("routing"),
            "replica_count": cfg.replicas,
            "replica_max": cfg.replica_max,
            "target_inflight": cfg.target_inflight,
            "admission": self.admission.describe(),
            "capacity": self.admission.capacity,
            "affinity_waiting": self._waiters.total(),   # each one's place is in capacity too
            "active": self.admission.active,
            "waiting": self.admission.waiting,
            "keys": self.admission.describe_keys(),
            "key_counts": self.admission.key_counts(),
            "classes": self.admission.describe_classes(),
            "capabilities": self.capabilities().as_dict(),
            "gpus": list(cfg.gpus),
            "adapters": [{"name": a.name, "id": a.id, "scale": a.scale} for a in cfg.adapters],
            "overrides": changed(self.config.options, cfg.options),
            "last_error": self.last_error,
            "load_retry": self.load_retry.describe() if self.load_retry is not None else None,
            "sleeps": self.sleeps, "wakes": self.wakes,
            "last_wake_s": round(self.wake_s, 3) if self.wake_s is not None else None,
            **(self.kind.describe(cfg) if self.kind is not None else {}),
        }


class KindRunner(Protocol):
    """Start and stop one kind of replica (the runner half of the seam, proxy/lifecycle/state/kind.py);
    the pool calls nothing else that differs per kind."""

    async def start(self, runtime: ModelRuntime, config: ModelConfig) -> None:
        """Create runtime.replicas and set them going; health decides READY (the pool waits for it)."""
        ...

    async def stop(self, runtime: ModelRuntime) -> None:
        """Whatever runs for the replicas is gone when this returns."""
        ...

    async def add(self, runtime: ModelRuntime, config: ModelConfig, indices: Sequence[int]) -> list[Replica]:
        """Live scaling up: append replicas `indices` to runtime.replicas and set them going, leaving
        the others alone; health decides READY (the pool waits for it). Returns the new replicas."""
        ...

    async def remove(self, runtime: ModelRuntime, replicas: list[Replica]) -> None:
        """Live scaling down: whatever runs for `replicas` (already drained) is gone when this
        returns; the others are left alone."""
        ...


class Kind(KindRules, KindRunner, Protocol):
    """A kind of replica as a model's runtime holds it: its rules and its runner."""


def runtimes_for(settings: Settings) -> dict[str, ModelRuntime]:
    """A runtime for each configured model, not loaded. Its queue is its own for its whole life:
    requests wait in it while the model loads on demand (engine.fairness for the policy and the wait)."""
    policy = FairnessPolicy.from_settings(settings.fairness)
    max_wait_s = settings.fairness.get("max_queue_wait_s", DEFAULT_MAX_QUEUE_WAIT_S)
    return {n: ModelRuntime(config=c, policy=policy, admission=Admission(policy, max_wait_s=max_wait_s))
            for n, c in settings.models.items()}
