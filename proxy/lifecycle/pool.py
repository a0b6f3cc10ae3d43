"""The pool: the lifecycle decisions. Load, adopt, scale and unload models; the same for every
model, whatever kind runs its replicas (kinds/kind.py: a supervisord program, a remote endpoint).
How a load runs is loading.py's, an unload unloading.py's; a restarted proxy adopts running replicas
and tries failed startup loads again (startup.py). The monitor keeps replica states true meanwhile
(watch/monitor.py). Which models may be loaded together, and when one loads on demand, unloads when
idle or is evicted, is placement's (placement/rules.py decides; placer.py carries it out through
this pool, its PlacerActions); every load passes its admission.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from functools import partial
from typing import Any, Callable, Coroutine, Mapping, TypeVar

from proxy.config.model import ModelConfig
from proxy.config.settings import Settings
from proxy.errors import Conflict, NotFound
from proxy.events import Events
from proxy.gpu.footprint import gpu_totals
from proxy.gpu.report import load_nvml
from proxy.lifecycle import hosts_view
from proxy.lifecycle.background import Background
from proxy.lifecycle.kept import FILE_NAME as KEPT_FILE, KeptModels
from proxy.lifecycle.kinds.kind import kinds_for, traits_for
from proxy.lifecycle.kinds.program_kind import ProgramKind
from proxy.lifecycle.kinds.programs import Programs
from proxy.lifecycle.kinds.remote import EndpointKind
from proxy.lifecycle.kinds.stale_programs import remove_stale_programs
from proxy.lifecycle.kvcache.keeper import KvKeeper
from proxy.lifecycle.loading import kind_to_start, start_model
from proxy.lifecycle import sleeping
from proxy.lifecycle.placement.memory import Memory
from proxy.lifecycle.placement.placer import Placer
from proxy.lifecycle.rolling import Rolls
from proxy.lifecycle.scaling import scale
from proxy.lifecycle.startup import StartupLoads
from proxy.lifecycle.state.outcomes import Outcomes
from proxy.lifecycle.state.replicas import ModelState, Replica
from proxy.lifecycle.state.runtime import Kind, ModelRuntime, runtimes_for
from proxy.lifecycle.state.wake import Wake
from proxy.lifecycle.unloading import teardown, unload_model
from proxy.lifecycle.watch.monitor import Monitor
from proxy.upstream.client import UpstreamHttp
from proxy.supervisord.hosts import Host, build_hosts
from proxy.supervisord.managed import ManagedSupervisord
from proxy.supervisord.orphans import PidRecord
from proxy.supervisord.supervisor import SupervisorClient

log = logging.getLogger(__name__)
T = TypeVar("T")


class Pool:
    """The lifecycle's decisions; to its placer, the actions that carry placement's out
    (placement/actions.py PlacerActions: spawn, load_placed, unload_by_pool, predecessor_gone)."""

    def __init__(self, settings: Settings, supervisor: SupervisorClient, http: UpstreamHttp,
                 environ: Mapping[str, str] | None = None, pid_record: PidRecord | None = None,
                 managed: ManagedSupervisord | None = None, nvml_loader: Callable[[], Any] = load_nvml) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self.http = http
        self.environ = dict(os.environ if environ is None else environ)
        self.nvml_loader = nvml_loader
        # Set while no earlier proxy process may still send requests to the replicas: until then a roll
        # (rolling.py) stops no old replica and placement unloads nothing. A handover from a predecessor
        # still draining clears it until that process has exited (proxy/serving/handover.py).
        self.predecessor_gone = asyncio.Event()
        self.predecessor_gone.set()
        # What happened to models, replicas and hosts (GET /v1/admin/events); each event is logged too.
        self.events = Events()
        # One queue per model for its whole life: requests wait in it while it loads on demand.
        self.models = runtimes_for(settings)
        # Built in the order they depend on each other, each handed what it uses: the placer acts through
        # this pool; the programs are placed by the placer and wake the monitor (`wake`, which it sleeps on).
        self.hosts = build_hosts(settings, supervisor, self.environ)
        self.memory = Memory.from_settings(settings, hosts={n: h for n, h in self.hosts.items() if not h.local})
        self.placer = Placer(settings, self.models, self.memory, self, nvml_loader, events=self.events)
        wake = Wake()
        # llama-server slots kept across the pool's unloads (proxy/lifecycle/kvcache/): its replicas
        # save into the store's folders, the monitor restores before a replica serves.
        # With tenants, every llama-server slot is a tenant's (proxy/lifecycle/state/slots.py).
        self.kv = KvKeeper.under(settings.service.state_dir, settings.lifecycle.kv_store_mib, http,
                                 scoped=bool(settings.tenants), events=self.events)
        self.programs = Programs(settings, supervisor, self.environ, self.models, wake, pid_record, self.hosts,
                                 self.placer.hosts_for, events=self.events, launch_hook=self.kv.launch)
        self.monitor = Monitor(settings, supervisor, http, self.models, self.programs, self.events, managed, wake=wake,
                               kv=self.kv)
        kinds: dict[str, Kind] = kinds_for({c.backend for c in settings.models.values()},
                                           ProgramKind(self.programs), EndpointKind(http, self.environ))
        for runtime in self.models.values():
            runtime.kind = kinds.get(runtime.config.backend)
            runtime.traits = traits_for(runtime.config.backend)
        self.startup = StartupLoads(self.models, settings.service)
        self.startup_pending = self.startup.pending   # /ready waits for these (startup.py)
        # What an admin set for the loaded models, for the next serve (proxy/lifecycle/kept.py).
        self.kept = KeptModels(settings.service.state_dir / KEPT_FILE)
        self.tasks = Background()
        self.rolls = Rolls(self.monitor, self.events, self.predecessor_gone, settings.service.drain_timeout_s)

    async def start(self) -> None:
        self.settings.supervisor.programs_dir.mkdir(parents=True, exist_ok=True)
        self.memory.gpus = await asyncio.to_thread(gpu_totals, self.nvml_loader)
        await self.programs.snapshot()
        self.monitor.start()
        self.tasks.add(self.placer.start())

    def load_in_background(self) -> None:
        """Load the enabled models, and adopt any other configured model whose replicas are still
        running (an admin loaded it before the proxy restarted). Groups left in the programs folder
        by models no longer configured are stopped and removed."""
        for name, adopting, overrides in self.startup.to_load(self.adopting(), self.kept):
            # Adopted replicas run already: their memory is in use, so they are not admitted again.
            attempt = partial(self._load, name, overrides, reason="startup", evict=() if adopting else None,
                              adopting=adopting)
            self.tasks.spawn(self.startup.load(name, attempt))
        self._save_kept()
        self.tasks.spawn(remove_stale_programs(self.settings.supervisor.programs_dir, self.models, self.programs,
                                               self.supervisor, self.hosts, after=self.predecessor_gone))

    def adopting(self) -> frozenset[str]:
        """The configured models with replicas running (as of the last snapshot): the startup adopts them."""
        return self.startup.adopting(self.programs.processes)

    def retrying(self) -> list[str]:
        """The models whose failed startup load is being tried again."""
        return self.startup.retrying()

    def _save_kept(self) -> None:
        """What an admin set for every loaded model, for the next serve (kept.py)."""
        self.kept.save(self.models.values())

    async def close(self, stop_models: bool) -> None:
        await self.tasks.cancel_all()
        # The kept state is not written here: it was after each change, and a successor that took
        # over the listeners (a handover) may have written its own since.
        self.placer.usage.save()
        if stop_models:
            await asyncio.gather(*(self._unload(n, drain=False, reason="shutdown") for n, rt in self.models.items()
                                   if rt.state not in (ModelState.UNLOADED,)), return_exceptions=True)
        await self.monitor.close()
        await self.programs.close()
        for runtime in self.models.values():
            for replica in runtime.replicas:
                replica.cancel_tasks()

    def describe(self, runtime: ModelRuntime) -> dict[str, object]:
        """A model's admin row: its runtime's state with its lifecycle (placement) fields."""
        row = {**runtime.describe(), **self.placer.describe_model(runtime)}
        if self.kv.applies(runtime.config):
            row["kv_store"] = self.kv.describe(runtime.name)
        return row

    def describe_hosts(self) -> list[dict[str, object]]:
        """GET /v1/admin/hosts (`llm-pool ctl hosts`): each host, with its memory and replicas."""
        return hosts_view.describe_hosts(self.hosts, self.models, self.placer.describe()["devices"], self.host_status())

    def host_status(self) -> dict[str, dict[str, object]]:
        """Whether each host's supervisord answers (GET /health, /metrics, the hosts view)."""
        return hosts_view.host_status(self.hosts, self.monitor.supervisord_status())

    def get(self, name: str) -> ModelRuntime:
        try:
            return self.models[name]
        except KeyError:
            raise NotFound(f"model {name!r} is not configured", param="model") from None

    async def load(self, name: str, overrides: Mapping[str, Any] | None = None,
                   actor: str | None = None) -> ModelRuntime:
        """Load a configured model (or adopt its running replicas); returns once it is ready or failed.
        An admin's load: it ends the retries of a failed startup load, and is not retried itself.
        `actor`: who asked (for the events feed)."""
        runtime = self.get(name)
        self.startup.stop_retry(name)
        runtime.admission.last_used = time.time()   # an admin load counts as a use
        return await self._load(name, overrides, reason="admin", actor=actor)

    async def load_placed(self, name: str, evict: tuple[str, ...]) -> ModelRuntime:
        """A load on demand that placement admitted: evict `evict`, then load with the configured settings."""
        return await self._load(name, None, reason="on_demand", evict=evict)

    async def _load(self, name: str, overrides: Mapping[str, Any] | None = None, reason: str = "startup",
                    evict: tuple[str, ...] | None = None, adopting: bool = False,
                    actor: str | None = None) -> ModelRuntime:
        """Load (`reason`: startup, admin, on_demand; adopted when `adopting`). `evict`: what
        placement already decided to evict for it; None passes the admission here (placer.admit),
        which may refuse it."""
        runtime = self.get(name)
        config = runtime.config.with_overrides(overrides or {})
        cancelled = False
        try:
            async with runtime.lock:
                loaded = await self._load_locked(runtime, config, "adopted" if adopting else reason, evict, actor)
            # Its idle time counts from its load; an adopted model's from its last use before the restart.
            if not (adopting and runtime.last_used):
                runtime.admission.last_used = max(runtime.admission.last_used, time.time())
            if self.rolls.wanted(runtime):
                self.tasks.spawn(self._roll(runtime))
            return loaded
        except asyncio.CancelledError:
            cancelled = True   # the proxy is stopping: the last proxy's entry stands for the next one
            raise
        finally:
            self.placer.settled(name)
            if not cancelled:
                self.kept.settled(name)
            self._save_kept()

    async def _roll(self, runtime: ModelRuntime) -> None:
        """Replace the replicas adopted out of date one by one (proxy/lifecycle/rolling.py)."""
        await self.rolls.run(runtime)
        self._save_kept()

    async def _load_locked(self, runtime: ModelRuntime, config: ModelConfig, reason: str,
                           evict: tuple[str, ...] | None, actor: str | None) -> ModelRuntime:
        name = runtime.name
        # Adopted replicas were loaded at startup by an earlier proxy: counted as startup loads.
        counted = "startup" if reason == "adopted" else reason
        if runtime.state == ModelState.LOADED:
            if runtime.active == config or reason == "on_demand":
                return runtime   # on demand: its requests want it serving, as an admin's load left it
            raise Conflict(f"model {name!r} is loaded with other settings; unload it first",
                           code="model_already_loaded")
        kind = kind_to_start(runtime, config, reason, self.events)
        if evict is None:
            evict = self.placer.admit(runtime, config, may_evict=counted != "startup")
        else:
            self.placer.reserve(name, config)
        if evict:
            await self.placer.make_room(runtime, evict)
        if runtime.state == ModelState.ASLEEP:
            # On demand it wakes as it was loaded, as a loaded model serves its requests as it is.
            woken = (reason == "on_demand" or config == runtime.active) and \
                await sleeping.wake(runtime, counted, actor, self.monitor, self.http, self.events)
            if woken:
                self.tasks.spawn(self.placer.measure(runtime))
                return runtime
            # A wake that did not go through, or a load with other settings: stopped for real, and
            # started from scratch below, as a load of a model that was never asleep.
            await teardown(runtime, drain=False, keep_waiters=True)
        await start_model(runtime, config, kind, reason, counted, actor, self.monitor, self.events)
        if reason == "adopted":
            await sleeping.wake_adopted(runtime, self.http, self.events)
        self.tasks.spawn(self.placer.measure(runtime))
        return runtime

    async def unload(self, name: str, drain: bool = True, actor: str | None = None) -> ModelRuntime:
        """Stop admitting, let in-flight requests finish (up to service.drain_timeout_s), stop the
        replicas, remove the group and its file. It always ends: UNLOADED with the processes stopped,
        or FAILED with the reason (supervisord gone, a process that would not stop), from which another
        unload starts over."""
        self.get(name)
        self.startup.stop_retry(name)   # an admin's unload: the model stays unloaded
        return await self._unload(name, drain, reason="admin", actor=actor)

    async def unload_by_pool(self, name: str, reason: str, cause: str | None = None) -> ModelRuntime:
        """An unload placement decided (`reason`: idle, evicted; `cause`: the model it made room
        for, or how long it was idle): drained, its waiters kept queued."""
        return await self._unload(name, drain=True, reason=reason, cause=cause)

    async def _unload(self, name: str, drain: bool, reason: str, cause: str | None = None,
                      actor: str | None = None) -> ModelRuntime:
        runtime = self.get(name)
        save = partial(self._save_slots, cause=cause if reason == "evicted" else None) \
            if reason in ("idle", "evicted") else None
        # Only an eviction sleeps (sleeping.py says why); an asleep model evicted again stops for real.
        sleep = partial(sleeping.sleep_instead, cause=cause, may_sleep=self.placer.may_sleep,
                        fell_asleep=self.placer.fell_asleep, http=self.http, events=self.events) \
            if reason == "evicted" and runtime.state == ModelState.LOADED and sleeping.can_sleep(runtime) else None
        try:
            unloaded = await unload_model(runtime, drain, reason, cause, actor, self.events, self.placer.measure,
                                          self.settings.service.drain_timeout_s, before_stop=save, sleep=sleep)
        finally:
            self.kv.stopped()
            self._save_kept()   # an unloaded model keeps nothing: the next serve loads it as configured
        if reason not in ("idle", "evicted"):
            self.kv.forget(name)   # an admin's unload, or a stop: nothing saved of it is wanted back
        return unloaded

    async def _save_slots(self, runtime: ModelRuntime, cause: str | None) -> None:
        """Before the pool's unload of `runtime` stops its replicas: its slots saved, for as long as
        the load it makes room for (`cause`) may still wait by its swap bound, or that bound when
        no load waits on it (an idle unload)."""
        bound = self.settings.lifecycle.swap_max_wait_s
        waiting = self.models[cause].admission.oldest_wait_s() if cause in self.models else 0.0
        await self.kv.save(runtime, max(0.0, bound - waiting))

    async def scale(self, name: str, replicas: int, actor: str | None = None) -> ModelRuntime:
        """Start or stop replicas of a loaded model, leaving the others running (proxy/lifecycle/scaling.py)."""
        runtime = self.get(name)
        try:
            return await scale(runtime, replicas, self.monitor, self.settings.service.drain_timeout_s, self.events,
                               actor)
        finally:
            self._save_kept()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> "asyncio.Task[T]":
        """Run `coro` in the background until it ends or the pool closes (background.py)."""
        return self.tasks.spawn(coro)

    async def detached(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run an admin load or unload to its end even if the caller is cancelled (its client left)."""
        return await self.tasks.detached(coro)

    # -- what serving/ asks of the pool ----------------------------------------------------------
    # The HTTP side goes through these, never into the pool's parts (placer, monitor, programs).

    @property
    def outcomes(self) -> Outcomes:
        """Where the data path reports each request's outcome on a replica (the monitor's health)."""
        return self.monitor

    def demand(self, runtime: ModelRuntime) -> None:
        """A request for a model that is not loaded: raise what refuses it now, else let it queue."""
        self.placer.demand(runtime)

    def memory_report(self) -> dict[str, Any]:
        """GET /v1/admin/memory: each device's budget and what holds it; the loads in flight and waiting."""
        return self.placer.describe()

    def supervisord_status(self) -> dict[str, object]:
        """Whether this machine's supervisord answers, and since when it has not."""
        return self.monitor.supervisord_status()

    def host_of(self, replica: Replica) -> Host:
        """The host a replica's program runs on (its log is read there)."""
        return self.programs.host_of(replica)

    async def gpu_memory_by_host(self, local: dict[str, Any]) -> dict[str, Any] | None:
        """GET /v1/admin/gpu-memory's `hosts`: this machine's (`local`) beside each node's (hosts_view.py)."""
        return await hosts_view.gpu_memory_by_host(self.hosts, self.models, local)

    async def close_nodes(self) -> None:
        """At the end: the XML-RPC clients of the nodes (this machine's supervisord is stopped apart)."""
        await asyncio.gather(*(h.client.close() for h in self.hosts.values() if not h.local))

