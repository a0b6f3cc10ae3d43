"""Replica and model lifecycle states, with every allowed transition in one place.

A leaf, like Supervisor's states.py: at run time it imports nothing of the project but
launchers.spec, so every other lifecycle module can import it without a circle.
"""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from launchers.spec import ProgramSpec

if TYPE_CHECKING:
    from proxy.lifecycle.state.slots import SlotTable
    from proxy.upstream.reach import Reach


class ReplicaState(str, enum.Enum):
    STOPPED = "stopped"      # no process, or an admin stopped it with supervisorctl
    STARTING = "starting"    # process starting or restarting; not routed to until its health check passes
    READY = "ready"          # supervisord says RUNNING and the health check passed
    # Running but out of rotation: its health check failed while READY, or it was ejected for
    # consecutive failed requests (until `eject_until`). Back to READY only by passing a check again.
    UNHEALTHY = "unhealthy"
    STOPPING = "stopping"    # being unloaded
    FAILED = "failed"        # did not become healthy, or supervisord gave up on it
    # Its host's supervisord does not answer: whether its process still runs is unknown, and nothing
    # here can see, stop or restart it. A state of its own, not a label over STARTING: the table
    # stays the one truth (routing, capacity and the views all read `state`), and nothing is
    # starting. Out of rotation like every state but READY; when the host answers again it goes to
    # STARTING (adopted or started again) and back to READY only through its health check.
    HOST_UNREACHABLE = "host_unreachable"
    # Its process runs with its weights in host RAM and no KV cache (vLLM's sleep mode, level 1):
    # out of rotation and not health-checked; a wake sends it back through STARTING, so that only
    # a passed health check makes it READY again (proxy/lifecycle/sleeping.py).
    ASLEEP = "asleep"


_TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    ReplicaState.STOPPED: frozenset({ReplicaState.STARTING, ReplicaState.STOPPING}),
    ReplicaState.STARTING: frozenset({ReplicaState.READY, ReplicaState.FAILED, ReplicaState.STOPPING,
                                      ReplicaState.STOPPED, ReplicaState.UNHEALTHY,
                                      ReplicaState.HOST_UNREACHABLE}),
    ReplicaState.READY: frozenset({ReplicaState.STARTING, ReplicaState.STOPPING, ReplicaState.STOPPED,
                                   ReplicaState.FAILED, ReplicaState.UNHEALTHY, ReplicaState.HOST_UNREACHABLE,
                                   ReplicaState.ASLEEP}),
    ReplicaState.UNHEALTHY: frozenset({ReplicaState.READY, ReplicaState.STARTING, ReplicaState.STOPPING,
                                       ReplicaState.STOPPED, ReplicaState.FAILED, ReplicaState.HOST_UNREACHABLE}),
    ReplicaState.STOPPING: frozenset({ReplicaState.STOPPED}),
    ReplicaState.FAILED: frozenset({ReplicaState.STARTING, ReplicaState.STOPPING, ReplicaState.STOPPED}),
    # Never straight to READY: a process that ran on unseen proves itself by a health check first.
    # STOPPING: an unload while the host is down; FAILED: back without its program, or the load's
    # start timeout passed first.
    ReplicaState.HOST_UNREACHABLE: frozenset({ReplicaState.STARTING, ReplicaState.STOPPING, ReplicaState.STOPPED,
                                              ReplicaState.FAILED}),
    # STARTING: woken, its health check next; STOPPING: stopped for real (an unload, a failed wake).
    ReplicaState.ASLEEP: frozenset({ReplicaState.STARTING, ReplicaState.STOPPING, ReplicaState.STOPPED,
                                    ReplicaState.FAILED}),
}


