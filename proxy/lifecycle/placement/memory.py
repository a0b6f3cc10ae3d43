"""What each model needs on which device, and each device's budget: the numbers placement decides by.

A model counts against a GPU when its settings put it there (its launcher's `device`: `gpus`,
`llama_server_n_gpu_layers` not 0, vLLM, ExLlamaV3, CT2 `device: cuda`) and a GPU is visible;
otherwise against the CPU budget, since that is where it then runs. A remote endpoint holds no
local memory. Its need is the higher of the estimate from its files (proxy/gpu/vram_estimate.py)
and its measured footprint where one exists for its settings (footprints.py): a measurement taken
before the replica was used can be lower than what its settings reserve, and an estimate misses
what an engine holds beyond what it counts. The placer fixes a model's need when its load is admitted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from launchers import launcher_for
from proxy.config.model import ModelConfig
from proxy.config.settings import LOCAL_HOST, LifecycleSettings, Settings
from proxy.gpu.footprint import GpuTotals, gpu_device, gpu_totals
from proxy.gpu.report import load_nvml
from proxy.gpu.vram_estimate import MIB, Estimate, Estimator, missing_weights
from proxy.lifecycle.placement.footprints import Footprints, Measured
from proxy.lifecycle.placement.rules import Limits, ModelView, room_for
from proxy.supervisord.hosts import Host

CPU = "cpu"


def qualify(host: str, device: str) -> str:
    """A device as placement counts it: the local host's by its own name (cpu, gpu0), as always;
    another host's prefixed with the host (`b:cpu`, `b:gpu0`)."""
    return device if host == LOCAL_HOST else f"{host}:{device}"


@dataclass(frozen=True)
class Placement:
    devices: tuple[str, ...]      # () for a remote endpoint
    why: str


@dataclass(frozen=True)
class Need:
    """What a model's replicas need, all together, per device; and where the figure comes from."""

    per_device: dict[str, int]
    per_replica: dict[str, int]
    source: str                   # "measured", "estimated" or "none"
    detail: dict[str, Any]


