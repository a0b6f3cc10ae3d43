"""The watcher: keeps every replica's state true while the pool's decisions run.

It polls supervisord's process table (every supervisor.poll_interval_s, or at once when woken),
so that a crash costs one replica until supervisord has restarted it and it answers again, and an
admin's `supervisorctl stop` is respected and said (a `stopped` event, a later start `started`);
probes a starting replica until its health check (and warm-up) passes; runs the periodic health
checks and outlier ejection of proxy/lifecycle/watch/health.py;
scrapes the engines' load gauges for routing; and takes the data path's reports of how a request
to a replica ended. The pool waits on it for a load's or a scale's replicas to become healthy.
When supervisord stops answering it says so (once, then every DOWN_LOG_INTERVAL_S) and, in managed
mode, starts a supervisord that died again, with the replicas it ran.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Mapping

import aiohttp

from launchers.spec import EngineMetrics, ProgramSpec
from proxy import events as ev
from proxy.config.settings import LOCAL_HOST, Settings
from proxy.events import Events
from proxy.lifecycle.watch import crashes
from proxy.upstream.engine_metrics import read_gauges
from proxy.lifecycle.watch.health import (HealthPolicy, ReadyChecks, note_exit, note_failure, note_success,
                                    state_after_check)
from proxy.lifecycle.kinds.process_table import live, process_key
from proxy.lifecycle.kvcache.keeper import KvKeeper
from proxy.lifecycle.kinds.programs import Programs, start_replica
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.lifecycle.state.wake import Wake
from proxy.upstream.client import UpstreamHttp
from proxy.lifecycle.watch.warmup import warm_up
from proxy.supervisord.managed import ManagedSupervisord
from proxy.supervisord.supervisor import ProcessInfo, ProcessState, SupervisorClient, SupervisorError

log = logging.getLogger(__name__)

METRICS_INTERVAL_S = 0.5
# supervisord not answering: logged when it starts, then this often while it lasts.
DOWN_LOG_INTERVAL_S = 60.0
# A managed supervisord that died is started again at most this often (should starting it fail).
REVIVE_INTERVAL_S = 5.0
EXITED_STATES = (ProcessState.BACKOFF, ProcessState.EXITED, ProcessState.FATAL)
DOWN_STATES = (ProcessState.STOPPED, ProcessState.STOPPING)
# How often a starting replica is checked (see Monitor._probe).
STARTUP_PROBE_S = 0.02
PROBE_TIMEOUT_S = 2.0


@dataclass
class SupervisordDown:
    """supervisord stopped answering at `since` (monotonic); last logged at `logged_at`."""

    since: float
    error: str
    logged_at: float


class Monitor:
    """One per pool; the event loop is its only writer, like the pool's."""

    def __init__(self, settings: Settings, supervisor: SupervisorClient, http: UpstreamHttp,
                 models: Mapping[str, ModelRuntime], programs: Programs, events: Events,
                 managed: ManagedSupervisord | None = None, *, wake: Wake, kv: KvKeeper | None = None) -> None:
        self.settings = settings
        self.events = events          # crashes are recorded there (and logged)
        self.supervisor = supervisor
        self.http = http
        self.models = models
        self.programs = programs
        self.managed = managed        # managed mode: the supervisord to start again should it die
        self.kv = kv                  # restores the slots a replica's predecessor saved, before it serves
        self.health = HealthPolicy.from_settings(settings.service)
        self.checks = ReadyChecks(self.health, lambda spec, timeout_s: probe(self.http, spec, timeout_s), self.events)
        self.down: SupervisordDown | None = None
        self.revivals = 0             # times a dead supervisord was started again
        self._revive_at = 0.0
        self._woken = wake             # the pool's, shared with the programs that start processes
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="llm-pool monitor")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def wake(self) -> None:
        """Look at supervisord again now (a program was started, a connection was refused)."""
        self._woken()

    async def await_replicas(self, runtime: ModelRuntime, replicas: list[Replica] | None = None) -> None:
        # Endpoints are judged inside their kind's start; only programs take time to become healthy.
        replicas = runtime.replicas if replicas is None else replicas
        deadline = time.monotonic() + max((r.spec.start_timeout_s for r in replicas if r.spec), default=0.0)
        while True:
            # A host that is down may answer again before the start timeout: its replicas wait too.
            starting = [r for r in replicas if r.state in (ReplicaState.STARTING, ReplicaState.HOST_UNREACHABLE)]
            if not starting:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                for replica in starting:
                    tail = await self._log_tail(replica)
                    last = f" (last: {replica.last_error})" if replica.last_error else ""
                    limit = replica.spec.start_timeout_s if replica.spec else 0.0
                    runtime.set_replica_state(replica, ReplicaState.FAILED,
                                              f"not healthy within {limit:.0f}s{last}{tail}")
                return
            await runtime.wait_changed(min(left, 1.0))

    def report_connection_failure(self, replica: Replica, error: str) -> None:
        """A refused connection on the data path (the request never reached the replica): its
        process is gone or restarting, so stop routing to it at once; its health check brings it back."""
        runtime = self.models[replica.model]
        note_exit(replica)
        if replica.state in (ReplicaState.READY, ReplicaState.UNHEALTHY):
            runtime.set_replica_state(replica, ReplicaState.STARTING, error)
            self.wake()

    def report_outcome(self, replica: Replica, error: str | None = None) -> None:
        """How a request sent to `replica` ended: None when it answered, else why it failed (a 5xx,
        a timeout, a broken connection). Failures in a row eject it (proxy/lifecycle/watch/health.py); a single
        failure never takes it out of rotation by itself."""
        if error is None:
            note_success(replica)
            return
        runtime = self.models.get(replica.model)
        if runtime is not None and replica in runtime.replicas:
            note_failure(runtime, replica, error, self.health, events=self.events)

    def supervisord_status(self) -> dict[str, object]:
        """For /health and the admin view: whether supervisord answers, and if not for how long and why."""
        down = self.down
        return {"answering": down is None,
                "down_for_s": None if down is None else round(time.monotonic() - down.since, 1),
                "error": None if down is None else down.error, "restarts": self.revivals}

    async def _loop(self) -> None:
        interval = self.settings.supervisor.poll_interval_s
        while True:
            try:
                await self._pass()
            except SupervisorError as exc:
                log.warning("monitor: %s", exc)
            except Exception:
                log.exception("monitor iteration failed")
            self._woken.clear()
            await self._woken.wait(interval)

    async def _pass(self) -> None:
        try:
            # Other hosts get one poll interval to answer: a frozen one is judged on its own clock
            # (its call's rpc_timeout_s) while the rest are watched as often as ever.
            processes = await self.programs.snapshot(patience_s=self.settings.supervisor.poll_interval_s)
        except SupervisorError as exc:
            await self._not_answering(exc)
            # No process table: what runs keeps serving, and its health checks go on.
            for runtime in self.models.values():
                if runtime.state == ModelState.LOADED:
                    for replica in runtime.replicas:
                        self.checks.maybe_check(runtime, replica)
                        self.checks.maybe_recheck(runtime, replica)
            return
        self._answering()
        down = self.programs.down_hosts()
        for runtime in self.models.values():
            if runtime.state in (ModelState.LOADING, ModelState.LOADED):
                for replica in runtime.replicas:
                    if replica.host in down:
                        self._host_down(runtime, replica)
                        continue
                    if replica.state == ReplicaState.HOST_UNREACHABLE:
                        await self._host_back(runtime, replica, processes.get(process_key(replica.host,
                                                                                          replica.fullname)))
                    if replica.spec is None:
                        # An endpoint: no program for supervisord to judge, no health path
                        # to probe. An ejected one comes back once its ejection is over;
                        # failing again ejects it again, for longer.
                        self.checks.maybe_recheck(runtime, replica)
                        continue
                    # A replica whose state changed while its host's table was being read (a load
                    # just started it) is judged on the next, fresher table.
                    host = self.programs.hosts.get(replica.host)
                    if host is not None and replica.state_since <= host.table_at:
                        await self.observe(runtime, replica, processes.get(process_key(replica.host,
                                                                                       replica.fullname)))
                    self._maybe_scrape(replica)
                    self.checks.maybe_check(runtime, replica)

    def _host_down(self, runtime: ModelRuntime, replica: Replica) -> None:
        """Its host's supervisord does not answer: a replica that served or was starting goes
        HOST_UNREACHABLE, out of rotation (its process may serve on, but nothing here can see or
        stop it); the host's return decides (_host_back). One that was STOPPED or FAILED stays so:
        nothing was expected of it, and the host's return is judged against that state."""
        if replica.state == ReplicaState.HOST_UNREACHABLE:
            return
        error = f"host {replica.host} is not answering: {self.programs.hosts[replica.host].error}"
        if replica.state in (ReplicaState.READY, ReplicaState.UNHEALTHY, ReplicaState.STARTING):
            replica.cancel_tasks()
            runtime.set_replica_state(replica, ReplicaState.HOST_UNREACHABLE, error)

    async def _host_back(self, runtime: ModelRuntime, replica: Replica, info: ProcessInfo | None) -> None:
        """Its host answers again. A process that ran on (the same PID) is adopted: the next pass
        probes it back to READY. One that is gone (the host's supervisord was restarted) is started
        again from its program file, which the node kept."""
        if info is not None and info.pid and info.pid == replica.pid and live(info):
            log.info("model %s replica %d: host %s is back, adopting pid %d", runtime.name, replica.index,
                     replica.host, info.pid)
            runtime.set_replica_state(replica, ReplicaState.STARTING, f"host {replica.host} came back")
            return
        if info is None:
            runtime.set_replica_state(replica, ReplicaState.FAILED, f"host {replica.host} is back without its "
                                                                    "program")
            return
        log.info("model %s replica %d: host %s is back without its process; starting it again", runtime.name,
                 replica.index, replica.host)
        if replica.alive:
            replica.restarts += 1
        replica.pid, replica.alive = 0, False
        runtime.set_replica_state(replica, ReplicaState.STARTING, f"host {replica.host} came back")
        if info.state not in (ProcessState.STARTING, ProcessState.RUNNING):
            try:
                await start_replica(self.programs.hosts[replica.host].client, replica)
            except SupervisorError as exc:
                runtime.set_replica_state(replica, ReplicaState.FAILED, f"not started again on host "
                                                                        f"{replica.host}: {exc}")
        self.wake()

    async def _not_answering(self, exc: SupervisorError) -> None:
        """Log once, then every DOWN_LOG_INTERVAL_S; in managed mode, start a dead supervisord again."""
        now = time.monotonic()
        if self.down is None:
            self.down = SupervisordDown(since=now, error=str(exc), logged_at=now)
            log.warning("supervisord is not answering: %s; what runs keeps serving%s", exc,
                        ", and it is started again if it died" if self.managed is not None else "")
        else:
            self.down.error = str(exc)
            if now - self.down.logged_at >= DOWN_LOG_INTERVAL_S:
                self.down.logged_at = now
                log.warning("supervisord still not answering after %.0fs: %s", now - self.down.since, exc)
        if self.managed is not None and now >= self._revive_at and self.managed.dead():
            self._revive_at = now + REVIVE_INTERVAL_S
            await self._start_supervisord_again()

    def _answering(self) -> None:
        if self.down is not None:
            log.warning("supervisord answers again after %.1fs", time.monotonic() - self.down.since)
            self.down = None

    async def _start_supervisord_again(self) -> None:
        """supervisord died: its programs run on, unknown to any supervisord. They are stopped by
        their recorded PIDs and a new supervisord is started (managed.ensure_supervisord), then
        every replica that was serving or starting is started again: out of rotation meanwhile, its
        model degraded, READY again once its health check passes. A replica an admin had stopped
        stays stopped."""
        assert self.managed is not None
        again: list[tuple[ModelRuntime, Replica]] = []
        for runtime in self.models.values():
            if runtime.state not in (ModelState.LOADING, ModelState.LOADED):
                continue
            for replica in runtime.replicas:
                if replica.spec is None or replica.state not in (ReplicaState.READY, ReplicaState.UNHEALTHY,
                                                                 ReplicaState.STARTING):
                    continue
                replica.cancel_tasks()
                if replica.alive:
                    replica.restarts += 1
                replica.pid, replica.alive = 0, False   # its process is an orphan, stopped below
                runtime.set_replica_state(replica, ReplicaState.STARTING, "supervisord died; starting it again")
                again.append((runtime, replica))
        log.warning("supervisord died: stopping what it left running, starting it again and %d replica(s)",
                    len(again))
        try:
            await self.managed.start_again()
        except SupervisorError as exc:
            log.error("could not start supervisord again (next try in %.0fs): %s", REVIVE_INTERVAL_S, exc)
            return
        self.revivals += 1
        for runtime, replica in again:
            try:
                await start_replica(self.supervisor, replica)
            except SupervisorError as exc:
                runtime.set_replica_state(replica, ReplicaState.FAILED, f"not started again after supervisord "
                                                                        f"died: {exc}")
        self.wake()

    async def observe(self, runtime: ModelRuntime, replica: Replica, info: ProcessInfo | None) -> None:
        state = replica.state
        if state in (ReplicaState.STOPPING,):
            return
        if state in (ReplicaState.STOPPED, ReplicaState.FAILED) and runtime.state != ModelState.LOADED:
            # Not started yet by the load in progress (or given up): a process under its name is an
            # old one the load is replacing (a reload after a settings change), not its own, and
            # taking its pid would make the new process look like a restart, to be stopped.
            return
        if info is None:
            replica.alive = False
            if state != ReplicaState.STOPPED:
                runtime.set_replica_state(replica, ReplicaState.STOPPED, "program no longer known to supervisord")
            return
        was_alive = replica.alive
        asked = False   # a restart in supervisord (supervisorctl restart) seen only by its new pid
        # A process after the one an admin stopped is a start, not a restart (nor a failure, nor a crash).
        pid_changed = bool(replica.pid) and info.pid not in (0, replica.pid) and replica.pid != replica.stopped_pid
        if replica.pid and replica.pid not in (replica.crashed_pid, replica.stopped_pid) and \
                (pid_changed or info.state in EXITED_STATES):
            # Its process ended and nobody here asked (a stop by the pool is STOPPING, returned above;
            # an admin's supervisorctl stop is STOPPING then STOPPED, no exit): said once per process.
            replica.crashed_pid = replica.pid
            asked = await self._ended(replica, info, pid_changed)
        # A replica is checked from the moment its process exists, so it can be READY while
        # supervisord still says STARTING (its startsecs): that is the same process, running.
        process_state = ProcessState.RUNNING if (
            info.state == ProcessState.STARTING and state in (ReplicaState.READY, ReplicaState.UNHEALTHY)
            and not pid_changed and info.pid == replica.pid) else info.state
        info = replace(info, state=process_state)
        if not asked and (pid_changed or (state in (ReplicaState.READY, ReplicaState.UNHEALTHY) and
                                          info.state in EXITED_STATES + (ProcessState.STARTING,))):
            note_exit(replica)  # a process that keeps crashing is ejected like one that keeps failing
        if pid_changed and not asked:
            replica.restarts += 1
        if info.pid:
            replica.pid = info.pid
        replica.alive = info.pid != 0
        if info.state == ProcessState.FATAL and state in (ReplicaState.READY, ReplicaState.STARTING,
                                                          ReplicaState.UNHEALTHY):
            tail = await self._log_tail(replica)
            runtime.set_replica_state(replica, ReplicaState.FAILED, "supervisord gave up restarting it" + tail)
            return
        if state in (ReplicaState.READY, ReplicaState.UNHEALTHY):
            if info.state in DOWN_STATES:
                # An admin's `supervisorctl stop`: respected, never undone by the pool.
                self._stopped(runtime, replica)
            elif info.state != ProcessState.RUNNING or pid_changed:
                runtime.set_replica_state(replica, ReplicaState.STARTING, "restarted in supervisord" if asked else
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
                self._stopped(runtime, replica)
                return
            # From the moment the process exists, not from supervisord's RUNNING: that comes only
            # after startsecs, and an engine that is healthy sooner would wait for it.
            if info.state in (ProcessState.STARTING, ProcessState.RUNNING) and info.pid and replica.spec is not None:
                if replica.probe is None or replica.probe.done():
                    replica.probe = asyncio.create_task(self._probe(runtime, replica, replica.spec, info.pid))
            return
        # STOPPED or FAILED: an admin may bring the process back with supervisorctl start.
        if runtime.state == ModelState.LOADED and info.state in (ProcessState.STARTING, ProcessState.RUNNING):
            if replica.stopped_pid or not was_alive:
                # Not a FAILED replica whose process runs on (unhealthy): that one is only checked again.
                replica.stopped_pid = 0
                self._say_started(replica, info.pid)
            runtime.set_replica_state(replica, ReplicaState.STARTING)
            self.wake()

    def _stopped(self, runtime: ModelRuntime, replica: Replica) -> None:
        """supervisord says STOPPING or STOPPED of a replica the pool did not stop: someone asked it
        (supervisorctl stop, or its XML-RPC), and the process ends because it was asked. Said now,
        and its end is never a crash, nor what supervisord starts next a restart."""
        replica.stopped_pid = replica.pid
        runtime.set_replica_state(replica, ReplicaState.STOPPED, "stopped in supervisord")
        self._say_stopped(replica, "out of rotation until it is started there again")

    def _say_stopped(self, replica: Replica, after: str) -> None:
        self.events.record(ev.STOPPED, f"model {replica.model} replica {replica.index} (pid {replica.pid}"
                           f"{self._on(replica)}) was stopped in supervisord, not by the pool: {after}",
                           model=replica.model, replica=replica.index, host=replica.host, level=logging.WARNING)

    def _say_started(self, replica: Replica, pid: int) -> None:
        self.events.record(ev.STARTED, f"model {replica.model} replica {replica.index}{self._on(replica)} was "
                           f"started in supervisord (pid {pid}): back in rotation once its health check passes",
                           model=replica.model, replica=replica.index, host=replica.host)

    @staticmethod
    def _on(replica: Replica) -> str:
        return f" on host {replica.host}" if replica.host != LOCAL_HOST else ""

    async def _probe(self, runtime: ModelRuntime, replica: Replica, spec: ProgramSpec, pid: int) -> None:
        """Check a starting replica until it is healthy or leaves STARTING (its process exits, the
        start times out): every STARTUP_PROBE_S, since an engine gives no other sign that it is
        ready, and each interval is time a request waiting for a cold model waits for nothing."""
        while True:
            ok, error = await probe(self.http, spec)
            if replica.state != ReplicaState.STARTING or replica.pid != pid:
                return
            if ok:
                await self._started(runtime, replica, spec, pid)
                return
            if error:
                replica.last_error = error
            await asyncio.sleep(STARTUP_PROBE_S)

    async def _started(self, runtime: ModelRuntime, replica: Replica, spec: ProgramSpec, pid: int) -> None:
        after = state_after_check(runtime, replica, self.health, events=self.events)
        if after == ReplicaState.READY and runtime.model.get("warmup"):
            # READY only once one generation went through; a failure is retried like a failed check.
            seconds, error = await warm_up(self.http, replica, spec.start_timeout_s)
            if replica.state != ReplicaState.STARTING or replica.pid != pid:
                return
            if seconds is None:
                replica.probe_failures += 1
                replica.last_error = error
                log.warning("model %s replica %d: %s", replica.model, replica.index, error)
                return
            replica.warmup_s = seconds
            log.info("model %s replica %d warmed up in %.3fs", replica.model, replica.index, seconds)
        if after == ReplicaState.READY and self.kv is not None:
            # After the warm-up, whose request takes a slot of its own: the restored ones stay whole.
            await self.kv.restore(runtime, replica, self.settings.lifecycle.swap_max_wait_s)
            if replica.state != ReplicaState.STARTING or replica.pid != pid:
                return
        runtime.set_replica_state(replica, after)
        if after == ReplicaState.READY:
            replica.last_error = None

    def _maybe_scrape(self, replica: Replica) -> None:
        """Refresh the backend's load gauges in the background, at most every METRICS_INTERVAL_S."""
        spec = replica.spec
        if replica.state != ReplicaState.READY or spec is None or spec.metrics is None:
            return
        if replica.scrape is not None and (not replica.scrape.done() or
                                           time.monotonic() - replica.scraped_at < METRICS_INTERVAL_S):
            return
        replica.scrape = asyncio.create_task(self._scrape(replica, spec, spec.metrics))

    async def _scrape(self, replica: Replica, spec: ProgramSpec, metrics: EngineMetrics) -> None:
        ours = replica.inflight
        try:
            async with self.http.get(replica.reach.url("/metrics"), headers=dict(spec.headers),
                                     timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError):
            text = ""
        replica.scraped_at = time.monotonic()
        if replica.state == ReplicaState.READY:  # it may have left READY while the scrape was in flight
            replica.reported = read_gauges(text, metrics) if text else {}
            replica.inflight_at_scrape = max(ours, replica.inflight)

    async def _ended(self, replica: Replica, info: ProcessInfo, replaced: bool) -> bool:
        """The replica's process ended and the pool did not ask: a crash, said with how it ended.
        Or, when another process replaced it and supervisord's log says it was asked to stop, a
        `supervisorctl restart` between two looks at its table: a stop and a start, and True."""
        client = self.programs.host_of(replica).client
        try:
            main_log = await client.main_log_tail(crashes.MAIN_LOG_TAIL)
        except SupervisorError:
            main_log = ""   # no log file (syslog), or the host just stopped answering
        program = replica.spec.program if replica.spec is not None else replica.fullname
        if replaced and crashes.asked_to_stop(program, main_log):
            self._say_stopped(replica, "started again at once (a restart)")
            self._say_started(replica, info.pid)
            return True
        crash = crashes.describe(program, info, replaced, main_log)
        self.events.record(ev.CRASH, crash.sentence(f"model {replica.model} replica {replica.index} "
                                                        f"(pid {replica.pid}{self._on(replica)})"),
                           model=replica.model, replica=replica.index, host=replica.host, reason=crash.how,
                           level=logging.WARNING)
        return False

    async def _log_tail(self, replica: Replica, length: int = 2000) -> str:
        try:
            text = await self.programs.host_of(replica).client.tail_log(replica.fullname, length)
        except SupervisorError:
            return ""
        text = text.strip()
        return f"; log tail:\n{text}" if text else ""

    async def _stop_quietly(self, replica: Replica) -> None:
        try:
            await self.programs.host_of(replica).client.stop_process(replica.fullname)
        except SupervisorError:
            pass


async def probe(http: UpstreamHttp, spec: ProgramSpec | None,
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