class ModelState(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    FAILED = "failed"
    # Evicted into sleep (vllm_sleep_on_evict): its processes run, its weights in host RAM; nothing
    # is routed to it, and a request or an admin load wakes it (proxy/lifecycle/sleeping.py).
    ASLEEP = "asleep"


_MODEL_TRANSITIONS: dict[ModelState, frozenset[ModelState]] = {
    # FAILED from UNLOADED: a model that cannot even be started (no kind, a config problem).
    ModelState.UNLOADED: frozenset({ModelState.LOADING, ModelState.FAILED}),
    ModelState.LOADING: frozenset({ModelState.LOADED, ModelState.FAILED}),
    ModelState.LOADED: frozenset({ModelState.UNLOADING, ModelState.FAILED}),
    # FAILED from UNLOADING: the unload did not finish; another unload starts over from FAILED.
    # ASLEEP from UNLOADING: an eviction that put the model to sleep instead of stopping it.
    ModelState.UNLOADING: frozenset({ModelState.UNLOADED, ModelState.FAILED, ModelState.ASLEEP}),
    ModelState.FAILED: frozenset({ModelState.LOADING, ModelState.UNLOADING}),
    # LOADING: a wake (or, should it fail, a load from scratch); UNLOADING: stopped for real;
    # FAILED: a load found it cannot start (a setting): its processes stay for an unload to stop.
    ModelState.ASLEEP: frozenset({ModelState.LOADING, ModelState.UNLOADING, ModelState.FAILED}),
}


class InvalidTransition(RuntimeError):
    pass


def model_transition(model: str, old: ModelState, new: ModelState) -> ModelState:
    """`new`, if a model may go there from `old` (staying put is always allowed); raises otherwise."""
    if new != old and new not in _MODEL_TRANSITIONS[old]:
        raise InvalidTransition(f"model {model}: {old.value} -> {new.value}")
    return new


@dataclass(eq=False)
class Replica:
    """One backend server of a model: a supervised program, or an endpoint (a remote model, which
    has no `spec` and no program). The event loop is its only writer."""

    model: str
    index: int
    spec: ProgramSpec | None = None   # the program serving it; None for an endpoint
    fullname: str = ""                # group:program, as supervisord names it; "" without a program
    reach: Reach = field(kw_only=True)  # how requests get to it (its kind made it)
    host: str = field(default="local", kw_only=True)   # the supervisord it runs under (supervisor.hosts)
    state: ReplicaState = ReplicaState.STOPPED
    pid: int = 0                      # its process, kept after an exit to tell a restart by its new pid
    alive: bool = False               # whether `pid` runs, as the last look at supervisord said
    restarts: int = 0
    last_error: str | None = None
    inflight: int = 0
    state_since: float = field(default_factory=time.monotonic)
    probe: asyncio.Task[None] | None = None
    # What the backend last said on /metrics: running, waiting, kv_cache (0..1); empty until scraped.
    reported: dict[str, float] = field(default_factory=dict)
    scrape: asyncio.Task[None] | None = None
    scraped_at: float = 0.0
    # The proxy's own requests there when `reported` was read (the most while the scrape ran): the
    # backend's count beyond them is other clients' work, and only that outlives the reading.
    inflight_at_scrape: int = 0
    checked_at: float = 0.0           # when its last health check while READY began
    # Outlier ejection (proxy/lifecycle/watch/health.py): failed requests in a row, ejections in a row (for the
    # back-off), ejections ever, and until when the current one lasts.
    failures: int = 0
    ejections: int = 0
    # A crash is one failure (health.note_exit): the process the count's latest failures came from
    # and the count before them, and the process whose exit was counted.
    failed_pid: int = 0
    failures_before: int = 0
    exited_pid: int = 0
    crashed_pid: int = 0              # the process whose crash was recorded (an event, a log line)
    stopped_pid: int = 0              # the process an admin stopped in supervisord: its end is no crash
    ejected_total: int = 0
    eject_until: float = 0.0
    # For /metrics: requests sent to it, failed health checks (in rotation or ejected) and failed
    # warm-ups, and how long its last warm-up took (None: none ran).
    sent: int = 0
    probe_failures: int = 0
    warmup_s: float | None = None
    # Affinity routing (proxy/lifecycle/state/affinity.py): requests it took as their key's own replica,
    # requests of its keys that went elsewhere because it was full or too busy (spills), and
    # requests of its keys that waited for it while it was full (they then took it or spilled).
    affinity_picks: int = 0
    affinity_spills: int = 0
    affinity_waits: int = 0
    # What its answers' usage said of the engine's prefix cache: answers that reused cached prompt
    # tokens (hits), answers that reused none (misses), and the cached prompt tokens in all.
    cache_hits: int = 0
    cache_misses: int = 0
    cached_tokens: int = 0
    # Adopted running a program other than what its model's settings give now (why, by setting
    # name); the pool replaces it by a current replica (proxy/lifecycle/rolling.py). None: current.
    outdated: str | None = None
    # Which of its llama-server slots holds which conversation, while the KV store keeps its slots
    # across swaps (proxy/lifecycle/kvcache/); None: requests go without `id_slot`.
    slots: SlotTable | None = None
    # Taken over running from an earlier proxy (a reload, a restart): which conversation is in which
    # of its slots died with that proxy, so llama-server's own matching places them (no `id_slot`).
    adopted: bool = False
    # LoRA adapters an admin unloaded from it at run time (vLLM; proxy/lifecycle/adapters.py), each
    # with the process it left: a new process holds every adapter of its command line again.
    adapters_dropped: dict[str, int] = field(default_factory=dict)
    adapter_locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def holds(self, adapter: str) -> bool:
        """Whether its engine serves `adapter` now (an adapter of its model's settings)."""
        return self.adapters_dropped.get(adapter, -1) != self.pid

    def adapters(self) -> list[str]:
        """The adapters it serves now, in their order (the admin view, the status page)."""
        chosen = self.spec.adapters if self.spec is not None else None
        return [name for name in chosen.names if self.holds(name)] if chosen is not None else []

    def note_cache(self, prompt_tokens: object, cached_tokens: object) -> None:
        """One answer's usage: a hit when the engine reused part of the prompt from its cache. An
        answer that does not say how much it reused (no prompt_tokens_details) counts for nothing."""
        if not isinstance(cached_tokens, int) or isinstance(cached_tokens, bool) or cached_tokens < 0:
            return
        if not isinstance(prompt_tokens, int) or prompt_tokens <= 0:
            return
        self.cached_tokens += cached_tokens
        if cached_tokens > 0:
            self.cache_hits += 1
        else:
            self.cache_misses += 1

    def cache_hit_rate(self) -> float | None:
        answers = self.cache_hits + self.cache_misses
        return round(self.cache_hits / answers, 3) if answers else None

    def load(self) -> tuple[float, float]:
        """How busy the replica is: the work at it (what the proxy sent, plus what the backend reported
        running and waiting beyond the proxy's own requests then, e.g. other clients), then its
        KV-cache use. The reading is up to a scrape interval old: taken whole, it would keep a
        replica whose requests just ended looking busy, and routing would shun it until the next."""
        backend = self.reported.get("running", 0.0) + self.reported.get("waiting", 0.0)
        others = max(0.0, backend - self.inflight_at_scrape)
        return float(self.inflight) + others, self.reported.get("kv_cache", 0.0)

    def cancel_tasks(self) -> None:
        """Stop its health probe and metrics scrape, if any is in flight."""
        for task in (self.probe, self.scrape):
            if task is not None:
                task.cancel()

    def move(self, new: ReplicaState, error: str | None = None) -> bool:
        """Change state; False when already there. Raises on a transition the lifecycle forbids."""
        if new == self.state:
            if error:
                self.last_error = error
            return False
        if new not in _TRANSITIONS[self.state]:
            raise InvalidTransition(f"{self.model} replica {self.index}: {self.state.value} -> {new.value}")
        self.state = new
        self.state_since = time.monotonic()
        if new != ReplicaState.READY:
            self.reported = {}  # gauges of a replica that is not serving mean nothing
        if error:
            self.last_error = error
        return True

    def describe(self) -> dict[str, object]:
        return {"index": self.index, "host": self.host, "state": self.state.value,
                "pid": self.pid if self.alive and self.pid else None,
                # The name `supervisorctl status` shows (each replica is a group of one).
                "port": self.spec.port if self.spec else None, "program": self.spec.program if self.spec else None,
                "restarts": self.restarts, "inflight": self.inflight, "reported": dict(self.reported),
                # A reading is one instant, up to a scrape interval old: beside the proxy's count
                # now it says nothing unless its age and the proxy's count then are shown with it.
                "reported_age_s": round(time.monotonic() - self.scraped_at, 1) if self.reported else None,
                "inflight_at_scrape": self.inflight_at_scrape if self.reported else None,
                "last_error": self.last_error, "outdated": self.outdated, "consecutive_failures": self.failures,
                "ejections": self.ejected_total,
                "ejected_for_s": round(max(0.0, self.eject_until - time.monotonic()), 1),
                "affinity_picks": self.affinity_picks, "affinity_spills": self.affinity_spills,
                "affinity_waits": self.affinity_waits,
                "cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
                "cache_hit_rate": self.cache_hit_rate(), "cached_prompt_tokens": self.cached_tokens,
                "adapters": self.adapters(), **self.reach.describe()}
