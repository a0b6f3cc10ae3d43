"""Reading the settings: the base and local files, merged with the origin of each key, checked
(proxy/config/checks.py), then built into the records (`load_settings`); `ConfigError` when they are
unusable."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

import yaml

from proxy.config import files
from proxy.config.checks import schema_findings, semantic_problems
from proxy.config.merge import deep_merge
from proxy.config.model import (DEFAULT_FALLBACK_ON, DEFAULT_MODEL, DEFAULT_ROUTING, MODEL_LIFECYCLE_FIELDS,
                                PATH_FIELDS, PATH_LIST_FIELDS, Adapter, Fallback, ModelConfig)
from proxy.config.origins import Key, Origin, Origins, duplicate_keys, key_origins, merge_origins
from proxy.config.settings import (DEFAULT_LIFECYCLE, DEFAULT_MEMORY, DEFAULT_NODE_USERNAME, DEFAULT_RELIABILITY,
                                   DEFAULT_SERVICE, DEFAULT_SUPERVISOR, HostSettings, LifecycleSettings,
                                   BatchSettings, ServiceSettings, Settings, SupervisorSettings, TenantSettings)


class ConfigError(Exception):
    """The settings are unusable; `problems` holds one `path: message` line each, `warnings` the
    unknown keys found on the way (shown with the problems, never hidden by them)."""

    def __init__(self, problems: list[str], warnings: tuple[str, ...] = ()) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems
        self.warnings = warnings


class SettingsLoader(yaml.SafeLoader):
    """YAML 1.1's SafeLoader, but `on` and `off` are words, not booleans (as in YAML 1.2): a model's
    fallbacks say `on: [unavailable]`, which 1.1 reads as the key True. `true`, `false`, `yes` and
    `no` stay booleans; `enabled: on` is then a string the schema names."""


SettingsLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
SettingsLoader.add_implicit_resolver("tag:yaml.org,2002:bool",
                                      re.compile(r"^(?:yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE)$"),
                                      list("yYnNtTfF"))


def _read_document(path: Path) -> tuple[dict[str, Any], list[tuple[Key, Origin]], list[str]]:
    """The file's document, the line of each of its keys (from the composed nodes' marks; JSON
    is YAML, so a settings.json has its lines too) and its keys given twice in one mapping."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from None
    loader = SettingsLoader(text)
    try:
        node = loader.get_single_node()
        duplicates = list(duplicate_keys(node, path)) if node is not None else []
        doc = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{where}: invalid YAML: {problem}"]) from None
    finally:
        loader.dispose()
    if doc is None or node is None:
        return {}, [], []
    if not isinstance(doc, dict):
        raise ConfigError([f"{path}: the top level must be a mapping, not {type(doc).__name__}"])
    return doc, list(key_origins(node, path)), duplicates


def settings_paths(config: str | os.PathLike[str] | None = None) -> tuple[Path, Path]:
    """The base and local settings paths: explicit argument, then environment, then conf/.

    The local file sits beside the base file and has its extension: settings.json pairs with
    local.json (the seed's layout), pool.yaml with local.yaml.
    """
    base = Path(config or os.environ.get("LLM_POOL_SETTINGS_PATH") or files.DEFAULT_SETTINGS).expanduser()
    local_env = os.environ.get("LLM_POOL_LOCAL_SETTINGS_PATH")
    local = Path(local_env).expanduser() if local_env else base.with_name("local" + (base.suffix or ".yaml"))
    return base, local


def load_document(config: str | os.PathLike[str] | None = None
                  ) -> tuple[dict[str, Any], tuple[Path, ...], Origins, list[str]]:
    """The merged document, the files it came from, where each of its keys was set, and the keys
    a file gives twice in one mapping (problems, each naming both lines)."""
    base, local = settings_paths(config)
    if not base.exists():
        raise ConfigError([f"{base}: settings file not found"])
    doc, keys, duplicates = _read_document(base)
    by_key: dict[Key, tuple[Origin, ...]] = {key: (origin,) for key, origin in keys}
    sources = [base]
    if local.exists():
        local_doc, local_keys, local_duplicates = _read_document(local)
        merge_origins(by_key, doc, local_keys, local_doc)
        doc = deep_merge(doc, local_doc)
        sources.append(local)
        duplicates += local_duplicates
    return doc, tuple(sources), Origins(by_key, base), duplicates


def default_state_dir() -> str:
    return os.path.join(os.environ.get("XDG_STATE_HOME") or "~/.local/state", "llm-pool")


