"""The pool: load, adopt, scale and unload models, and keep their replicas' states true.

The decisions are the same for every model; how a replica starts and stops differs per kind
(proxy/kinds.py): a supervisord program (proxy/programs.py) or a remote endpoint. Load starts the
replicas and waits until each passes its health check; a restarted proxy adopts running ones.
The monitor polls supervisord and probes health so that a crash costs one replica until
supervisord has restarted it and it answers again, and an admin's `supervisorctl stop` is respected.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any, Awaitable, Mapping, TypeVar

import aiohttp

from launchers.spec import ProgramSpec, replica_index
from proxy.admission import DEFAULT_MAX_QUEUE_WAIT_S, Admission
from proxy.config import Settings
from proxy.fairness import FairnessPolicy
from proxy.supervisord.orphans import PidRecord
from proxy.lifecycle.programs import Programs
from proxy.lifecycle.engine_metrics import read_gauges
from proxy.errors import BackendError, Conflict, NotFound, Unavailable
from proxy.lifecycle.kinds import kinds_for
from proxy.lifecycle.health import HealthPolicy, ReadyChecks, note_failure, note_success, state_after_check
from proxy.lifecycle.replicas import ModelState, Replica, ReplicaState
from proxy.lifecycle.runtime import ModelRuntime
from proxy.lifecycle.scaling import scale
from proxy.lifecycle.warmup import warm_up
from proxy.supervisord.supervisor import ProcessInfo, ProcessState, SupervisorClient, SupervisorError

log = logging.getLogger(__name__)
T = TypeVar("T")

METRICS_INTERVAL_S = 0.5
EXITED_STATES = (ProcessState.BACKOFF, ProcessState.EXITED, ProcessState.FATAL)
DOWN_STATES = (ProcessState.STOPPED, ProcessState.STOPPING)
PROBE_TIMEOUT_S = 2.0


class Pool:
    def __init__(self, settings: Settings, supervisor: SupervisorClient, http: aiohttp.ClientSession,
                 environ: Mapping[str, str] | None = None, pid_record: PidRecord | None = None) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self.http = http
        self.environ = dict(os.environ if environ is None else environ)
        self.health = HealthPolicy.from_settings(settings.service)
        self.checks = ReadyChecks(self.health, lambda spec, timeout_s: probe(self.http, spec, timeout_s))
        policy = FairnessPolicy.from_settings(settings.fairness)
        self.models: dict[str, ModelRuntime] = {n: ModelRuntime(config=c, policy=policy)
                                                for n, c in settings.models.items()}
        self._wake = asyncio.Event()
        self.programs = Programs(settings, supervisor, self.environ, self.models, self._wake.set, pid_record)
        kinds = kinds_for({c.backend for c in settings.models.values()}, self.environ, self.programs, http)
        for runtime in self.models.values():
            runtime.kind = kinds.get(runtime.config.backend)
        self._monitor: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # Models whose load at startup has not finished (loaded or failed): /ready waits for them.
        self.startup_pending: set[str] = set()

    # -- lifecycle of the pool itself ------------------------------------------------------------

    async def start(self) -> None:
        self.settings.supervisor.programs_dir.mkdir(parents=True, exist_ok=True)
        await self.programs.snapshot()
        self._monitor = asyncio.create_task(self._monitor_loop(), name="llm-pool monitor")

    def load_in_background(self) -> None:
        """Load the enabled models, and adopt any other configured model whose replicas are still
        running (an admin loaded it before the proxy restarted). Groups left in the programs folder
        by models no longer configured are stopped and removed."""
        running = {i.group for i in self.programs.processes.values() if i.state == ProcessState.RUNNING}
        for runtime in self.models.values():
            if runtime.config.enabled or any(replica_index(runtime.name, g) is not None for g in running):
                self.startup_pending.add(runtime.name)
                self._spawn(self._load_logged(runtime.name))
        self._spawn(self._remove_orphans())

    async def _remove_orphans(self) -> None:
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

    async def close(self, stop_models: bool) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if stop_models:
            await asyncio.gather(*(self.unload(n, drain=False) for n, rt in self.models.items()
                                   if rt.state not in (ModelState.UNLOADED,)), return_exceptions=True)
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        for runtime in self.models.values():
            for replica in runtime.replicas:
                replica.cancel_tasks()

    def get(self, name: str) -> ModelRuntime:
        try:
            return self.models[name]
        except KeyError:
            raise NotFound(f"model {name!r} is not configured", param="model") from None

    # -- load ------------------------------------------------------------------------------------

    async def load(self, name: str, overrides: Mapping[str, Any] | None = None) -> ModelRuntime:
        """Load a configured model (or adopt its running replicas); returns once it is ready or failed."""
        runtime = self.get(name)
        config = runtime.config.with_overrides(overrides or {})
        async with runtime.lock:
            if runtime.state == ModelState.LOADED:
                if runtime.active == config:
                    return runtime
                raise Conflict(f"model {name!r} is loaded with other settings; unload it first",
                               code="model_already_loaded")
            kind = runtime.kind
            if kind is None:
                raise self._cannot_start(runtime, Conflict(
                    f"model {name!r}: backend {config.backend!r} cannot be run by this version of llm-pool",
                    code="backend_not_supported"))
            problems = kind.check(config)
            if problems:
                raise self._cannot_start(runtime, Conflict(f"model {name!r} cannot be loaded: " + "; ".join(problems),
                                                           code="model_not_loadable"))
            if config.replicas < 1:
                raise Conflict(f"model {name!r}: replicas must be at least 1 to load", code="model_not_loadable")
            runtime.state = ModelState.LOADING
            started = time.monotonic()
            runtime.active = config
            runtime.last_error = None
            runtime.admission = Admission(runtime.policy, max_wait_s=self.settings.fairness.get(
                "max_queue_wait_s", DEFAULT_MAX_QUEUE_WAIT_S))
            try:
                await kind.start(runtime, config)
                await self._await_replicas(runtime)
            except asyncio.CancelledError:
                raise  # the proxy is stopping: what runs is left for the next one to adopt or stop
            except Exception as exc:
                runtime.last_error = str(exc)
                with contextlib.suppress(Exception):
                    await self._teardown(runtime, drain=False)
                runtime.state = ModelState.FAILED
                if isinstance(exc, SupervisorError):
                    raise Unavailable(f"supervisord: {exc}", code="supervisor_unavailable", retry_after=5) from exc
                raise
            errors = "; ".join(f"replica {r.index}: {r.last_error}" for r in runtime.replicas
                               if r.state != ReplicaState.READY)
            runtime.last_error = errors or None
            if not runtime.ready():
                await self._teardown(runtime, drain=False)
                runtime.state = ModelState.FAILED
                raise BackendError(f"model {name!r} failed to load: {errors}", code="model_load_failed")
            runtime.state = ModelState.LOADED
            runtime.load_s = time.monotonic() - started
            log.info("model %s loaded: %d of %d replicas ready", name, len(runtime.ready()), len(runtime.replicas))
            return runtime

    @staticmethod
    def _cannot_start(runtime: ModelRuntime, error: Conflict) -> Conflict:
        """A model that cannot even be started is FAILED with the reason, for the admin view and
        /health; every other model is unaffected."""
        runtime.state = ModelState.FAILED
        runtime.last_error = error.message
        return error

    async def _await_replicas(self, runtime: ModelRuntime, replicas: list[Replica] | None = None) -> None:
        # Endpoints are judged inside their kind's start; only programs take time to become healthy.
        replicas = runtime.replicas if replicas is None else replicas
        deadline = time.monotonic() + max((r.spec.start_timeout_s for r in replicas if r.spec), default=0.0)
        while True:
            starting = [r for r in replicas if r.state == ReplicaState.STARTING]
            if not starting:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                for replica in starting:
                    tail = await self._log_tail(replica)
                    last = f" (last: {replica.last_error})" if replica.last_error else ""
                    runtime.set_replica_state(replica, ReplicaState.FAILED,
                                              f"not healthy within {replica.spec.start_timeout_s:.0f}s{last}{tail}")
                return
            await runtime.wait_changed(min(left, 1.0))

    # -- unload ----------------------------------------------------------------------------------

    async def unload(self, name: str, drain: bool = True) -> ModelRuntime:
        """Stop admitting, let in-flight requests finish (up to service.drain_timeout_s), stop the
        replicas, remove the group and its file.

        It always ends: UNLOADED with the processes stopped, or FAILED with the reason (supervisord
        gone, a process that would not stop), from which another unload starts over."""
        runtime = self.get(name)
        if runtime.state in (ModelState.UNLOADED, ModelState.UNLOADING):
            raise Conflict(f"model {name!r} is not loaded", code="model_not_loaded")
        async with runtime.lock:
            if runtime.state == ModelState.UNLOADED:
                raise Conflict(f"model {name!r} is not loaded", code="model_not_loaded")
            runtime.state = ModelState.UNLOADING
            started = time.monotonic()
            try:
                await self._teardown(runtime, drain=drain)
            except BaseException as exc:
                # Never leave UNLOADING behind: it refuses requests and a second unload alike.
                runtime.state = ModelState.FAILED
                reason = "interrupted (the proxy is stopping)" if isinstance(exc, asyncio.CancelledError) else str(exc)
                runtime.last_error = f"unload did not finish: {reason}"
                log.error("model %s: %s", name, runtime.last_error)
                if isinstance(exc, SupervisorError):
                    raise Unavailable(f"model {name!r} could not be unloaded: {exc}; it is marked failed, "
                                      "unload it again to retry", code="unload_failed", retry_after=5) from exc
                raise
            runtime.state = ModelState.UNLOADED
            runtime.unload_s = time.monotonic() - started
            runtime.active = None
            runtime.last_error = None
            log.info("model %s unloaded", name)
            return runtime

    async def scale(self, name: str, replicas: int) -> ModelRuntime:
        """Start or stop replicas of a loaded model, leaving the others running (proxy/scaling.py)."""
        return await scale(self, self.get(name), replicas)

    async def _teardown(self, runtime: ModelRuntime, drain: bool) -> None:
        runtime.admission.close(Unavailable(f"model {runtime.name!r} is being unloaded", code="model_unloading"))
        if drain:
            deadline = time.monotonic() + self.settings.service.drain_timeout_s
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
            replica.pid = 0
        runtime.replicas = []

    # -- monitoring ------------------------------------------------------------------------------

    def report_connection_failure(self, replica: Replica, error: str) -> None:
        """A refused connection on the data path (the request never reached the replica): its
        process is gone or restarting, so stop routing to it at once; its health check brings it back."""
        runtime = self.models[replica.model]
        replica.failures += 1
        if replica.state in (ReplicaState.READY, ReplicaState.UNHEALTHY):
            runtime.set_replica_state(replica, ReplicaState.STARTING, error)
            self._wake.set()

    def report_outcome(self, replica: Replica, error: str | None = None) -> None:
        """How a request sent to `replica` ended: None when it answered, else why it failed (a 5xx,
        a timeout, a broken connection). Failures in a row eject it (proxy/health.py); a single
        failure never takes it out of rotation by itself."""
        if error is None:
            note_success(replica)
            return
        runtime = self.models.get(replica.model)
        if runtime is not None and replica in runtime.replicas:
            if note_failure(runtime, replica, error, self.health):
                log.warning("model %s replica %d ejected: %s", replica.model, replica.index, replica.last_error)

    async def _monitor_loop(self) -> None:
        interval = self.settings.supervisor.poll_interval_s
        while True:
            try:
                taken = time.monotonic()
                processes = await self.programs.snapshot()
                for runtime in self.models.values():
                    if runtime.state in (ModelState.LOADING, ModelState.LOADED):
                        for replica in runtime.replicas:
                            if replica.spec is None:
                                # An endpoint: no program for supervisord to judge, no health path
                                # to probe. An ejected one comes back once its ejection is over;
                                # failing again ejects it again, for longer.
                                self.checks.maybe_recheck(runtime, replica)
                                continue
                            # A replica whose state changed while the snapshot was in flight (a load
                            # just started it) is judged on the next, fresher snapshot.
                            if replica.state_since <= taken:
                                await self._observe(runtime, replica, processes.get(replica.fullname))
                            self._maybe_scrape(replica)
                            self.checks.maybe_check(runtime, replica)
            except SupervisorError as exc:
                log.warning("monitor: %s", exc)
            except Exception:
                log.exception("monitor iteration failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: a stop's cancel is never lost
                async with asyncio.timeout(interval):
                    await self._wake.wait()

    async def _observe(self, runtime: ModelRuntime, replica: Replica, info: ProcessInfo | None) -> None:
        state = replica.state
        if state in (ReplicaState.STOPPING,):
            return
        if info is None:
            if state != ReplicaState.STOPPED:
                runtime.set_replica_state(replica, ReplicaState.STOPPED, "program no longer known to supervisord")
            return
        pid_changed = bool(replica.pid) and info.pid not in (0, replica.pid)
        if pid_changed:
            replica.restarts += 1
            replica.failures += 1  # a process that keeps crashing is ejected like one that keeps failing
        if info.pid:
            replica.pid = info.pid
        if info.state == ProcessState.FATAL and state in (ReplicaState.READY, ReplicaState.STARTING,
                                                          ReplicaState.UNHEALTHY):
            tail = await self._log_tail(replica)
            runtime.set_replica_state(replica, ReplicaState.FAILED, "supervisord gave up restarting it" + tail)
            return
        if state in (ReplicaState.READY, ReplicaState.UNHEALTHY):
            if info.state in DOWN_STATES:
                # An admin's `supervisorctl stop`: respected, never undone by the pool.
                runtime.set_replica_state(replica, ReplicaState.STOPPED, "stopped in supervisord")
            elif info.state != ProcessState.RUNNING or pid_changed:
                runtime.set_replica_state(replica, ReplicaState.STARTING,
                                          f"process exited ({info.description or info.state.name}); restarting")
            elif state == ReplicaState.UNHEALTHY:
                self.checks.maybe_recheck(runtime, replica)
            return
        if state == ReplicaState.STARTING:
            if runtime.state == ModelState.LOADING and (info.state in EXITED_STATES or pid_changed):
                runtime.set_replica_state(replica, ReplicaState.FAILED,
                                          f"exited during start ({info.description or info.state.name})"
                                          + await self._log_tail(replica))
                await self._stop_quietly(replica)
                return
            if info.state in DOWN_STATES and runtime.state == ModelState.LOADED:
                runtime.set_replica_state(replica, ReplicaState.STOPPED, "stopped in supervisord")
                return
            if info.state == ProcessState.RUNNING:
                if replica.probe is None or replica.probe.done():
                    replica.probe = asyncio.create_task(self._probe(runtime, replica, info.pid))
            return
        # STOPPED or FAILED: an admin may bring the process back with supervisorctl start.
        if runtime.state == ModelState.LOADED and info.state in (ProcessState.STARTING, ProcessState.RUNNING):
            runtime.set_replica_state(replica, ReplicaState.STARTING)
            self._wake.set()

    async def _probe(self, runtime: ModelRuntime, replica: Replica, pid: int) -> None:
        ok, error = await probe(self.http, replica.spec)
        if replica.state != ReplicaState.STARTING or replica.pid != pid:
            return
        if ok:
            after = state_after_check(runtime, replica, self.health)
            if after == ReplicaState.READY and (runtime.active or runtime.config).get("warmup"):
                # READY only once one generation went through; a failure is retried like a failed check.
                seconds, error = await warm_up(self.http, replica, replica.spec.start_timeout_s)
                if replica.state != ReplicaState.STARTING or replica.pid != pid:
                    return
                if seconds is None:
                    replica.probe_failures += 1
                    replica.last_error = error
                    log.warning("model %s replica %d: %s", replica.model, replica.index, error)
                    return
                replica.warmup_s = seconds
                log.info("model %s replica %d warmed up in %.3fs", replica.model, replica.index, seconds)
            runtime.set_replica_state(replica, after)
            if replica.state == ReplicaState.READY:
                replica.last_error = None
        elif error:
            replica.last_error = error

    def _maybe_scrape(self, replica: Replica) -> None:
        """Refresh the backend's load gauges in the background, at most every METRICS_INTERVAL_S."""
        if replica.state != ReplicaState.READY or replica.spec.metrics is None:
            return
        if replica.scrape is not None and (not replica.scrape.done() or
                                           time.monotonic() - replica.scraped_at < METRICS_INTERVAL_S):
            return
        replica.scrape = asyncio.create_task(self._scrape(replica))

    async def _scrape(self, replica: Replica) -> None:
        assert replica.spec.metrics is not None
        try:
            async with self.http.get(replica.reach.url("/metrics"), headers=dict(replica.spec.headers),
                                     timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError):
            text = ""
        replica.scraped_at = time.monotonic()
        if replica.state == ReplicaState.READY:  # it may have left READY while the scrape was in flight
            replica.reported = read_gauges(text, replica.spec.metrics) if text else {}

    async def _log_tail(self, replica: Replica, length: int = 2000) -> str:
        try:
            text = await self.supervisor.tail_log(replica.fullname, length)
        except SupervisorError:
            return ""
        text = text.strip()
        return f"; log tail:\n{text}" if text else ""

    async def _stop_quietly(self, replica: Replica) -> None:
        try:
            await self.supervisor.stop_process(replica.fullname)
        except SupervisorError:
            pass

    async def _load_logged(self, name: str) -> None:
        try:
            await self.load(name)
        except Exception as exc:
            log.error("loading %s failed: %s", name, exc)
            # A load refused before it began (e.g. not loadable) left no error on the model: /ready shows it.
            self.models[name].last_error = self.models[name].last_error or str(exc)
        finally:
            self.startup_pending.discard(name)

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


async def probe(http: aiohttp.ClientSession, spec: ProgramSpec | None,
                timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str | None]:
    """Healthy when the health path answers 200 and the server serves the expected model. An
    endpoint (no spec) has nothing to probe between requests: its requests are its health check."""
    if spec is None:
        return True, None
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with http.get(spec.base_url + spec.health_path, timeout=timeout, headers=dict(spec.headers)) as resp:
            if resp.status != 200:
                return False, None  # llama-server answers 503 while it loads
        if spec.models_path:
            async with http.get(spec.base_url + spec.models_path, timeout=timeout, headers=dict(spec.headers)) as resp:
                data = await resp.json(content_type=None)
            ids = {m.get("id") for m in data.get("data", [])} if isinstance(data, dict) else set()
            if spec.served_model not in ids:
                return False, f"port {spec.port} serves {sorted(i for i in ids if i)}, not {spec.served_model!r}"
        return True, None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return False, None
