"""One model as configured (`ModelConfig`), the defaults its fields take, and which of its fields
name files."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from proxy.config.merge import deep_merge

# The per-model keys that default to the same key under engine.lifecycle.
MODEL_LIFECYCLE_FIELDS = ("load_on_demand", "idle_unload_s", "pinned")
DEFAULT_MODEL = {"enabled": False, "replicas": 1, "target_inflight": 1, "modalities": ["text"], "gpus": []}
# Replica routing (docs/routing.md: Replica routing and affinity). Affinity by default: every engine reuses
# only the KV cache it holds, so a conversation that comes back to its replica skips its prefill,
# and the load bound keeps that from costing balance. A model sets its own; engine.routing changes
# the default for all.
DEFAULT_ROUTING: dict[str, Any] = {"routing": "affinity", "affinity_max_imbalance": None,
                                   "affinity_max_wait_s": 1.0, "affinity_prefix_chars": 1024}

# Fields that name files: relative values resolve against the base settings file's folder, so a
# config means the same thing whatever the current directory of the process that reads it.
PATH_FIELDS = ("model_path", "llama_server_binary", "llama_server_mmproj_path", "llama_server_draft_model_path",
               "llama_server_media_path", "vllm_serve_binary")
PATH_LIST_FIELDS = ("llama_server_library_path", "vllm_serve_library_path")
# What a model's request may fall back on (`fallbacks`): a bare name takes the first two.
FALLBACK_REASONS = ("unavailable", "overloaded", "context_length_exceeded")
DEFAULT_FALLBACK_ON = frozenset(("unavailable", "overloaded"))


@dataclass(frozen=True)
class Fallback:
    """A model that answers in another's place when that one cannot, for the reasons in `on`."""

    model: str
    on: frozenset[str] = DEFAULT_FALLBACK_ON


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter of a base model (docs/adapters.md): a model id of its own, served by the base's
    replicas with the engine's own way of choosing it, so that switching costs no load."""

    name: str          # its key under the base's lora_adapters
    id: str            # the public model id: `<base>:<name>` unless it sets its own
    path: str          # the adapter file (llama-server) or folder (vLLM), resolved
    scale: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """One model as configured, with backend-specific fields kept in `options` for its launcher."""

    name: str
    backend: str
    enabled: bool
    replicas: int
    replica_max: int
    target_inflight: int
    modalities: tuple[str, ...]
    gpus: tuple[int, ...]
    options: Mapping[str, Any] = field(default_factory=dict)
    load_on_demand: bool = False        # a request while it is not loaded loads it
    idle_unload_s: float | None = None  # unloaded after this long without a request; None: never
    pinned: bool = False                # never unloaded by the pool (idle or to make room)
    hosts: tuple[str, ...] = ()         # where its replicas may run; (): any host
    fallbacks: tuple[Fallback, ...] = ()   # in order (docs/routing.md: Aliases and fallbacks)
    adapters: tuple[Adapter, ...] = ()     # its LoRA adapters, in the order its replicas load them

    def adapter(self, name: str) -> Adapter | None:
        return next((a for a in self.adapters if a.name == name), None)

    def get(self, key: str, default: Any = None) -> Any:
        value = self.options.get(key)
        return default if value is None else value

    def with_overrides(self, overrides: Mapping[str, Any]) -> "ModelConfig":
        """These settings with a load's overrides, deep-merged as the config files are: an override
        of one key of a nested field (`{"sim": {"ttft_ms": 5}}`) keeps the field's other keys."""
        options = deep_merge(dict(self.options), dict(overrides))
        return replace(self, options=options, replicas=overrides.get("replicas", self.replicas),
                       target_inflight=overrides.get("target_inflight", self.target_inflight))
