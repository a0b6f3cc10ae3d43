"""Settings: conf/pool.yaml deep-merged with conf/local.yaml, validated against conf/schema.json.

YAML is a superset of JSON, so an llm-pool settings.json loads unchanged, and its config/local.json
beside it is merged the same way. Every problem is reported with the exact path and the rule it
breaks, and the whole document is checked before anything starts. An unknown key is a warning with
the closest known name, never a stop (an older or newer settings file must keep the service up);
`strict` makes warnings errors.
"""
from __future__ import annotations

import difflib
import json
import os
import platform
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO_ROOT / "conf" / "schema.json"
DEFAULT_SETTINGS = REPO_ROOT / "conf" / "pool.yaml"
# The llama-cpp-python release whose vendored llama.cpp `llm-pool setup` builds llama-server from.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"


def cache_root() -> Path:
    """Where llm-pool keeps what it builds once per machine (llama-server, wheels, engine
    environments, tiny models): outside the repo, so clones and CI runs share it."""
    base = os.environ.get("LLM_POOL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llm-pool")
    return Path(base)


def cached_llama_server(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Where `llm-pool setup` puts the llama-server build for `version` (whether or not it exists yet)."""
    return cache_root() / "llama-server" / f"{version}-{platform.machine()}" / "llama-server"

DEFAULT_SERVICE = {"host": "127.0.0.1", "port": 8011, "log_level": "info", "max_body_bytes": 32 * 1024 * 1024,
                   "drain_timeout_s": 30.0, "admin_token_env": None}
# Reliability defaults (README: Timeouts, health and ejection). A long prefill on a big model is
# legitimate, so the first byte gets minutes; a stream that goes quiet mid-answer does not.
DEFAULT_RELIABILITY: dict[str, Any] = {"first_byte_timeout_s": 600.0, "stream_idle_timeout_s": 120.0,
                       "max_response_bytes": 64 * 1024 * 1024, "health_interval_s": 5.0, "health_timeout_s": 5.0,
                       "eject_after_failures": 5, "eject_base_s": 30.0, "eject_max_s": 300.0,
                       "load_retry_base_s": 5.0, "load_retry_max_s": 300.0}
DEFAULT_SUPERVISOR = {"mode": "managed", "url": None, "programs_dir": None, "port_range": [18100, 18999],
                      "poll_interval_s": 0.2, "rpc_timeout_s": 10.0, "stopwaitsecs": 15, "pass_env": []}
DEFAULT_MODEL = {"enabled": False, "replicas": 1, "target_inflight": 1, "modalities": ["text"], "gpus": []}

# Fields that name files: relative values resolve against the base settings file's folder, so a
# config means the same thing whatever the current directory of the process that reads it.
PATH_FIELDS = ("model_path", "llama_server_binary", "llama_server_mmproj_path", "llama_server_draft_model_path",
               "llama_server_media_path", "vllm_serve_binary")
PATH_LIST_FIELDS = ("llama_server_library_path", "vllm_serve_library_path")
# A unix socket path longer than this does not fit in sockaddr_un on Linux.
MAX_SOCKET_PATH = 107


class ConfigError(Exception):
    """The settings are unusable; `problems` holds one `path: message` line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ServiceSettings:
    host: str
    port: int
    log_level: str
    state_dir: Path
    max_body_bytes: int
    drain_timeout_s: float
    admin_token_env: str | None
    admin_host: str | None = None       # with admin_port: the admin API listens there, and only there
    admin_port: int | None = None
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

    def get(self, key: str, default: Any = None) -> Any:
        value = self.options.get(key)
        return default if value is None else value

    def with_overrides(self, overrides: Mapping[str, Any]) -> "ModelConfig":
        options = {**self.options, **overrides}
        return replace(self, options=options, replicas=overrides.get("replicas", self.replicas),
                       target_inflight=overrides.get("target_inflight", self.target_inflight))


@dataclass(frozen=True)
class Settings:
    service: ServiceSettings
    supervisor: SupervisorSettings
    decoding: Mapping[str, Any]
    fairness: Mapping[str, Any]
    models: Mapping[str, ModelConfig]
    sources: tuple[Path, ...]
    warnings: tuple[str, ...] = ()         # unknown keys, each with the closest known name

    @property
    def socket_path(self) -> Path:
        return self.service.state_dir / "supervisor.sock"

    @property
    def supervisor_url(self) -> str:
        if self.supervisor.mode == "external":
            assert self.supervisor.url
            return self.supervisor.url
        return f"unix://{self.socket_path}"


def deep_merge(base: Any, over: Any) -> Any:
    """`over` wins per key; mappings merge recursively, anything else (lists too) is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        merged = dict(base)
        for key, value in over.items():
            merged[key] = deep_merge(base[key], value) if key in base else value
        return merged
    return over


def _read_document(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{where}: invalid YAML: {problem}"]) from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError([f"{path}: the top level must be a mapping, not {type(doc).__name__}"])
    return doc


def settings_paths(config: str | os.PathLike[str] | None = None) -> tuple[Path, Path]:
    """The base and local settings paths: explicit argument, then environment, then conf/.

    The local file sits beside the base file and has its extension: settings.json pairs with
    local.json (the seed's layout), pool.yaml with local.yaml.
    """
    base = Path(config or os.environ.get("LLM_POOL_SETTINGS_PATH") or DEFAULT_SETTINGS).expanduser()
    local_env = os.environ.get("LLM_POOL_LOCAL_SETTINGS_PATH")
    local = Path(local_env).expanduser() if local_env else base.with_name("local" + (base.suffix or ".yaml"))
    return base, local


def load_document(config: str | os.PathLike[str] | None = None) -> tuple[dict[str, Any], tuple[Path, ...]]:
    base, local = settings_paths(config)
    if not base.exists():
        raise ConfigError([f"{base}: settings file not found"])
    doc = _read_document(base)
    sources = [base]
    if local.exists():
        doc = deep_merge(doc, _read_document(local))
        sources.append(local)
    return doc, tuple(sources)


def _json_path(parts: Any) -> str:
    return ".".join(str(p) for p in parts) or "(top level)"


def _with_effective_backends(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """The document with each model's effective backend (its own, else engine.backend) written in,
    so that the schema's backend-specific rules judge a model by the backend it will really run."""
    engine = doc.get("engine")
    if not isinstance(engine, dict) or not isinstance(engine.get("models"), dict) or not engine.get("backend"):
        return doc
    models = {name: ({"backend": engine["backend"], **raw} if isinstance(raw, dict) and raw.get("backend") is None
                     else raw) for name, raw in engine["models"].items()}
    return {**doc, "engine": {**engine, "models": models}}


def _unknown_key(path: list[Any], key: str, known: Any) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return f"{_json_path(path + [key])}: unknown field, ignored{hint}"


def schema_findings(doc: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(errors, warnings): errors break a rule and stop the start; warnings are unknown keys."""
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    problems, warnings = [], []
    for err in validator.iter_errors(_with_effective_backends(doc)):
        where = list(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = set(err.schema.get("properties", {}))
            warnings += [_unknown_key(where, key, allowed) for key in sorted(set(err.instance) - allowed)]
            continue
        # A backend-specific rule (an if/then of the schema) says why in its description.
        why = err.schema.get("description") if "then" in err.absolute_schema_path else None
        because = f" ({why})" if why else ""
        if err.validator == "required":
            missing = err.message.split("'")[1] if "'" in err.message else err.message
            problems.append(f"{_json_path(where + [missing])}: required{because}")
            continue
        if "propertyNames" in err.absolute_schema_path:
            problems.append(f"{_json_path(where)}: model id {err.instance!r} must be 1-128 characters of "
                            "letters, digits and ._:@+- (model ids are names, never paths)")
            continue
        problems.append(f"{_json_path(where)}: {err.message}{because}")
    return sorted(set(problems)), sorted(set(warnings))


def schema_problems(doc: Mapping[str, Any]) -> list[str]:
    """Every rule broken, unknown keys included (what `check-config --strict` reports)."""
    problems, warnings = schema_findings(doc)
    return sorted(problems + warnings)


def _resolve(value: str, base_dir: Path) -> str:
    path = Path(os.path.expandvars(value)).expanduser()
    return str(path if path.is_absolute() else (base_dir / path).resolve())


def _model(name: str, raw: Mapping[str, Any], engine_backend: str | None, base_dir: Path) -> ModelConfig:
    data = {**DEFAULT_MODEL, **{k: v for k, v in raw.items() if v is not None or k not in DEFAULT_MODEL}}
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
    )


def secret_env_names(settings: Settings) -> set[str]:
    """Variables that hold the proxy's secrets: the admin token's, and every variable a model names
    in a `*_env` field (provider API keys). Model servers never see them."""
    names = {settings.service.admin_token_env} if settings.service.admin_token_env else set()
    for model in settings.models.values():
        names.update(v for k, v in model.options.items() if k.endswith("_env") and isinstance(v, str) and v)
    return names


def semantic_problems(settings: Settings) -> list[str]:
    problems = []
    if len(str(settings.socket_path)) > MAX_SOCKET_PATH and settings.supervisor.mode == "managed":
        problems.append(f"service.state_dir: {settings.service.state_dir} is too long for a unix socket path; "
                        "choose a shorter folder")
    for name in sorted(set(settings.supervisor.pass_env) & secret_env_names(settings)):
        problems.append(f"supervisor.pass_env: {name} holds a secret of the proxy (named by admin_token_env "
                        "or a *_env field); model servers never get it")
    if settings.service.admin_port is not None and settings.service.admin_port == settings.service.port:
        problems.append(f"service.admin_port: {settings.service.admin_port} is service.port; the admin listener "
                        "needs a port of its own")
    lo, hi = settings.supervisor.port_range
    if lo > hi:
        problems.append(f"supervisor.port_range: start {lo} is above end {hi}")
    for name, model in settings.models.items():
        where = f"engine.models.{name}"
        if not model.backend:
            problems.append(f"{where}.backend: required (or set engine.backend)")
        if model.replicas > model.replica_max:
            problems.append(f"{where}.replicas: {model.replicas} is above replica_max {model.replica_max}")
    return problems


def load_settings(config: str | os.PathLike[str] | None = None, strict: bool = False) -> Settings:
    """Load, merge and validate; raise ConfigError listing every problem found. Unknown keys are
    returned as `Settings.warnings`, or are problems too when `strict`."""
    doc, sources = load_document(config)
    problems, warnings = schema_findings(doc)
    if strict:
        problems, warnings = sorted(problems + warnings), []
    if problems:
        raise ConfigError(problems)
    base_dir = sources[0].resolve().parent
    service = {**DEFAULT_SERVICE, **doc.get("service", {})}
    supervisor = {**DEFAULT_SUPERVISOR, **doc.get("supervisor", {})}
    engine = doc.get("engine", {})
    state_dir = Path(_resolve(service.get("state_dir") or
                              os.path.join(os.environ.get("XDG_STATE_HOME") or "~/.local/state", "llm-pool"),
                              base_dir))
    programs_dir = Path(_resolve(supervisor["programs_dir"], base_dir)) if supervisor.get("programs_dir") \
        else state_dir / "programs"
    settings = Settings(
        service=ServiceSettings(host=service["host"], port=int(service["port"]),
                                log_level=str(service["log_level"]).lower(), state_dir=state_dir,
                                max_body_bytes=int(service["max_body_bytes"]),
                                drain_timeout_s=float(service["drain_timeout_s"]),
                                admin_token_env=service.get("admin_token_env"),
                                admin_host=service.get("admin_host"), admin_port=service.get("admin_port"),
                                **{k: type(v)(service.get(k, v)) for k, v in DEFAULT_RELIABILITY.items()}),
        supervisor=SupervisorSettings(mode=supervisor["mode"], url=supervisor.get("url"), programs_dir=programs_dir,
                                      port_range=(int(supervisor["port_range"][0]), int(supervisor["port_range"][1])),
                                      poll_interval_s=float(supervisor["poll_interval_s"]),
                                      rpc_timeout_s=float(supervisor["rpc_timeout_s"]),
                                      stopwaitsecs=int(supervisor["stopwaitsecs"]),
                                      pass_env=tuple(supervisor["pass_env"] or ())),
        decoding=dict(engine.get("decoding") or {}),
        fairness=dict(engine.get("fairness") or {}),
        models={name: _model(name, raw, engine.get("backend"), base_dir)
                for name, raw in (engine.get("models") or {}).items()},
        sources=sources,
        warnings=tuple(warnings),
    )
    problems = semantic_problems(settings)
    if problems:
        raise ConfigError(problems)
    return settings


def override_problems(model: ModelConfig, overrides: Mapping[str, Any], allowed: tuple[str, ...]) -> list[str]:
    """Problems with temporary load overrides: only the backend's live knobs, each valid per the schema."""
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    properties = schema["$defs"]["model"]["properties"]
    problems = []
    for key, value in overrides.items():
        if key not in allowed:
            problems.append(f"overrides.{key}: not a live override for backend {model.backend!r}; "
                            f"allowed: {', '.join(allowed) or 'none'}")
            continue
        for err in jsonschema.Draft202012Validator(properties[key]).iter_errors(value):
            problems.append(f"overrides.{key}: {err.message}")
    return problems


def replicas_problem(value: object, replica_max: int) -> str | None:
    """The one rule for a replica count a load or a scale asks for."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= replica_max:
        return f"replicas: must be an integer from 1 to replica_max ({replica_max})"
    return None