class Memory:
    def __init__(self, lifecycle: LifecycleSettings, footprints: Footprints, estimator: Estimator,
                 gpus: GpuTotals, hosts: Mapping[str, Host] | None = None) -> None:
        self.lifecycle = lifecycle
        self.footprints = footprints
        self.estimator = estimator
        self.gpus = gpus
        # The other hosts than this machine's (supervisor.hosts), as the pool built them.
        self.hosts: Mapping[str, Host] = hosts if hosts is not None else {}

    @classmethod
    def from_settings(cls, settings: Settings, gpus: GpuTotals | None = None,
                      hosts: Mapping[str, Host] | None = None) -> "Memory":
        """The memory of `settings`' lifecycle, its footprints kept in the state directory. `gpus`
        None: not read yet (the pool reads them when it starts, in a thread), so no GPU budget is known."""
        life = settings.lifecycle
        footprints = Footprints(settings.service.state_dir / "footprints.json", life.footprint_percentile,
                                life.footprint_margin)
        return cls(life, footprints, Estimator(), gpus if gpus is not None else gpu_totals(_not_read_yet), hosts)

    def host_gpus(self, host: str) -> GpuTotals:
        if host == LOCAL_HOST:
            return self.gpus
        node = self.hosts.get(host)
        devices = node.devices if node is not None else None
        if not devices:
            return GpuTotals({}, f"host {host} has not reported its devices")
        return GpuTotals({gpu_device(int(g["index"])): int(g["total_bytes"]) for g in devices.get("gpus", [])},
                         devices.get("gpu_reason") or None)

    def placement(self, config: ModelConfig, host: str = LOCAL_HOST) -> Placement:
        launcher = launcher_for(config.backend)
        if launcher is None:
            return Placement((), "a remote endpoint holds no local memory")
        kind, why = launcher.device(config)
        if kind == CPU:
            return Placement((CPU,), why)
        gpus = self.host_gpus(host)
        if not gpus.totals:
            return Placement((CPU,), f"{why}, but no GPU is visible here ({gpus.reason}): it runs on the CPU")
        indices = config.gpus or (0,)
        devices = tuple(gpu_device(i) for i in indices)
        return Placement(devices, f"{why}; gpus: {list(config.gpus)}" if config.gpus else f"{why}; GPU 0")

    def budgets(self) -> dict[str, int]:
        """Bytes per limited device (host-qualified); a device left out does not limit loads."""
        budgets = self._host_budgets(LOCAL_HOST, self.lifecycle.cpu_budget_mib)
        for name, host in self.hosts.items():
            if host.local or host.down_since is not None or not host.devices:
                continue   # a host that does not answer takes no loads
            cpu_mib = host.settings.cpu_budget_mib if host.settings and host.settings.cpu_budget_mib is not None \
                else self.lifecycle.cpu_budget_mib
            budgets.update(self._host_budgets(name, cpu_mib))
        return budgets

    def _host_budgets(self, host: str, cpu_mib: float | None) -> dict[str, int]:
        """One host's: its CPU budget, and each of its GPUs less gpu_headroom_mib."""
        budgets = {qualify(host, CPU): int(cpu_mib * MIB)} if cpu_mib is not None else {}
        if self.lifecycle.gpu_headroom_mib is not None:
            headroom = int(self.lifecycle.gpu_headroom_mib * MIB)
            budgets.update({qualify(host, d): max(0, total - headroom)
                            for d, total in self.host_gpus(host).totals.items()})
        return budgets

    def need_on(self, config: ModelConfig, hosts: tuple[str, ...]) -> dict[str, int]:
        """What the model's replicas need with replica i on hosts[i], per host-qualified device."""
        if all(h == LOCAL_HOST for h in hosts) and len(hosts) == config.replicas:
            return self.need(config).per_device
        out: dict[str, int] = {}
        for host in hosts:
            for device, n in self.per_replica(config, host).items():
                out[qualify(host, device)] = out.get(qualify(host, device), 0) + n
        return out

    def per_replica(self, config: ModelConfig, host: str = LOCAL_HOST) -> dict[str, int]:
        """One replica's need on `host`, by device there (unqualified)."""
        devices = self.placement(config, host).devices
        if not devices:
            return {}
        return self._need(config, devices).per_replica

    def need(self, config: ModelConfig) -> Need:
        devices = self.placement(config).devices
        if not devices:
            return Need({}, {}, "none", {})
        return self._need(config, devices)

    def estimate(self, config: ModelConfig, devices: tuple[str, ...]) -> Estimate:
        """The estimate for `config` where it runs: on the CPU it counts the engine's own process too."""
        return self.estimator.estimate(config, on_cpu=devices == (CPU,))

    def _need(self, config: ModelConfig, devices: tuple[str, ...], measured: Measured | None = None,
              estimate: Estimate | None = None) -> Need:
        """Per device the higher of the estimate and the measured figure (where there is one)."""
        measured = measured if measured is not None else self.footprints.measured(config, devices)
        estimate = estimate if estimate is not None else self.estimate(config, devices)
        # A model given several GPUs is assumed to spread evenly over them.
        estimated = {d: estimate.total_bytes // len(devices) for d in devices}
        measured_bytes = dict(measured.per_replica) if measured is not None else {}
        per_replica = {d: max(estimated[d], measured_bytes.get(d, 0)) for d in devices}
        # Which figure admits it: the measurement once it is at least the estimate.
        source = "measured" if measured is not None and sum(measured_bytes.values()) >= sum(estimated.values()) \
            else "estimated"
        detail: dict[str, Any] = {"counted": estimate.counted, "not_counted": estimate.not_counted}
        if measured is not None:
            detail.update(samples=measured.samples, percentile=self.footprints.percentile,
                          margin=self.footprints.margin)
        return Need({d: b * config.replicas for d, b in per_replica.items()}, per_replica, source, detail)

    def describe(self, config: ModelConfig) -> dict[str, Any]:
        """The model's footprint as the admin view shows it: both figures, with their sources."""
        placement = self.placement(config)
        estimate = self.estimate(config, placement.devices) if placement.devices else None
        measured = self.footprints.measured(config, placement.devices) if placement.devices else None
        need = self._need(config, placement.devices, measured, estimate) if placement.devices \
            else Need({}, {}, "none", {})
        return {
            "devices": list(placement.devices),
            "why": placement.why,
            "admitted_by": need.source,
            "needed_mib": {d: _mib(b) for d, b in need.per_device.items()},
            "measured_mib_per_replica": None if measured is None else {d: _mib(b) for d, b in measured.raw.items()},
            "measured_samples": 0 if measured is None else measured.samples,
            "estimated_mib_per_replica": None if estimate is None else _mib(estimate.total_bytes),
            # A weight file the settings name that is not there: its figures above are not its need.
            "missing_files": missing_weights(config),
        }


def _mib(n: int) -> float:
    return round(n / MIB, 1)


def memory_warnings(settings: Settings, nvml_loader: Callable[[], Any] = load_nvml) -> list[str]:
    """What `check-config` says of the memory limits: a model that could never fit (beside the
    pinned models loaded at start), and enabled models that do not all fit at start. Blocking."""
    life = settings.lifecycle
    if life.cpu_budget_mib is None and life.gpu_headroom_mib is None and life.max_loaded_models is None:
        return []
    memory = Memory.from_settings(settings, gpu_totals(nvml_loader))
    limits = Limits(budgets=memory.budgets(), max_loaded=life.max_loaded_models)
    needs = {name: memory.need(m).per_device for name, m in settings.models.items()}
    counted = {name: bool(memory.placement(m).devices) for name, m in settings.models.items()}
    pinned = [ModelView(n, "loaded", needs[n], pinned=True, counted=counted[n])
              for n, m in settings.models.items() if m.pinned and m.enabled]
    found = []
    for name, model in settings.models.items():
        if model.enabled and model.pinned:
            others = [p for p in pinned if p.name != name]
        else:
            others = pinned
        target = ModelView(name, "cold", needs[name], counted=counted[name])
        room = room_for(name, [*others, target], limits, now=0.0)
        if room.too_large is not None:
            found.append(f"engine.models.{name}: model_too_large: it can never be loaded here: "
                         f"{room.too_large.describe()} (beside the pinned models enabled at start)")
    for device, budget in limits.budgets.items():
        total = sum(needs[n].get(device, 0) for n, m in settings.models.items() if m.enabled)
        if total > budget:
            found.append(f"engine.lifecycle.memory: the enabled models need {total / MIB:.1f} MiB on {device}, more "
                         f"than its budget of {budget / MIB:.1f} MiB: not all of them load at start")
    return [settings.where(w) for w in found]


def _not_read_yet() -> Any:
    raise RuntimeError("not read yet")
