"""What an admin set for the models loaded now, kept in the state dir for the next `serve`.

For each loaded model: the overrides it runs with (a load's `overrides`, and the replica count of a
scale or a load's `replicas`: `changed(config, active)`, as the admin view shows them), and the
settings its replicas were started with. Written (atomically) after every load, scale and unload;
an unload removes the model's entry, so a full stop (SIGTERM unloads every model) leaves nothing
kept and the next `serve` starts from the config files alone. A reload (SIGUSR1, --keep-models)
leaves the replicas running and the entries in place: the next `serve` adopts each such model with
its kept overrides, and compares the kept settings with what the config files (plus the kept
overrides) give now to say what changed (proxy/lifecycle/state/outdated.py: by name, since settings
may name secrets' variables and programs hold their values) and roll the replicas that run the old
ones (proxy/lifecycle/rolling.py).

The file is the proxy's own (mode 0600, in its state dir), read only at startup. Nothing in it is
ever started: the kept settings only describe and reach replicas that already run.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from launchers import launcher_for
from proxy.atomic_file import PRIVATE_MODE, read_back, write_atomic
from proxy.config.checks import override_problems, replicas_problem
from proxy.config.merge import changed
from proxy.config.model import Adapter, Fallback, ModelConfig
from proxy.lifecycle.state.replicas import ModelState
from proxy.lifecycle.state.runtime import ModelRuntime

log = logging.getLogger(__name__)

FILE_NAME = "kept-models.json"
VERSION = 1
# Fields of ModelConfig held as tuples (JSON gives lists back).
_TUPLES = ("modalities", "gpus", "hosts")


@dataclass(frozen=True)
class KeptModel:
    """One loaded model's entry: the overrides to load it with again, and the settings it runs with."""

    overrides: Mapping[str, Any]
    settings: ModelConfig | None    # None: written by a version that kept none, or unreadable

    def to_json(self) -> dict[str, Any]:
        settings = None if self.settings is None else asdict(self.settings)
        if settings is not None:   # JSON has no sets: each fallback's reasons as a sorted list
            settings["fallbacks"] = [{"model": f["model"], "on": sorted(f["on"])} for f in settings["fallbacks"]]
        return {"overrides": dict(self.overrides), "settings": settings}


def entry(config: ModelConfig, active: ModelConfig) -> KeptModel:
    """The entry of a model configured as `config` and loaded as `active`."""
    return KeptModel(overrides=changed(config.options, active.options), settings=active)


def _settings(raw: Any) -> ModelConfig | None:
    if isinstance(raw, dict) and "adapters" not in raw:
        raw = {**raw, "adapters": []}   # written before models had LoRA adapters (issue 45): none
    if not isinstance(raw, dict) or set(raw) != {f.name for f in fields(ModelConfig)}:
        return None
    try:
        values: dict[str, Any] = {k: tuple(v) if k in _TUPLES else v for k, v in raw.items()}
        values["fallbacks"] = tuple(Fallback(f["model"], frozenset(f["on"])) for f in raw["fallbacks"])
        values["adapters"] = tuple(Adapter(**a) for a in raw["adapters"])
        return ModelConfig(**values)
    except (TypeError, KeyError):
        return None


class KeptModels:
    """The state dir's file of kept entries, by model name, and the entries the last proxy left for
    the models whose startup load has not ended yet (they stand in the file until it has)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending: dict[str, KeptModel] = {}

    def honour(self, runtime: ModelRuntime, kept: KeptModel | None) -> dict[str, Any]:
        """The overrides of `kept` (the last proxy's entry for the model) that its settings now
        accept, to load it with at startup; each dropped one is a warning naming it."""
        if kept is None:
            return {}
        self.pending[runtime.name] = kept
        runtime.kept = kept.settings
        launcher = launcher_for(runtime.config.backend)
        allowed = launcher.LOAD_OVERRIDES if launcher is not None else ()
        overrides, warnings = honoured(runtime.config, kept.overrides, allowed,
                                       launcher.option_problems if launcher is not None else lambda _: [])
        for warning in warnings:
            log.warning("%s", warning)
        if overrides:
            log.info("model %s: loading with its kept overrides %s", runtime.name, sorted(overrides))
        return overrides

    def settled(self, name: str) -> None:
        """Its startup load ended (loaded or not): from now on the model's own state says what is kept."""
        self.pending.pop(name, None)

    def save(self, runtimes: Iterable[ModelRuntime]) -> None:
        """Write the entry of every loaded model: after each load, scale, roll and unload."""
        entries = dict(self.pending)
        for runtime in runtimes:
            if runtime.state == ModelState.LOADED and runtime.active is not None:
                found = entry(runtime.config, runtime.active)
                if runtime.kept is not None and any(r.outdated for r in runtime.replicas):
                    # Mid-roll: the settings the old replicas run, so that a reload now can still reach them.
                    found = KeptModel(found.overrides, runtime.kept)
                entries[runtime.name] = found
        self.write(entries)

    def read(self) -> dict[str, KeptModel]:
        """The entries the last proxy left; none when there is no file. A file that cannot be read
        is logged and ignored: the models then load with their configured settings."""
        doc = read_back(self.path)
        if doc is None:
            return {}
        models = doc.get("models") if isinstance(doc, dict) and doc.get("version") == VERSION else None
        if not isinstance(models, dict):
            log.warning("ignoring %s: not a version %d file of kept models", self.path, VERSION)
            return {}
        found = {}
        for name, raw in models.items():
            if isinstance(raw, dict) and isinstance(raw.get("overrides"), dict):
                found[name] = KeptModel(overrides=raw["overrides"], settings=_settings(raw.get("settings")))
        return found

    def write(self, entries: Mapping[str, KeptModel]) -> None:
        """Replace the file with `entries` (whole or not at all); a failure is logged, never raised:
        what runs is unaffected, only the next `serve` would load the configured settings."""
        doc = {"version": VERSION, "models": {n: e.to_json() for n, e in sorted(entries.items())}}
        try:
            write_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n", mode=PRIVATE_MODE)
        except OSError as exc:
            log.error("could not write %s: %s; a reload will not keep the admin's overrides", self.path, exc)


def honoured(config: ModelConfig, overrides: Mapping[str, Any], allowed: tuple[str, ...],
             option_problems: Callable[[ModelConfig], list[str]]) -> tuple[dict[str, Any], list[str]]:
    """The kept `overrides` that the (new) `config` still accepts, and a warning for each one it
    does not, naming it and why. `allowed`: the backend's live overrides. The checks are a load
    request's own (proxy/serving/routes_admin.py), so that nothing is kept that a load would refuse."""
    kept: dict[str, Any] = {}
    warnings: list[str] = []
    for key, value in overrides.items():
        if key == "replicas":
            problem = replicas_problem(value, config.replica_max)
            problems = [problem] if problem else []
        else:
            problems = override_problems(config, {key: value}, allowed)
        if problems:
            warnings.append(f"model {config.name}: dropping the kept override {key}: " + "; ".join(problems))
        else:
            kept[key] = value
    settings = {k: v for k, v in kept.items() if k != "replicas"}
    if settings:
        problems = option_problems(config.with_overrides(kept))
        if problems:
            warnings.append(f"model {config.name}: dropping the kept override(s) {', '.join(sorted(settings))}: "
                            + "; ".join(problems))
            kept = {k: v for k, v in kept.items() if k == "replicas"}
    return kept, warnings