def service_hints(config: str | os.PathLike[str] | None = None) -> tuple[Path, str | None]:
    """What `llm-pool ctl` can still use of settings that do not load: service.state_dir (where a
    running proxy records its address) and service.admin_token_env, each where the merged document
    gives it as a string, else the default folder and no variable."""
    try:
        doc, sources, _, _ = load_document(config)
    except ConfigError:
        doc, sources = {}, (settings_paths(config)[0],)
    service = doc.get("service")
    service = service if isinstance(service, dict) else {}
    given, env = service.get("state_dir"), service.get("admin_token_env")
    state_dir = Path(_resolve(given if isinstance(given, str) and given else default_state_dir(),
                              sources[0].resolve().parent))
    return state_dir, env if isinstance(env, str) and env else None


def _resolve(value: str, base_dir: Path) -> str:
    path = Path(os.path.expandvars(value)).expanduser()
    return str(path if path.is_absolute() else (base_dir / path).resolve())


def _model(name: str, raw: Mapping[str, Any], engine_backend: str | None, base_dir: Path,
           lifecycle: Mapping[str, Any], routing: Mapping[str, Any] | None = None) -> ModelConfig:
    defaults = {**DEFAULT_MODEL, **DEFAULT_ROUTING, **(routing or {})}
    data = {**defaults, **{k: v for k, v in raw.items() if v is not None or k not in defaults}}
    # null is a value of idle_unload_s (never): only a key that is absent takes engine.lifecycle's.
    life = {k: raw[k] if k in raw else lifecycle[k] for k in MODEL_LIFECYCLE_FIELDS}
    options = dict(data)
    for key in PATH_FIELDS:
        if isinstance(options.get(key), str):
            options[key] = _resolve(options[key], base_dir)
    for key in PATH_LIST_FIELDS:
        if isinstance(options.get(key), list):
            options[key] = [_resolve(v, base_dir) for v in options[key]]
    replicas = int(data["replicas"])
    return ModelConfig(
        name=name,
        backend=data.get("backend") or engine_backend or "",
        enabled=bool(data["enabled"]),
        replicas=replicas,
        replica_max=int(data.get("replica_max") or max(1, replicas)),
        target_inflight=int(data["target_inflight"]),
        modalities=tuple(data["modalities"]),
        gpus=tuple(data["gpus"]),
        options=options,
        load_on_demand=bool(life["load_on_demand"]),
        idle_unload_s=None if life["idle_unload_s"] is None else float(life["idle_unload_s"]),
        pinned=bool(life["pinned"]),
        hosts=tuple(data.get("hosts") or ()),
        fallbacks=tuple(Fallback(f) if isinstance(f, str) else Fallback(f["model"], frozenset(f.get("on") or ())
                                                                          or DEFAULT_FALLBACK_ON)
                        for f in data.get("fallbacks") or ()),
        adapters=tuple(Adapter(name=n, id=str(a.get("id") or f"{name}:{n}"), path=_resolve(str(a["path"]), base_dir),
                               scale=float(a.get("scale", 1.0)))
                       for n, a in (data.get("lora_adapters") or {}).items()),
    )


def _host(name: str, raw: Mapping[str, Any]) -> HostSettings:
    url = str(raw["url"]).rstrip("/")
    return HostSettings(name=name, url=url, username=str(raw.get("username") or DEFAULT_NODE_USERNAME),
                        password_env=str(raw["password_env"]),
                        address=str(raw.get("address") or urlsplit(url).hostname or ""),
                        cpu_budget_mib=raw.get("cpu_budget_mib"))


def _tenant(name: str, raw: Mapping[str, Any]) -> TenantSettings:
    limits, budget = raw.get("limits") or {}, raw.get("budget") or {}
    return TenantSettings(name=name, fairness_key=str(raw["fairness_key"]).strip(),
                          key_env=tuple(raw.get("key_env") or ()), key_sha256=tuple(raw.get("key_sha256") or ()),
                          weight=raw.get("weight"), priority=raw.get("priority"),
                          models=tuple(raw.get("models") or ("*",)),
                          allow_remote=bool(raw.get("allow_remote", False)),
                          requests_per_minute=limits.get("requests_per_minute"),
                          tokens_per_minute=limits.get("tokens_per_minute"),
                          budget_period=str(budget.get("period") or "month"), budget_tokens=budget.get("tokens"),
                          budget_cost=budget.get("cost"))


