"""The pool: the lifecycle decisions. Load, adopt, scale and unload models.

The decisions are the same for every model; how a replica starts and stops differs per kind
(the `Kind` seam, proxy/lifecycle/state/kind.py): a supervisord program (kinds/program_kind.py) or a
remote endpoint (kinds/remote.py).
Load starts the replicas and waits until each passes its health check; a restarted proxy adopts
running ones. Keeping replica states true meanwhile is the monitor's job (monitor.py). Which models
may be loaded together, and when one loads on demand, unloads when idle or is evicted to make room,
is placement's (placement.py decides, placer.py carries it out); every load passes its admission.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from typing import Any, Awaitable, Callable, Mapping, TypeVar

from launchers.spec import replica_index
from proxy.admission import DEFAULT_MAX_QUEUE_WAIT_S, Admission
from proxy.config.model import ModelConfig
from proxy.config.settings import LOCAL_HOST, Settings
from proxy.errors import BackendError, Conflict, NotFound, PoolError, Unavailable
from proxy import events as ev
from proxy.events import Events
from proxy.fairness import FairnessPolicy
from proxy.gpu.footprint import gpu_totals
from proxy.gpu.report import load_nvml
from proxy.gpu.vram_estimate import Estimator
from proxy.lifecycle.placement.footprints import Footprints
from proxy.lifecycle.kept import FILE_NAME as KEPT_FILE, KeptModels
from proxy.lifecycle.kinds.kind import kinds_for, traits_for
from proxy.lifecycle.placement.load_retry import retry_delay, worth_retrying
from proxy.lifecycle.placement.memory import Memory
from proxy.lifecycle.watch.monitor import Monitor
from proxy.lifecycle.placement.placer import Placer
from proxy.lifecycle.kinds.process_table import live
from proxy.lifecycle.kinds.program_kind import ProgramKind
from proxy.lifecycle.kinds.programs import Programs
from proxy.lifecycle.kinds.remote import EndpointKind
from proxy.lifecycle.state.outcomes import Outcomes
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState
from proxy.lifecycle.rolling import roll
from proxy.lifecycle.state.runtime import Kind, LoadRetry, ModelRuntime
from proxy.lifecycle.scaling import scale
from proxy.upstream.client import UpstreamHttp
from proxy.supervisord.hosts import Host, build_hosts
from proxy.supervisord.managed import ManagedSupervisord
from proxy.supervisord.orphans import PidRecord
from proxy.supervisord.supervisor import SupervisorClient, SupervisorError

log = logging.getLogger(__name__)
T = TypeVar("T")


class Pool:
    def __init__(self, settings: Settings, supervisor: SupervisorClient, http: UpstreamHttp,
                 environ: Mapping[str, str] | None = None, pid_record: PidRecord | None = None,
                 managed: ManagedSupervisord | None = None, nvml_loader: Callable[[], Any] = load_nvml) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self.http = http
        self.environ = dict(os.environ if environ is None else environ)
        # What happened to models, replicas and hosts (GET /v1/admin/events); each event is logged too.
        self.events = Events()
        policy = FairnessPolicy.from_settings(settings.fairness)
        max_wait_s = settings.fairness.get("max_queue_wait_s", DEFAULT_MAX_QUEUE_WAIT_S)
        # One queue per model for its whole life: requests wait in it while it loads on demand.
        self.models: dict[str, ModelRuntime] = {
            n: ModelRuntime(config=c, policy=policy, admission=Admission(policy, max_wait_s=max_wait_s))
            for n, c in settings.models.items()}
        self.hosts = build_hosts(settings, supervisor, self.environ)
        self.programs = Programs(settings, supervisor, self.environ, self.models, lambda: self.monitor.wake(),
                                 pid_record, self.hosts, lambda *a: self.placer.hosts_for(*a), events=self.events)
        self.monitor = Monitor(settings, supervisor, http, self.models, self.programs, self.events, managed)
        kinds: dict[str, Kind] = kinds_for({c.backend for c in settings.models.values()},
                                           ProgramKind(self.programs), EndpointKind(http, self.environ))
        for runtime in self.models.values():
            runtime.kind = kinds.get(runtime.config.backend)
            runtime.traits = traits_for(runtime.config.backend)
        life = settings.lifecycle
        footprints = Footprints(settings.service.state_dir / "footprints.json", life.footprint_percentile,
                                life.footprint_margin)
        self.nvml_loader = nvml_loader
        self.memory = Memory(life, footprints, Estimator(), gpu_totals(lambda: _no_nvml_yet()))
        self.memory.hosts = {n: h for n, h in self.hosts.items() if not h.local}
        self.placer = Placer(settings, self.models, self.memory, nvml_loader, events=self.events)
        self._background: set[asyncio.Task[Any]] = set()
        # Models whose first load at startup has not finished (loaded or failed): /ready waits for them.
        self.startup_pending: set[str] = set()
        # Startup loads that failed and are tried again, until they load or an admin steps in.
        self._retries: dict[str, LoadRetry] = {}
        # What an admin set for the loaded models, for the next serve (proxy/lifecycle/kept.py).
        self.kept = KeptModels(settings.service.state_dir / KEPT_FILE)
        # Set while no earlier proxy process may still send requests to the replicas: a roll
        # (rolling.py) stops no old replica before. Set from the start; a handover from a
        # predecessor that is still draining clears it until that process has exited
        # (proxy/serving/handover.py).
        self.predecessor_gone = asyncio.Event()
        self.predecessor_gone.set()
        self._rolling: set[str] = set()   # models whose roll runs: one at a time each

    # -- lifecycle of the pool itself ------------------------------------------------------------

    async def start(self) -> None:
        self.settings.supervisor.programs_dir.mkdir(parents=True, exist_ok=True)
        self.memory.gpus = await asyncio.to_thread(gpu_totals, self.nvml_loader)
        await self.programs.snapshot()
        self.monitor.start()
        task = self.placer.start(self)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def load_in_background(self) -> None:
        """Load the enabled models, and adopt any other configured model whose replicas are still
        running (an admin loaded it before the proxy restarted). Groups left in the programs folder
        by models no longer configured are stopped and removed."""
        running = self.adopting()
        kept = self.kept.read()
        for runtime in self.models.values():
            adopting = runtime.name in running
            if runtime.config.enabled or adopting:
                self.startup_pending.add(runtime.name)
                overrides = self.kept.honour(runtime, kept.pop(runtime.name, None))
                self._spawn(self._load_at_startup(runtime.name, adopting, overrides))
        for name in sorted(kept):
            log.info("model %s is not loaded at startup: its kept overrides are dropped", name)
        self._save_kept()
        self._spawn(self._remove_orphans())

    def adopting(self) -> frozenset[str]:
        """The configured models with replicas running now (as of the last snapshot): those the
        startup adopts."""
        running = {i.group for i in self.programs.processes.values() if live(i)}
        return frozenset(name for name in self.models if any(replica_index(name, g) is not None for g in running))

    def _save_kept(self) -> None:
        """What an admin set for every loaded model, for the next serve (kept.py)."""
        self.kept.save(self.models.values())

    async def _remove_orphans(self) -> None:
        # A reload's predecessor may still finish requests on a model the new settings dropped.
        await self.predecessor_gone.wait()
        for path in sorted(self.settings.supervisor.programs_dir.glob("*.conf")):
            if any(replica_index(name, path.stem) is not None for name in self.models):
                continue   # a configured model's replica: its load adopts, restarts or removes it
            log.warning("removing %s: its model is no longer configured", path.name)
            try:
                await self.programs.remove_group(path.stem)
                path.unlink(missing_ok=True)
                await self.supervisor.reload_config()
            except SupervisorError as exc:
                log.error("could not remove %s: %s", path.name, exc)
        # The same on every other host that answers: a node keeps its files across proxy restarts.
        for name, host in self.hosts.items():
            if host.local or host.down_since is not None:
                continue
            try:
                stale = [p for p in await host.texts(self.settings.supervisor.programs_dir)
                         if not any(replica_index(model, p) is not None for model in self.models)]
                for program in stale:
                    log.warning("removing %s on host %s: its model is no longer configured", program, name)
                if stale:
                    await self.programs.remove([(name, p) for p in stale])
            except SupervisorError as exc:
                log.error("could not remove stale programs on host %s: %s", name, exc)

    async def close(self, stop_models: bool) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        # The kept state is not written here: it was after each change, and a successor that took
        # over the listeners (a handover) may have written its own since.
        self.placer.save_usage()
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
        return {**runtime.describe(), **self.placer.describe_model(runtime)}

    def describe_hosts(self) -> list[dict[str, object]]:
        """GET /v1/admin/hosts (`llm-pool ctl hosts`): each host, with its memory and replicas."""
        memory = self.placer.describe()["devices"]
        status = self.host_status()
        rows = []
        for name, host in self.hosts.items():
            replicas = [f"{rt.name}/r{r.index}" for rt in self.models.values() for r in rt.replicas if r.host == name]
            prefix = "" if host.local else f"{name}:"
            devices = [{**d, "device": d["device"][len(prefix):]} for d in memory
                       if (d["device"].startswith(prefix) if prefix else ":" not in d["device"])]
            rows.append({**host.describe(), **status[name], "memory": devices, "replicas": len(replicas),
                         "replica_names": replicas})
        return rows

    def host_status(self) -> dict[str, dict[str, object]]:
        """Each host: whether its supervisord answers, for how long it has not and why, and the
        seconds since it last answered (GET /health, /metrics, the hosts view). This machine's
        (`local`) is the monitor's view of its supervisord, which is never marked down as a node is."""
        now = time.monotonic()
        out: dict[str, dict[str, object]] = {}
        for name, host in self.hosts.items():
            if host.local:
                local = self.monitor.supervisord_status()
                answering, down_for, error = bool(local["answering"]), local["down_for_s"], local["error"]
            else:
                answering, down_for, error = host.down_since is None, host.down_for_s(now), host.error
            out[name] = {"answering": answering, "down_for_s": down_for, "error": error,
                         "last_contact_s": host.last_contact_s(now)}
        return out

    def replica_programs(self, host: str) -> dict[str, str]:
        """The program of each replica on `host`, by its admin name (`model/rN`)."""
        return {f"{rt.name}/r{r.index}": r.spec.program for rt in self.models.values() for r in rt.replicas
                if r.host == host and r.spec is not None}

    def get(self, name: str) -> ModelRuntime:
        try:
            return self.models[name]
        except KeyError:
            raise NotFound(f"model {name!r} is not configured", param="model") from None

    # -- load ------------------------------------------------------------------------------------

    async def load(self, name: str, overrides: Mapping[str, Any] | None = None,
                   actor: str | None = None) -> ModelRuntime:
        """Load a configured model (or adopt its running replicas); returns once it is ready or failed.
        An admin's load: it ends the retries of a failed startup load, and is not retried itself.
        `actor`: who asked (for the events feed)."""
        runtime = self.get(name)
        self._stop_retry(name)
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
            if any(r.outdated for r in runtime.replicas) and name not in self._rolling:
                self._spawn(self._roll(runtime))
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
        outdated = sum(1 for r in runtime.replicas if r.outdated)
        log.info("model %s: rolling %d out-of-date replica(s) onto its settings, one at a time", runtime.name,
                 outdated)
        self._rolling.add(runtime.name)
        try:
            done = await roll(runtime, self.monitor, self.events, self.predecessor_gone,
                              self.settings.service.drain_timeout_s)
        finally:
            self._rolling.discard(runtime.name)
        if done:
            runtime.kept = None
            log.info("model %s: every replica runs its settings", runtime.name)
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
        kind = runtime.kind
        if kind is None:
            raise self._cannot_start(runtime, reason, Conflict(
                f"model {name!r}: backend {config.backend!r} cannot be run by this version of llm-pool",
                code="backend_not_supported"))
        problems = kind.check(config)
        if problems:
            raise self._cannot_start(runtime, reason, Conflict(
                f"model {name!r} cannot be loaded: " + "; ".join(problems), code="model_not_loadable"))
        if config.replicas < 1:
            raise Conflict(f"model {name!r}: replicas must be at least 1 to load", code="model_not_loadable")
        if evict is None:
            evict = self.placer.admit(runtime, config, may_evict=counted != "startup")
        else:
            self.placer.reserve(name, config)
        if evict:
            await self.placer.make_room(self, runtime, evict)
        runtime.move(ModelState.LOADING)
        started = time.monotonic()
        runtime.active = config
        runtime.last_error = None
        runtime.admission.reopen()
        try:
            await kind.start(runtime, config)
            await self.monitor.await_replicas(runtime)
        except asyncio.CancelledError:
            raise  # the proxy is stopping: what runs is left for the next one to adopt or stop
        except Exception as exc:
            runtime.last_error = str(exc)
            with contextlib.suppress(Exception):
                await self._teardown(runtime, drain=False, keep_waiters=True)
            runtime.move(ModelState.FAILED)
            self._load_failed(runtime, reason, actor, str(exc))
            if isinstance(exc, SupervisorError):
                error = Unavailable(f"supervisord: {exc}", code="supervisor_unavailable", retry_after=5)
                self._fail_waiters(runtime, counted, error)
                raise error from exc
            self._fail_waiters(runtime, counted, exc)
            raise
        errors = "; ".join(f"replica {r.index}: {r.last_error}" for r in runtime.replicas
                           if r.state != ReplicaState.READY)
        runtime.last_error = errors or None
        if not runtime.ready():
            await self._teardown(runtime, drain=False, keep_waiters=True)
            runtime.move(ModelState.FAILED)
            self._load_failed(runtime, reason, actor, errors)
            failed = BackendError(f"model {name!r} failed to load: {errors}", code="model_load_failed")
            self._fail_waiters(runtime, counted, failed)
            raise failed
        runtime.move(ModelState.LOADED)
        runtime.loaded_at = time.monotonic()
        runtime.load_s = runtime.loaded_at - started
        runtime.loads[counted] = runtime.loads.get(counted, 0) + 1
        by = f" by {actor}" if actor else ""
        self.events.record(ev.LOAD, f"model {name} loaded ({reason}{by}) in {runtime.load_s:.2f}s: "
                           f"{len(runtime.ready())} of {len(runtime.replicas)} replicas ready",
                           model=name, reason=reason, actor=actor)
        self._spawn(self.placer.measure(runtime))
        return runtime

    def _cannot_start(self, runtime: ModelRuntime, reason: str, error: Conflict) -> Conflict:
        """A model that cannot even be started is FAILED with the reason, for the admin view and
        /health; every other model is unaffected."""
        runtime.move(ModelState.FAILED, error.message)
        self._load_failed(runtime, reason, None, error.message)
        self._fail_waiters(runtime, reason, error)
        return error

    def _load_failed(self, runtime: ModelRuntime, reason: str, actor: str | None, why: str) -> None:
        by = f" by {actor}" if actor else ""
        self.events.record(ev.LOAD_FAILED, f"model {runtime.name} failed to load ({reason}{by}): {why}",
                           model=runtime.name, reason=reason, actor=actor, level=logging.ERROR)

    @staticmethod
    def _fail_waiters(runtime: ModelRuntime, reason: str, exc: Exception) -> None:
        """A load failed (the model is FAILED): requests that queued for it meanwhile (it loads on
        demand) learn why; an on-demand load's waiters get the error with its back-off from the
        placer instead. A load refused before it began (the model is loaded with other settings,
        there is no room) never comes here: it changed nothing, and the model serves on."""
        if reason != "on_demand":
            runtime.admission.close(exc if isinstance(exc, PoolError) else BackendError(
                f"model {runtime.name!r} failed to load: {exc}", code="model_load_failed"))

    # -- unload ----------------------------------------------------------------------------------

    async def unload(self, name: str, drain: bool = True, actor: str | None = None) -> ModelRuntime:
        """Stop admitting, let in-flight requests finish (up to service.drain_timeout_s), stop the
        replicas, remove the group and its file.

        It always ends: UNLOADED with the processes stopped, or FAILED with the reason (supervisord
        gone, a process that would not stop), from which another unload starts over."""
        self.get(name)
        self._stop_retry(name)   # an admin's unload: the model stays unloaded
        return await self._unload(name, drain, reason="admin", actor=actor)

    async def unload_by_pool(self, name: str, reason: str, cause: str | None = None) -> ModelRuntime:
        """An unload placement decided (`reason`: idle, evicted; `cause`: the model it made room
        for, or how long it was idle): drained, its waiters kept queued."""
        return await self._unload(name, drain=True, reason=reason, cause=cause)

    async def _unload(self, name: str, drain: bool, reason: str, cause: str | None = None,
                      actor: str | None = None) -> ModelRuntime:
        try:
            return await self._unload_model(name, drain, reason, cause, actor)
        finally:
            self._save_kept()   # an unloaded model keeps nothing: the next serve loads it as configured

    async def _unload_model(self, name: str, drain: bool, reason: str, cause: str | None,
                            actor: str | None) -> ModelRuntime:
        runtime = self.get(name)
        if runtime.state in (ModelState.UNLOADED, ModelState.UNLOADING):
            raise Conflict(f"model {name!r} is not loaded", code="model_not_loaded")
        async with runtime.lock:
            # It may have changed while this waited for the lock (a load that failed, a racing unload).
            if runtime.state == ModelState.UNLOADED:  # type: ignore[comparison-overlap]
                raise Conflict(f"model {name!r} is not loaded", code="model_not_loaded")
            if reason in ("idle", "evicted") and (runtime.state != ModelState.LOADED or runtime.config.pinned):
                raise Conflict(f"model {name!r} is {runtime.state.value}: not unloaded ({reason})",
                               code="model_not_loaded")
            if reason == "idle" and (runtime.admission.active or runtime.admission.waiting):
                return runtime   # a request came since placement found it idle: it stays
            runtime.move(ModelState.UNLOADING)
            runtime.unload_reason = reason
            started = time.monotonic()
            keep_waiters = reason in ("idle", "evicted")
            try:
                await self._teardown(runtime, drain=drain, keep_waiters=keep_waiters, measure=reason != "shutdown")
            except BaseException as exc:
                # Never leave UNLOADING behind: it refuses requests and a second unload alike.
                reason = "interrupted (the proxy is stopping)" if isinstance(exc, asyncio.CancelledError) else str(exc)
                runtime.move(ModelState.FAILED, f"unload did not finish: {reason}")
                log.error("model %s: %s", name, runtime.last_error)
                if isinstance(exc, SupervisorError):
                    raise Unavailable(f"model {name!r} could not be unloaded: {exc}; it is marked failed, "
                                      "unload it again to retry", code="unload_failed", retry_after=5) from exc
                raise
            runtime.move(ModelState.UNLOADED)
            runtime.unload_s = time.monotonic() - started
            runtime.unloads[reason] = runtime.unloads.get(reason, 0) + 1
            runtime.unload_reason = None
            runtime.active = None
            runtime.last_error = None
            why = {"evicted": f"evicted for {cause}", "idle": f"idle for {cause}"}.get(reason, reason) \
                if cause else reason
            by = f" by {actor}" if actor else ""
            self.events.record(ev.UNLOAD, f"model {name} unloaded ({why}{by}) in {runtime.unload_s:.2f}s",
                               model=name, reason=reason, cause=cause, actor=actor)
            return runtime

    async def scale(self, name: str, replicas: int, actor: str | None = None) -> ModelRuntime:
        """Start or stop replicas of a loaded model, leaving the others running (proxy/lifecycle/scaling.py)."""
        runtime = self.get(name)
        before = len(runtime.replicas)
        try:
            await scale(runtime, replicas, self.monitor, self.settings.service.drain_timeout_s)
        finally:
            self._save_kept()
        if len(runtime.replicas) != before:
            by = f" by {actor}" if actor else ""
            self.events.record(ev.SCALE, f"model {name} scaled from {before} to {len(runtime.replicas)} replicas{by} "
                               f"({len(runtime.ready())} ready)", model=name, actor=actor)
        return runtime

    async def _teardown(self, runtime: ModelRuntime, drain: bool, keep_waiters: bool = False,
                        measure: bool = False) -> None:
        if keep_waiters:
            runtime.admission.hold()   # they wait for its next load
        else:
            runtime.admission.close(Unavailable(f"model {runtime.name!r} is being unloaded", code="model_unloading"))
        if measure:
            await self.placer.measure(runtime)   # after serving: its footprint as it grew with use
        if drain:
            # The pool's own unloads (idle, evicted) never cut a request short: what runs ends by
            # itself, bounded by its timeouts. An admin's waits service.drain_timeout_s at most.
            deadline = time.monotonic() + (math.inf if keep_waiters else self.settings.service.drain_timeout_s)
            while runtime.admission.active > 0 and time.monotonic() < deadline:
                await runtime.wait_changed(0.05)
        for replica in runtime.replicas:
            replica.cancel_tasks()
            runtime.set_replica_state(replica, ReplicaState.STOPPING)
        # Should this raise, the replicas stay STOPPING (shown with the model's reason) and a
        # program group's file stays, so that the next unload retries the same steps.
        if runtime.kind is not None:
            await runtime.kind.stop(runtime)
        for replica in runtime.replicas:
            runtime.set_replica_state(replica, ReplicaState.STOPPED)
            replica.pid, replica.alive = 0, False
        runtime.replicas = []

    # -- startup loads, tried again ------------------------------------------------------------

    def retrying(self) -> list[str]:
        """The models whose failed startup load is being tried again."""
        return sorted(self._retries)

    def _stop_retry(self, name: str) -> None:
        retry = self._retries.pop(name, None)
        if retry is not None:
            retry.stopped.set()
            self.models[name].load_retry = None
            log.info("model %s: no more load retries, an admin loads or unloads it", name)

    async def _load_at_startup(self, name: str, adopting: bool = False, overrides: Mapping[str, Any] | None = None
                               ) -> None:
        """Load a model at startup; a failure that can pass without an edit (worth_retrying) is tried
        again after retry_delay, for as long as it fails, until an admin loads or unloads the model.
        `adopting`: its replicas run already; their memory is in use, so it is not admitted again.
        `overrides`: what the last proxy kept of an admin's (kept.py), for every try."""
        runtime = self.models[name]
        retry = self._retries[name] = LoadRetry()
        try:
            while True:
                try:
                    await self._load(name, overrides, reason="startup", evict=() if adopting else None,
                                     adopting=adopting)
                    return
                except Exception as exc:
                    # A load refused before it began (e.g. not loadable) left no error on the model: /ready shows it.
                    runtime.last_error = runtime.last_error or str(exc)
                    if retry.stopped.is_set() or not worth_retrying(exc):
                        log.error("loading %s failed: %s", name, exc)
                        return
                    retry.attempts += 1
                    delay = retry_delay(self.settings.service, retry.attempts)
                    log.error("loading %s failed (try %d): %s; trying again in %gs", name, retry.attempts, exc, delay)
                finally:
                    self.startup_pending.discard(name)
                retry.next_at = time.monotonic() + delay
                runtime.load_retry = retry
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await retry.stopped.wait()
                if retry.stopped.is_set():
                    return
                retry.next_at = None
        finally:
            if self._retries.get(name) is retry:
                del self._retries[name]
                runtime.load_retry = None

    def spawn(self, coro: Any) -> "asyncio.Task[Any]":
        """Run `coro` in the background until it ends or the pool closes."""
        return self._spawn(coro)

    def _spawn(self, coro: Any) -> "asyncio.Task[Any]":
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def detached(self, coro: Awaitable[T]) -> T:
        """Run an admin load or unload to its end even if the caller is cancelled (its client
        left): half a load or unload would leave the model LOADING or UNLOADING for good."""
        task = self._spawn(coro)
        # Retrieved even when no one awaits it any more, so its failure is not reported as lost.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(task)


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
        """GET /v1/admin/gpu-memory's `hosts`: this machine's devices (`local`, the report's own) beside
        each node's, read from it now; None where every host is this machine."""
        nodes = [h for h in self.hosts.values() if not h.local]
        if not nodes:
            return None
        found = await asyncio.gather(*(h.gpu_memory(self.replica_programs(h.name)) for h in nodes))
        return {**({"local": local} if LOCAL_HOST in self.hosts else {}), **{h.name: f for h, f in zip(nodes, found)}}

    async def close_nodes(self) -> None:
        """At the end: the XML-RPC clients of the nodes (this machine's supervisord is stopped apart)."""
        await asyncio.gather(*(h.client.close() for h in self.hosts.values() if not h.local))


def _no_nvml_yet() -> Any:
    # Pool.start reads the GPUs (in a thread); until then no budget is known.
    raise RuntimeError("not read yet")
