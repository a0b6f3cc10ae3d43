"""The records of the settings (`Settings`: the service, supervisord and its hosts, engine.lifecycle,
the models) with the defaults of their sections."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

from proxy.config.model import Adapter, ModelConfig
from proxy.config.origins import Origins

DEFAULT_SERVICE = {"host": "127.0.0.1", "port": 8011, "log_level": "info", "max_body_bytes": 32 * 1024 * 1024,
                   "drain_timeout_s": 30.0, "reload_timeout_s": 120.0, "admin_token_env": None}
# Reliability defaults (docs/routing.md: Timeouts, health checks and ejection). A long prefill on a big model is
# legitimate, so the first byte gets minutes; a stream that goes quiet mid-answer does not.
DEFAULT_RELIABILITY: dict[str, Any] = {"first_byte_timeout_s": 600.0, "stream_idle_timeout_s": 120.0,
                       "max_response_bytes": 64 * 1024 * 1024, "health_interval_s": 5.0, "health_timeout_s": 5.0,
                       "eject_after_failures": 5, "eject_base_s": 30.0, "eject_max_s": 300.0,
                       "load_retry_base_s": 5.0, "load_retry_max_s": 300.0}
DEFAULT_SUPERVISOR = {"mode": "managed", "url": None, "programs_dir": None, "port_range": [18100, 18999],
                      "poll_interval_s": 0.2, "rpc_timeout_s": 10.0, "stopwaitsecs": 15, "pass_env": []}
# engine.lifecycle (docs/lifecycle.md: More models than memory). Every default keeps the behaviour from before
# it existed: models load only when enabled or an admin loads them, stay until unloaded, and no load
# is refused for memory.
DEFAULT_LIFECYCLE: dict[str, Any] = {"load_on_demand": False, "idle_unload_s": None, "pinned": False,
                                     "max_loaded_models": None, "swap_max_wait_s": 10.0, "min_residence_s": 5.0,
                                     "kv_store_mib": 0, "thrash_window_s": 60.0}
DEFAULT_MEMORY: dict[str, Any] = {"gpu_headroom_mib": None, "cpu_budget_mib": None, "footprint_margin": 0.1,
                                  "footprint_percentile": 90}


@dataclass(frozen=True)
class ServiceSettings:
    host: str
    port: int
    log_level: str
    state_dir: Path
    max_body_bytes: int
    drain_timeout_s: float
    admin_token_env: str | None
    # A reload's successor must have adopted every running replica and be accepting within this.
    reload_timeout_s: float = 120.0
    admin_host: str | None = None       # with admin_port: the admin API listens there, and only there
    admin_port: int | None = None
    # Without a token, the admin API on an address other machines reach is refused at startup unless
    # this says it is meant (docs/security.md): anyone who reaches it can load and unload models.
    admin_allow_unauthenticated_remote: bool = False
    # More Host names the proxy answers to where no key guards it (the admin API without a token, the
    # data plane without tenants): a LAN name, a container's service name, a reverse proxy's own name.
    server_names: tuple[str, ...] = ()
    # Processes that accept clients and relay answers, under this one (the controller) that decides:
    # 1 is one process doing both, with no hop between (docs/workers.md).
    workers: int = 1
    first_byte_timeout_s: float = DEFAULT_RELIABILITY["first_byte_timeout_s"]
    stream_idle_timeout_s: float = DEFAULT_RELIABILITY["stream_idle_timeout_s"]
    max_response_bytes: int = DEFAULT_RELIABILITY["max_response_bytes"]
    health_interval_s: float = DEFAULT_RELIABILITY["health_interval_s"]
    health_timeout_s: float = DEFAULT_RELIABILITY["health_timeout_s"]
    eject_after_failures: int = DEFAULT_RELIABILITY["eject_after_failures"]
    eject_base_s: float = DEFAULT_RELIABILITY["eject_base_s"]
    eject_max_s: float = DEFAULT_RELIABILITY["eject_max_s"]
    # A failed load at startup that can pass is tried again after this, doubled per try, up to the max.
    load_retry_base_s: float = DEFAULT_RELIABILITY["load_retry_base_s"]
    load_retry_max_s: float = DEFAULT_RELIABILITY["load_retry_max_s"]

    @property
    def admin_listener_host(self) -> str:
        """Where the admin API listens: admin_host with admin_port, else service.host."""
        return (self.admin_host or self.host) if self.admin_port is not None else self.host


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1, bracketed or not): only this machine reaches it."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class HostSettings:
    """supervisor.hosts.NAME: another host's supervisord with llm-pool's plugin (`llm-pool node`)."""

    name: str
    url: str
    username: str
    password_env: str                    # the variable holding its password: the value is never kept here
    address: str                         # where its replicas are reached (default: the url's host)
    cpu_budget_mib: float | None = None  # None: engine.lifecycle.memory.cpu_budget_mib


# The name of the host that is this machine's own supervisord (managed or external mode).
LOCAL_HOST = "local"
DEFAULT_NODE_USERNAME = "llm-pool"


@dataclass(frozen=True)
class SupervisorSettings:
    mode: str
    url: str | None
    programs_dir: Path
    port_range: tuple[int, int]
    poll_interval_s: float
    rpc_timeout_s: float
    stopwaitsecs: int
    pass_env: tuple[str, ...] = ()       # variables passed to model servers besides the fixed few
    hosts: Mapping[str, HostSettings] = field(default_factory=dict)   # other hosts, by name

    @property
    def host_names(self) -> tuple[str, ...]:
        """Every host replicas may run on: this machine's supervisord first (unless mode is
        `hosts`), then the configured ones in their order."""
        return ((LOCAL_HOST,) if self.mode != "hosts" else ()) + tuple(self.hosts)


@dataclass(frozen=True)
class LifecycleSettings:
    """engine.lifecycle: the pool-wide limits of what may be loaded at once."""

    max_loaded_models: int | None = None
    swap_max_wait_s: float = DEFAULT_LIFECYCLE["swap_max_wait_s"]
    min_residence_s: float = DEFAULT_LIFECYCLE["min_residence_s"]
    # Disk for llama-server slots kept across swaps (proxy/lifecycle/kvcache/); 0: none are kept.
    kv_store_mib: float = DEFAULT_LIFECYCLE["kv_store_mib"]
    # A model evicted and loaded again within this is a working set bigger than the budget (placement/
    # thrash.py): an event and a counter say so. 0: never said.
    thrash_window_s: float = DEFAULT_LIFECYCLE["thrash_window_s"]
    gpu_headroom_mib: float | None = None    # None: GPU memory does not limit loads
    cpu_budget_mib: float | None = None      # None: CPU memory does not limit loads
    footprint_margin: float = DEFAULT_MEMORY["footprint_margin"]
    footprint_percentile: float = DEFAULT_MEMORY["footprint_percentile"]


@dataclass(frozen=True)
class BatchSettings:
    """engine.batches: the OpenAI Batch API run inside the pool (docs/batches.md)."""

    enabled: bool = True
    max_file_bytes: int = 200 * 1024 * 1024       # one uploaded file (OpenAI's limit)
    max_lines: int = 50_000                        # lines of one batch file (OpenAI's limit)
    max_storage_bytes: int = 2 * 1024 ** 3         # every file kept (inputs, outputs, errors) together
    # Slots of a model its batches leave free for the classes above, so that an interactive request
    # finds one at once instead of waiting for a batch line to end.
    reserve_slots: int = 1


@dataclass(frozen=True)
class TenantSettings:
    """tenants.NAME: one client service of the data plane (docs/tenants.md). Its keys are named by
    the variables holding them or by their digests: never a key itself."""

    name: str
    fairness_key: str
    key_env: tuple[str, ...] = ()
    key_sha256: tuple[str, ...] = ()
    weight: float | None = None
    priority: str | None = None   # its priority class (engine.fairness.classes); None: default
    models: tuple[str, ...] = ("*",)
    allow_remote: bool = False
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    budget_period: str = "month"
    budget_tokens: int | None = None
    budget_cost: float | None = None


@dataclass(frozen=True)
class Settings:
    service: ServiceSettings
    supervisor: SupervisorSettings
    decoding: Mapping[str, Any]
    fairness: Mapping[str, Any]
    models: Mapping[str, ModelConfig]
    sources: tuple[Path, ...]
    lifecycle: LifecycleSettings = field(default_factory=LifecycleSettings)
    warnings: tuple[str, ...] = ()         # unknown keys, each with the closest known name
    origins: Origins = field(default_factory=Origins, compare=False)
    tenants: Mapping[str, TenantSettings] = field(default_factory=dict)   # none: every caller is trusted
    aliases: Mapping[str, str] = field(default_factory=dict)   # a public id: the model it stands for
    batches: BatchSettings = field(default_factory=BatchSettings)

    @cached_property
    def adapters(self) -> Mapping[str, tuple[ModelConfig, Adapter]]:
        """Each LoRA adapter's public id: its base model and itself (docs/adapters.md)."""
        return {a.id: (m, a) for m in self.models.values() for a in m.adapters}

    def where(self, message: str) -> str:
        """A config message with the file and line that set its key, e.g. `(conf/local.yaml:12)`."""
        return self.origins.where(message)

    @property
    def socket_path(self) -> Path:
        return self.service.state_dir / "supervisor.sock"

    @property
    def supervisor_url(self) -> str:
        if self.supervisor.mode == "external":
            assert self.supervisor.url
            return self.supervisor.url
        return f"unix://{self.socket_path}"
