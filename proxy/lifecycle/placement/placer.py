"""The pool's hand for placement: it turns the models' state into placement's picture, and carries
out what placement decides (proxy/lifecycle/placement/rules.py, where the rules are).

- Load on demand: a request for a cold model with `load_on_demand` waits in the model's own
  fairness queue (admission.py), and placement plans one load for all of its waiters, with what it
  must evict first. A failed load fails every waiter with its error and backs the model off
  (doubling, as startup retries do): until then requests get that error at once, after it the next
  request tries again.
- Admin and startup loads pass the same admission at once: they make room by evicting idle models,
  or are refused (409 `model_too_large`, 503 `insufficient_memory`); they never wait.
- Idle unloads and evictions drain the model (what runs finishes) and keep its waiters queued.
- After each load the replicas' footprints are measured and recorded (footprints.py). What a
  model is charged while it holds memory is fixed when its load is admitted (Memory.per_replica:
  the higher of its estimate and its measured history): a measurement feeds the next load's charge
  and never evicts anything by itself. A charge that moved with each measurement made two models
  evict each other in turn as their figures swung (issue 29).
- Sleep instead of stop (vllm_sleep_on_evict, proxy/lifecycle/sleeping.py): an eviction may put
  a model to sleep when its replicas can and its host RAM has room for its weights (`may_sleep`).
  Asleep, its GPU charge is dropped and its weights are charged to the CPU budget instead, fixed
  when it fell asleep (`fell_asleep`); its wake is a load, admitted and charged afresh.
- Usage times (each model's last use) are kept in the state directory, so that a restarted proxy
  that adopts a model does not count its idle time from zero (usage.py).

Every side effect of a decision (a load, an unload, a task that runs on) goes through the actions
the placer is handed at construction (actions.py: the pool implements them), and the time it
reads comes from its clock: the placer's unit tests give it a recording fake and a clock of their own.

Placement is planned again whenever something it depends on changes: a request waits for a model
that is not loaded, a queue goes idle while a load waits for room, a load or unload ends, and at the
next deadline placement names (an idle timeout, a swap bound).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any, Callable, Mapping

from proxy.config.model import ModelConfig
from proxy.config.settings import LOCAL_HOST, Settings
from proxy import events as ev
from proxy.errors import BackendError, Conflict, PoolError, Unavailable
from proxy.events import Events
from proxy.gpu.footprint import tree_cpu_bytes, tree_gpu_bytes
from proxy.gpu.report import load_nvml
from proxy.lifecycle.placement import placer_view
from proxy.lifecycle.placement.actions import Clock, PlacerActions, SystemClock
from proxy.lifecycle.placement.load_retry import retry_delay, worth_retrying
from proxy.lifecycle.placement.memory import CPU, Memory, qualify
from proxy.lifecycle.placement.rules import HOLDING, Limits, ModelView, Shortfall, Status, plan, room_for, spread
from proxy.lifecycle.placement.usage import UsageTimes
from proxy.lifecycle.placement.working_set import WorkingSet
from proxy.lifecycle.state.replicas import ModelState, ReplicaState
from proxy.lifecycle.state.runtime import Backoff, ModelRuntime
from proxy.lifecycle.state.wake import Wake
from proxy.supervisord.hosts import Host
from proxy.supervisord.supervisor import SupervisorError

log = logging.getLogger(__name__)

_STATUS: dict[ModelState, Status] = {ModelState.UNLOADED: "cold", ModelState.LOADING: "loading",
                                     ModelState.LOADED: "loaded", ModelState.UNLOADING: "unloading",
                                     ModelState.ASLEEP: "asleep"}


class Placer:
    def __init__(self, settings: Settings, models: Mapping[str, ModelRuntime], memory: Memory,
                 actions: PlacerActions, nvml_loader: Callable[[], Any] = load_nvml, events: Events | None = None,
                 clock: Clock | None = None) -> None:
        self.settings = settings
        self.events = events if events is not None else Events()
        self.models = models
        self.memory = memory
        self.actions = actions          # how its decisions are carried out: the pool's
        self.nvml_loader = nvml_loader
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.usage = UsageTimes(settings.service.state_dir / "usage.json", models, self.clock)
        # Plan again now: a request waits for a model that is not loaded, a queue went idle, a load
        # or an unload ended. Its loop, started by `start`, is the only one that waits on it.
        self.wake = Wake()
        self._loading: dict[str, ModelConfig] = {}     # loads admitted and not finished, with their settings
        self._evicting: set[str] = set()                # models being unloaded by the pool
        self.waiting: dict[str, Shortfall] = {}         # cold models whose load waits for room
        self._blocked_since: dict[str, float] = {}      # since when (monotonic) each of them waits
        self.pending: list[str] = []                    # on-demand loads in flight, in the order planned
        self._planned: dict[str, tuple[str, ...]] = {}   # the hosts of a cold model's replicas, as last placed
        # What each model that holds memory is charged per replica, by host (unqualified devices):
        # fixed at its admission, dropped once it is cold.
        self._charges: dict[str, dict[str, dict[str, int]]] = {}
        # Charges fixed from an estimate alone, before any measurement of the model's settings
        # there: the first measurement raises them (below, in measure), once.
        self._estimated_only: set[tuple[str, str]] = set()
        # What each asleep model is charged per replica, by host (its weights in host RAM): fixed when
        # it fell asleep, dropped when it wakes or stops. While one is here it is charged this alone.
        self._asleep: dict[str, dict[str, dict[str, int]]] = {}
        # Models that take each other's room in turn, and devices over their budget (working_set.py).
        self.working_set = WorkingSet(settings.lifecycle.thrash_window_s)

    # -- hosts ------------------------------------------------------------------------------------

    def answering_hosts(self, config: ModelConfig) -> list[str]:
        """The hosts the model may run on that answer now, in the configured order."""
        allowed = config.hosts or self.settings.supervisor.host_names
        return [h for h in allowed if h == LOCAL_HOST or
                (h in self.memory.hosts and self.memory.hosts[h].down_since is None and self.memory.hosts[h].devices)]

    def _place(self, config: ModelConfig, holding: list[ModelView], count: int,
               already: tuple[str, ...] = ()) -> tuple[str, ...]:
        hosts = self.answering_hosts(config) or list(config.hosts or self.settings.supervisor.host_names)[:1]
        budgets = self.memory.budgets()
        free = {d: b - sum(m.needs.get(d, 0) for m in holding) for d, b in budgets.items()}
        return spread(count, self.memory.per_replica(config), hosts, free, budgets, qualify, already)

    def hosts_for(self, config: ModelConfig, indices: list[int], held: Mapping[int, str]) -> dict[int, str]:
        """Programs' HostChooser: a replica whose file is on an allowed host that answers stays there
        (adoption); the others go where placement put them, or are placed now (live scaling)."""
        allowed = set(self.answering_hosts(config))
        runtime = self.models[config.name]
        planned = self._planned.get(config.name, ())
        out = {i: held[i] for i in indices if i in held and held[i] in allowed}
        rest = [i for i in indices if i not in out]
        if rest and all(i < len(planned) for i in rest):
            out.update({i: planned[i] for i in rest})
        elif rest:
            holding = [v for v in self.views() if v.status in HOLDING and v.name != config.name]
            already = tuple(r.host for r in runtime.replicas if r.index not in rest) + tuple(out.values())
            out.update(zip(rest, self._place(config, holding, len(rest), already)))
        return out

    # -- the picture ------------------------------------------------------------------------------

    def limits(self) -> Limits:
        life = self.settings.lifecycle
        return Limits(budgets=self.memory.budgets(), max_loaded=life.max_loaded_models,
                      swap_max_wait_s=life.swap_max_wait_s, min_residence_s=life.min_residence_s)

    def charge(self, name: str, config: ModelConfig, hosts: tuple[str, ...]) -> dict[str, int]:
        """What a model that holds memory counts, with replica i on hosts[i], per host-qualified
        device: each replica's figure as it was when the model was admitted (fixed then, or the first
        time a host is counted for it, as for an adopted replica)."""
        out: dict[str, int] = {}
        asleep = self._asleep.get(name)
        if asleep is not None:
            for host in hosts:
                for device, n in asleep.get(host, {}).items():
                    out[qualify(host, device)] = out.get(qualify(host, device), 0) + n
            return out
        fixed = self._charges.setdefault(name, {})
        for host in hosts:
            per_replica = fixed.get(host)
            if per_replica is None:
                per_replica = fixed[host] = self.memory.per_replica(config, host)
                if self.memory.footprints.measured(config, self.memory.placement(config, host).devices) is None:
                    self._estimated_only.add((name, host))
            for device, n in per_replica.items():
                out[qualify(host, device)] = out.get(qualify(host, device), 0) + n
        return out

    def views(self, target: tuple[str, ModelConfig] | None = None) -> list[ModelView]:
        views = self._views(target)
        if not self.settings.supervisor.hosts:
            return views   # one host: every need is on this machine's devices, as it always was
        # Models that hold memory are where their replicas are; a cold one is placed beside them.
        holding = []
        for view in views:
            rt = self.models[view.name]
            if view.status in HOLDING and rt.replicas:
                config = self._loading.get(view.name) or rt.model
                # A replica not yet written anywhere counts here, as every need did before hosts.
                hosts = tuple(r.host for r in rt.replicas) if all(r.spec is not None for r in rt.replicas) \
                    else (LOCAL_HOST,) * config.replicas
                view = replace(view, needs=self.charge(view.name, config, hosts))
            holding.append(view)
        out = []
        for view in holding:
            rt = self.models[view.name]
            if view.counted and not (view.status in HOLDING and rt.replicas):
                config = self._loading.get(view.name) or (target[1] if target and target[0] == view.name else rt.model)
                if view.name in self._loading and view.name in self._planned:
                    hosts = self._planned[view.name]
                else:
                    hosts = self._place(config, [v for v in holding if v.status in HOLDING and v.name != view.name],
                                        config.replicas)
                    self._planned[view.name] = hosts
                view = replace(view, needs=self.charge(view.name, config, hosts) if view.status in HOLDING
                               else self.memory.need_on(config, hosts))
            out.append(view)
        return out

    def _views(self, target: tuple[str, ModelConfig] | None = None) -> list[ModelView]:
        now, mono = self.clock.time(), self.clock.monotonic()
        out = []
        for name, rt in self.models.items():
            status: Status = _STATUS.get(rt.state, "cold")
            if rt.state == ModelState.FAILED and rt.replicas:
                status = "unloading"        # an unload that did not finish: its processes may hold memory
            if name in self._loading:
                status = "loading"
            elif name in self._evicting and status == "loaded":
                status = "unloading"
            config = self._loading.get(name) or (target[1] if target and target[0] == name else rt.model)
            if status not in HOLDING:
                self._drop_charge(name)   # cold: its next admission fixes its next charge
                needs = self.memory.need(config).per_device
            elif self.settings.supervisor.hosts:
                needs = {}   # views() charges it on the hosts its replicas are on
            else:
                needs = self.charge(name, config, (LOCAL_HOST,) * config.replicas)
            waiting = rt.admission.waiting
            backing_off = rt.backoff is not None and rt.backoff.until > now
            asleep = status == "asleep"
            out.append(ModelView(
                name=name, status=status, needs=needs, pinned=rt.config.pinned,
                running=rt.admission.active, waiting=waiting,
                waited_s=rt.admission.oldest_wait_s() if waiting else 0.0,
                blocked_s=mono - self._blocked_since[name] if name in self._blocked_since else 0.0,
                resident_s=mono - rt.loaded_at if rt.state in (ModelState.LOADED, ModelState.ASLEEP) else 0.0,
                last_used=rt.last_used, reload_s=rt.load_s, idle_unload_s=rt.config.idle_unload_s,
                wants_load=status in ("cold", "asleep") and waiting > 0 and rt.config.load_on_demand
                and not backing_off and rt.kind is not None,
                # Asleep it holds no GPU and serves nothing: not a loaded model for max_loaded_models.
                counted=bool(self.memory.placement(config).devices) and not asleep,
                wake_needs=self.memory.need(config).per_device if asleep else None))
        return out

    # -- admission of a load ----------------------------------------------------------------------

    def admit(self, runtime: ModelRuntime, config: ModelConfig, may_evict: bool = True) -> tuple[str, ...]:
        """An admin or startup load: the models to evict first, or the refusal. Reserves its room.
        A load at startup evicts nothing (`may_evict`): the enabled models would evict each other."""
        room = room_for(runtime.name, self.views((runtime.name, config)), self.limits(), self.clock.time(),
                        may_evict=may_evict)
        if room.too_large is not None:
            raise too_large(runtime.name, room.too_large)
        if room.blocked is not None:
            raise insufficient(runtime.name, room.blocked)
        self.reserve(runtime.name, config)
        return room.evict

    def room_free(self, runtime: ModelRuntime) -> bool:
        """Whether the model would load now without evicting any other: the one load a batch's line
        may bring about (a batch never takes a model's room from its users: docs/batches.md)."""
        room = room_for(runtime.name, self.views((runtime.name, runtime.model)), self.limits(), self.clock.time(),
                        may_evict=False)
        return room.too_large is None and room.blocked is None and not room.evict

    def reserve(self, name: str, config: ModelConfig) -> None:
        """Hold room for an admitted load of `config`, charged what it is admitted by now."""
        self._drop_charge(name)
        self._loading[name] = config
        # Fixed now, on the hosts it was placed on (another host its replicas land on is fixed the
        # first time it is counted there).
        self.charge(name, config, self._planned.get(name) or (LOCAL_HOST,) * config.replicas)

    def _drop_charge(self, name: str) -> None:
        self._charges.pop(name, None)
        self._asleep.pop(name, None)
        self._estimated_only = {k for k in self._estimated_only if k[0] != name}

    def first_measured(self, name: str, config: ModelConfig, host: str) -> None:
        """A measurement of `name` on `host` was recorded: a charge fixed from the estimate alone
        takes it where it is higher, once. An estimate can miss most of what runs (a model id with
        no local files, a shim's own process), and charged that until its next load the model would
        leave room it does not have; later measurements only feed the next load's charge, and none
        evicts anything by itself."""
        if (name, host) not in self._estimated_only:
            return
        self._estimated_only.discard((name, host))
        fixed = self._charges.get(name, {})
        if host in fixed:
            now = self.memory.per_replica(config, host)
            fixed[host] = {d: max(b, now.get(d, 0)) for d, b in fixed[host].items()}

    def settled(self, name: str) -> None:
        """A load admitted here ended (loaded or failed): its room is what its state says now."""
        self._loading.pop(name, None)
        self.wake()

    def demand(self, runtime: ModelRuntime) -> None:
        """A request for a model that is not loaded and loads on demand: raise what refuses it now
        (its back-off, a model that can never fit), else let it queue."""
        backoff = runtime.backoff
        now = self.clock.time()
        if backoff is not None and backoff.until > now:
            error = backoff.error
            if not worth_retrying(error):
                # A setting stops it (a missing file, a refused value): no wait helps, so no
                # Retry-After. A request after the back-off still tries again: a file may be put back.
                raise type(error)(f"{error.message} (a setting to change, not a wait: `llm-pool check-config` "
                                  "names it)", code=error.code)
            raise type(error)(f"{error.message}; the next load is tried in {backoff.left_s(now):.0f}s",
                              code=error.code, retry_after=max(1.0, backoff.left_s(now)))
        room = room_for(runtime.name, self.views(), self.limits(), now, may_evict_busy=True)
        if room.too_large is not None:
            raise too_large(runtime.name, room.too_large)
        # Queue, never reopen: a model being evicted holds its queue until its next load, and a
        # slot granted now would keep it from ever draining.
        runtime.admission.accept()

    # -- the plan, carried out ------------------------------------------------------------------

    def start(self) -> "asyncio.Task[None]":
        self.usage.restore()
        for runtime in self.models.values():
            runtime.admission.listen(on_queued=self._queued_hook(runtime), on_idle=self._idle_hook(runtime))
        return asyncio.create_task(self._loop())

    def _queued_hook(self, runtime: ModelRuntime) -> Callable[[], None]:
        def queued() -> None:
            if runtime.state != ModelState.LOADED:
                self.wake()
        return queued

    def _idle_hook(self, runtime: ModelRuntime) -> Callable[[], None]:
        # Only what placement waits for: room held by a busy model, or an idle deadline to start.
        def idle() -> None:
            if self.waiting or runtime.config.idle_unload_s is not None:
                self.wake()
        return idle

    async def _loop(self) -> None:
        while True:
            self.wake.clear()
            try:
                wake_in = self._plan_once()
            except Exception:   # a bug here must not stop loads on demand for good
                log.exception("placement failed; planning again in 1s")
                wake_in = 1.0
            self.usage.save(force=False)
            await self.wake.wait(wake_in if wake_in is None else max(0.0, wake_in) + 0.01)

    def _plan_once(self) -> float | None:
        views, limits, now = self.views(), self.limits(), self.clock.time()
        decided = plan(views, limits, now)
        # A reload's predecessor may still be finishing requests on any model, unseen here: until it
        # has exited nothing is unloaded (idle, or evicted for a load); loads that need no room go on.
        settled = self.actions.predecessor_gone.is_set()
        for name in decided.idle_unloads if settled else ():
            self._evicting.add(name)
            log.info("model %s: idle for %gs (idle_unload_s), unloading it", name,
                     self.models[name].config.idle_unload_s)
            self.actions.spawn(self._unload(name, "idle", f"{self.models[name].config.idle_unload_s:g}s"))
        for name, evict in decided.loads:
            if evict and not settled:
                continue
            if evict:
                # While what it evicts drains, its waiters wait for room: a wait that runs out says so.
                short = room_for(name, views, limits, now, may_evict=False).blocked
                self.models[name].admission.set_stall(insufficient(name, short, evict) if short else None)
            self.reserve(name, self.models[name].config)
            self._evicting.update(evict)
            self.pending.append(name)
            log.info("model %s: loading on demand%s", name, f", evicting {', '.join(evict)}" if evict else "")
            self.actions.spawn(self._load_on_demand(name, evict))
        self.waiting = decided.waiting
        mono = self.clock.monotonic()
        self._blocked_since = {n: self._blocked_since.get(n, mono) for n in decided.waiting}
        for name, runtime in self.models.items():
            if name in self._loading:
                continue   # its stall (evictions draining) is its load's to clear
            short = decided.waiting.get(name)
            runtime.admission.set_stall(insufficient(name, short) if short is not None else None)
        for name, short in decided.too_large.items():
            self.models[name].admission.close(too_large(name, short))
        if not self._loading and not self._evicting and not self.pending:
            # Only once nothing is in flight: a swap holds the old model's room and the new one's together.
            for overrun in self.working_set.over_budget(views, limits.budgets):
                self.events.record(ev.OVER_BUDGET, overrun.sentence(), level=logging.WARNING)
        if not settled:   # plan again soon: the predecessor's exit wakes nothing here
            return 1.0 if decided.wake_in_s is None else min(decided.wake_in_s, 1.0)
        return decided.wake_in_s

    async def _load_on_demand(self, name: str, evict: tuple[str, ...]) -> None:
        runtime = self.models[name]
        try:
            await self.actions.load_placed(name, evict)
        except Exception as exc:
            error = exc if isinstance(exc, PoolError) else BackendError(str(exc), code="model_load_failed")
            if error.status >= 500:
                reason = runtime.last_error or error.message
                error = BackendError(f"model {name!r} failed to load: {reason}", code="model_load_failed")
            attempts = runtime.backoff.attempts + 1 if runtime.backoff is not None else 1
            delay = retry_delay(self.settings.service, attempts)
            runtime.backoff = Backoff(attempts, self.clock.time() + delay, error)
            error.retry_after = delay if worth_retrying(error) else None
            runtime.admission.close(error)
            log.error("model %s: on-demand load failed (%d in a row): %s; next try after %gs", name, attempts,
                      error.message, delay)
        else:
            runtime.backoff = None
        finally:
            if name in self.pending:
                self.pending.remove(name)
            self.settled(name)

    async def make_room(self, runtime: ModelRuntime, evict: tuple[str, ...]) -> None:
        """Unload `evict` (drained, their waiters kept) so that `runtime`'s load fits."""
        self._evicting.update(evict)
        self._say_thrash(runtime.name, evict)
        for name in evict:
            self.events.record(ev.EVICT, f"model {name} is evicted to make room for {runtime.name}", model=name,
                               reason="evicted", cause=runtime.name)
        try:
            results = await asyncio.gather(*(self._unload(name, "evicted", runtime.name) for name in evict),
                                           return_exceptions=True)
        finally:
            runtime.admission.set_stall(None)   # from here on it loads: a wait that runs out is queue_timeout
        failed = [f"{name}: {r}" for name, r in zip(evict, results) if isinstance(r, BaseException)]
        if failed:
            raise Unavailable("could not make room: " + "; ".join(failed), code="insufficient_memory", retry_after=5)

    def _say_thrash(self, name: str, evict: tuple[str, ...]) -> None:
        mono = self.clock.monotonic()
        said = self.working_set.swap(name, evict, self.views(), self.limits(), self.clock.time(), mono)
        if said is not None:
            self.events.record(ev.THRASH, said.sentence(self.working_set.window_s), model=name,
                               cause=", ".join(evict), level=logging.WARNING)
        for evicted in evict:
            self.working_set.evicted(evicted, mono)

    async def _unload(self, name: str, reason: str, cause: str) -> None:
        try:
            await self.actions.unload_by_pool(name, reason, cause)
        except Conflict:
            # No longer loaded (another unload got there first): once that one has ended, its
            # memory is free. An unload holds the model's lock until its processes are gone.
            async with self.models[name].lock:
                pass
        except Exception as exc:
            log.error("model %s: %s unload failed: %s", name, reason, exc)
            raise
        finally:
            self._evicting.discard(name)
            self.wake()

    # -- sleep instead of stop -------------------------------------------------------------------

    def may_sleep(self, runtime: ModelRuntime) -> dict[str, dict[str, int]] | None:
        """What `runtime` would be charged asleep, per replica by host, if an eviction may put it to
        sleep now; None when it must stop: a replica that cannot sleep (its server was not started
        with sleep mode) or is not READY, a model that runs on the CPU anyway (sleep frees only a
        GPU), or host RAM without room for its weights beside what the CPU budget holds now."""
        replicas = runtime.replicas
        if not replicas or any(r.spec is None or r.spec.sleep is None or r.state != ReplicaState.READY
                               for r in replicas):
            return None
        config = runtime.model
        per_host: dict[str, dict[str, int]] = {}
        for host in {r.host for r in replicas}:
            devices = self.memory.placement(config, host).devices
            if not devices or devices == (CPU,):
                return None
            weights = self.memory.estimate(config, devices).weights_bytes
            # Weights not known from local files (a Hugging Face id): what it holds on its GPUs,
            # which is more than its weights, never less.
            per_host[host] = {CPU: weights or sum(self._charges.get(runtime.name, {}).get(host, {}).values())}
        budgets = self.memory.budgets()
        holding = [v for v in self.views() if v.status in HOLDING and v.name != runtime.name]
        need: dict[str, int] = {}
        for replica in replicas:
            for device, n in per_host[replica.host].items():
                need[qualify(replica.host, device)] = need.get(qualify(replica.host, device), 0) + n
        for device, n in need.items():
            if device in budgets and n > budgets[device] - sum(v.needs.get(device, 0) for v in holding):
                log.info("model %s: no room on %s for its weights asleep (%d MiB): stopping it instead",
                         runtime.name, device, n // (1024 * 1024))
                return None
        return per_host

    def fell_asleep(self, name: str, charges: dict[str, dict[str, int]]) -> None:
        """`name` is asleep: charged `charges` (per replica, by host) instead of what it held awake."""
        self._charges.pop(name, None)
        self._estimated_only = {k for k in self._estimated_only if k[0] != name}
        self._asleep[name] = charges
        self.wake()

    # -- footprints -------------------------------------------------------------------------------

    async def measure(self, runtime: ModelRuntime) -> None:
        """Record what each READY replica of `runtime` takes on its device now, measured on its own
        host: this machine's /proc and NVML for a local replica, the node plugin's getFootprint
        (the same walk, on that host) for a replica elsewhere."""
        config = runtime.model
        for replica in runtime.replicas:
            if replica.state != ReplicaState.READY or not replica.pid:
                continue
            devices = self.memory.placement(config, replica.host).devices
            if not devices:
                continue
            node = self.memory.hosts.get(replica.host) if replica.host != LOCAL_HOST else None
            if node is not None:
                sample = await self._measure_on(node, replica.spec.program if replica.spec else "", devices)
            elif devices == (CPU,):
                held = await asyncio.to_thread(tree_cpu_bytes, replica.pid)
                sample = {CPU: held} if held else None
            else:
                sample = await asyncio.to_thread(tree_gpu_bytes, replica.pid, self.nvml_loader)
            if sample:
                self.memory.footprints.record(config, sample)
                self.first_measured(runtime.name, config, replica.host)

    @staticmethod
    async def _measure_on(node: Host, program: str, devices: tuple[str, ...]) -> dict[str, int] | None:
        try:
            found = await node.client.call("llm_pool.getFootprint", program)
        except SupervisorError as exc:
            log.warning("could not measure %s on host %s: %s", program, node.name, exc)
            return None
        # What the walk found on the devices the model counts against, as the local walk records it.
        sample = {d: int(found[d]) for d in devices if found.get(d)} if devices == (CPU,) else \
            {d: int(b) for d, b in found.items() if d != CPU and b}
        return sample or None

    # -- the admin view ---------------------------------------------------------------------------

    def describe_model(self, runtime: ModelRuntime) -> dict[str, Any]:
        """The lifecycle fields of a model's admin row (placer_view.py)."""
        holding = runtime.name in self._loading or _STATUS.get(runtime.state) in HOLDING or \
            (runtime.state == ModelState.FAILED and bool(runtime.replicas))
        charges = self._asleep.get(runtime.name) or self._charges.get(runtime.name)
        return placer_view.model_fields(runtime, self.memory, self.waiting.get(runtime.name),
                                        charges if holding else None, self.clock.time())

    def describe(self) -> dict[str, Any]:
        """GET /v1/admin/memory (placer_view.py)."""
        return placer_view.memory_report(self.views(), self.memory, self.settings.lifecycle, self.pending,
                                         self.waiting, self.models, self.working_set, self.clock.monotonic())


def too_large(name: str, short: Shortfall) -> Conflict:
    return Conflict(f"model {name!r} can never fit: {short.describe()} (only pinned models stay loaded)",
                    code="model_too_large", param="model")


def insufficient(name: str, short: Shortfall, evicting: tuple[str, ...] = ()) -> Unavailable:
    why = (f"{', '.join(evicting)} {'is' if len(evicting) == 1 else 'are'} being unloaded to make room once "
           "the requests running there end") if evicting else \
        "the models that hold it are busy, loading, or loaded too recently to evict (min_residence_s)"
    return Unavailable(f"model {name!r} cannot be loaded now: {short.describe()}; {why}",
                       code="insufficient_memory", retry_after=5)
