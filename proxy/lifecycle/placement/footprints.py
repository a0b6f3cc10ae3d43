"""Measured footprints: what each model's replicas really took, per model and settings, kept in
the state directory so that they survive restarts (`footprints.json`).

A model's settings key covers every field that can change what a replica holds (context, slots,
cache types, a load's overrides) and none that cannot (replica count, timeouts, lifecycle keys), so
a model measured once is admitted by that figure however often it is reloaded or scaled.
Admission takes a high percentile of the recent samples plus a margin (engine.lifecycle.memory).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from proxy.config.model import ModelConfig
from proxy.atomic_file import read_back, write_atomic

log = logging.getLogger(__name__)

# Samples kept per model and settings: enough for a percentile, few enough to follow a new engine build.
KEEP = 20
# Fields that do not change what a replica holds in memory.
NOT_MEMORY_FIELDS = frozenset({"hosts", "enabled", "replicas", "replica_max", "description", "load_on_demand",
                               "idle_unload_s", "pinned", "first_byte_timeout_s", "stream_idle_timeout_s",
                               "warmup", "modalities", "image_url_schemes", "image_url_allow_private",
                               "llama_server_start_timeout_s", "vllm_serve_start_timeout_s"})


def settings_key(config: ModelConfig) -> str:
    memory = {k: v for k, v in config.options.items() if k not in NOT_MEMORY_FIELDS}
    text = json.dumps({"backend": config.backend, "target_inflight": config.target_inflight, **memory},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Measured:
    """The admission figure from a model's measurements: bytes per replica per device."""

    per_replica: Mapping[str, int]    # the percentile, plus the margin: what admission counts
    raw: Mapping[str, int]            # the percentile itself
    samples: int
    last_at: float        # wall-clock time of the newest sample


class Footprints:
    def __init__(self, path: Path, percentile: float = 90, margin: float = 0.1) -> None:
        self.path = path
        self.percentile = percentile
        self.margin = margin
        self._data: dict[str, dict[str, dict[str, Any]]] = self._read()

    def record(self, config: ModelConfig, per_device: Mapping[str, int]) -> None:
        """One replica's measurement (bytes per device), kept and written at once."""
        entry = self._data.setdefault(config.name, {}).setdefault(settings_key(config), {"samples": []})
        entry["samples"] = [*entry["samples"], {"at": round(time.time(), 3), "bytes": dict(per_device)}][-KEEP:]
        self._write()

    def measured(self, config: ModelConfig, devices: tuple[str, ...]) -> Measured | None:
        """The figure for these settings on these devices, or None before a measurement there."""
        entry = self._data.get(config.name, {}).get(settings_key(config))
        samples = [s for s in (entry or {}).get("samples", []) if set(s["bytes"]) <= set(devices) and s["bytes"]]
        if not samples:
            return None
        raw = {}
        for device in devices:
            values = sorted(int(s["bytes"].get(device, 0)) for s in samples)
            raw[device] = values[max(0, math.ceil(self.percentile / 100 * len(values)) - 1)]
        return Measured({d: int(b * (1 + self.margin)) for d, b in raw.items()}, raw, len(samples),
                        max(float(s["at"]) for s in samples))

    def _read(self) -> dict[str, dict[str, dict[str, Any]]]:
        # A file that cannot be read costs estimates until the models are measured again, not service.
        data = read_back(self.path)
        models = data.get("models") if isinstance(data, dict) else None
        return models if isinstance(models, dict) else {}

    def _write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps({"version": 1, "models": self._data}, indent=1, sort_keys=True))
        except OSError as exc:
            log.warning("could not write %s: %s", self.path, exc)