def _fairness(engine: Mapping[str, Any], tenants: Mapping[str, TenantSettings]) -> dict[str, Any]:
    """engine.fairness, with each tenant's weight for its fairness key (a tenant's own wins)."""
    fairness = dict(engine.get("fairness") or {})
    weights = {t.fairness_key: t.weight for t in tenants.values() if t.weight is not None}
    if weights:
        fairness["weights"] = {**(fairness.get("weights") or {}), **weights}
    return fairness


def load_settings(config: str | os.PathLike[str] | None = None, strict: bool = False) -> Settings:
    """Load, merge and validate; raise ConfigError listing every problem found (a key given twice in
    one mapping among them). Unknown keys are returned as `Settings.warnings` (the ConfigError's
    `warnings` when there are problems), or are problems too when `strict`."""
    doc, sources, origins, duplicates = load_document(config)
    problems, warnings = schema_findings(doc, origins, strict)
    problems = duplicates + problems
    if problems:
        raise ConfigError(problems, tuple(warnings))
    base_dir = sources[0].resolve().parent
    service = {**DEFAULT_SERVICE, **doc.get("service", {})}
    supervisor = {**DEFAULT_SUPERVISOR, **doc.get("supervisor", {})}
    engine = doc.get("engine", {})
    lifecycle = {**DEFAULT_LIFECYCLE, **(engine.get("lifecycle") or {})}
    memory = {**DEFAULT_MEMORY, **(lifecycle.pop("memory", None) or {})}
    state_dir = Path(_resolve(service.get("state_dir") or default_state_dir(), base_dir))
    programs_dir = Path(_resolve(supervisor["programs_dir"], base_dir)) if supervisor.get("programs_dir") \
        else state_dir / "programs"
    tenants = {name: _tenant(name, raw) for name, raw in (doc.get("tenants") or {}).items()}
    settings = Settings(
        service=ServiceSettings(host=service["host"], port=int(service["port"]),
                                log_level=str(service["log_level"]).lower(), state_dir=state_dir,
                                max_body_bytes=int(service["max_body_bytes"]),
                                drain_timeout_s=float(service["drain_timeout_s"]),
                                reload_timeout_s=float(service["reload_timeout_s"]),
                                admin_token_env=service.get("admin_token_env"),
                                admin_host=service.get("admin_host"), admin_port=service.get("admin_port"),
                                admin_allow_unauthenticated_remote=bool(
                                    service.get("admin_allow_unauthenticated_remote", False)),
                                server_names=tuple(str(n) for n in service.get("server_names") or ()),
                                workers=int(service.get("workers", 1)),
                                **{k: type(v)(service.get(k, v)) for k, v in DEFAULT_RELIABILITY.items()}),
        supervisor=SupervisorSettings(mode=supervisor["mode"], url=supervisor.get("url"), programs_dir=programs_dir,
                                      port_range=(int(supervisor["port_range"][0]), int(supervisor["port_range"][1])),
                                      poll_interval_s=float(supervisor["poll_interval_s"]),
                                      rpc_timeout_s=float(supervisor["rpc_timeout_s"]),
                                      stopwaitsecs=int(supervisor["stopwaitsecs"]),
                                      pass_env=tuple(supervisor["pass_env"] or ()),
                                      hosts={n: _host(n, h) for n, h in (supervisor.get("hosts") or {}).items()}),
        decoding=dict(engine.get("decoding") or {}),
        fairness=_fairness(engine, tenants),
        models={name: _model(name, raw, engine.get("backend"), base_dir, lifecycle, engine.get("routing"))
                for name, raw in (engine.get("models") or {}).items()},
        sources=sources,
        lifecycle=LifecycleSettings(max_loaded_models=lifecycle["max_loaded_models"],
                                    swap_max_wait_s=float(lifecycle["swap_max_wait_s"]),
                                    min_residence_s=float(lifecycle["min_residence_s"]),
                                    kv_store_mib=float(lifecycle["kv_store_mib"]),
                                    thrash_window_s=float(lifecycle["thrash_window_s"]),
                                    gpu_headroom_mib=memory["gpu_headroom_mib"],
                                    cpu_budget_mib=memory["cpu_budget_mib"],
                                    footprint_margin=float(memory["footprint_margin"]),
                                    footprint_percentile=float(memory["footprint_percentile"])),
        warnings=tuple(warnings),
        origins=origins,
        tenants=tenants,
        aliases=dict(engine.get("aliases") or {}),
        batches=BatchSettings(**(engine.get("batches") or {})),
    )
    problems = semantic_problems(settings)
    if problems:
        raise ConfigError(problems, settings.warnings)
    return settings
