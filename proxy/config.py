"""Settings: conf/pool.yaml deep-merged with conf/local.yaml, validated against conf/schema.json.

YAML is a superset of JSON, so an llm-pool settings.json loads unchanged, and its config/local.json
beside it is merged the same way. Every problem is reported with the exact path and the rule it
breaks, and the whole document is checked before anything starts. An unknown key is a warning with
the closest known name, never a stop (an older or newer settings file must keep the service up);
`strict` makes warnings errors.
"""
from __future__ import annotations

import difflib
import ipaddress
import json
import os
import platform
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping
from urllib.parse import urlsplit

import jsonschema
import yaml

from shims.prompts import FORMATS as PROMPT_FORMATS

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
                   "drain_timeout_s": 30.0, "reload_timeout_s": 120.0, "admin_token_env": None}
# Reliability defaults (README: Timeouts, health and ejection). A long prefill on a big model is
# legitimate, so the first byte gets minutes; a stream that goes quiet mid-answer does not.
DEFAULT_RELIABILITY: dict[str, Any] = {"first_byte_timeout_s": 600.0, "stream_idle_timeout_s": 120.0,
                       "max_response_bytes": 64 * 1024 * 1024, "health_interval_s": 5.0, "health_timeout_s": 5.0,
                       "eject_after_failures": 5, "eject_base_s": 30.0, "eject_max_s": 300.0,
                       "load_retry_base_s": 5.0, "load_retry_max_s": 300.0}
DEFAULT_SUPERVISOR = {"mode": "managed", "url": None, "programs_dir": None, "port_range": [18100, 18999],
                      "poll_interval_s": 0.2, "rpc_timeout_s": 10.0, "stopwaitsecs": 15, "pass_env": []}
# engine.lifecycle (README: More models than memory). Every default keeps the behaviour from before
# it existed: models load only when enabled or an admin loads them, stay until unloaded, and no load
# is refused for memory.
DEFAULT_LIFECYCLE: dict[str, Any] = {"load_on_demand": False, "idle_unload_s": None, "pinned": False,
                                     "max_loaded_models": None, "swap_max_wait_s": 10.0, "min_residence_s": 5.0}
DEFAULT_MEMORY: dict[str, Any] = {"gpu_headroom_mib": None, "cpu_budget_mib": None, "footprint_margin": 0.1,
                                  "footprint_percentile": 90}
# The per-model keys that default to the same key under engine.lifecycle.
MODEL_LIFECYCLE_FIELDS = ("load_on_demand", "idle_unload_s", "pinned")
DEFAULT_MODEL = {"enabled": False, "replicas": 1, "target_inflight": 1, "modalities": ["text"], "gpus": []}
# Replica routing (README: Replica routing and affinity). Affinity by default: every engine reuses
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
# A unix socket path longer than this does not fit in sockaddr_un on Linux.
MAX_SOCKET_PATH = 107


class ConfigError(Exception):
    """The settings are unusable; `problems` holds one `path: message` line each, `warnings` the
    unknown keys found on the way (shown with the problems, never hidden by them)."""

    def __init__(self, problems: list[str], warnings: tuple[str, ...] = ()) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems
        self.warnings = warnings


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
    # this says it is meant (README: Security): anyone who reaches it can load and unload models.
    admin_allow_unauthenticated_remote: bool = False
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
    gpu_headroom_mib: float | None = None    # None: GPU memory does not limit loads
    cpu_budget_mib: float | None = None      # None: CPU memory does not limit loads
    footprint_margin: float = DEFAULT_MEMORY["footprint_margin"]
    footprint_percentile: float = DEFAULT_MEMORY["footprint_percentile"]


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

    def get(self, key: str, default: Any = None) -> Any:
        value = self.options.get(key)
        return default if value is None else value

    def with_overrides(self, overrides: Mapping[str, Any]) -> "ModelConfig":
        """These settings with a load's overrides, deep-merged as the config files are: an override
        of one key of a nested field (`{"sim": {"ttft_ms": 5}}`) keeps the field's other keys."""
        options = deep_merge(dict(self.options), dict(overrides))
        return replace(self, options=options, replicas=overrides.get("replicas", self.replicas),
                       target_inflight=overrides.get("target_inflight", self.target_inflight))


Key = tuple[str, ...]


@dataclass(frozen=True)
class Origin:
    """Where a key of the settings was set: its file and (1-based) line."""

    file: Path
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


class Origins:
    """The file and line of every key of the merged settings, so that each message can say where
    to look. A key set in both files as a mapping (a model both define) has both origins; one the
    local file replaces (a value, a list) has only the local one."""

    def __init__(self, by_key: Mapping[Key, tuple[Origin, ...]] | None = None, base: Path | None = None) -> None:
        self.by_key = dict(by_key or {})
        self.base = base
        # Longest first, so a message is placed by the deepest key its path names.
        self._dotted = sorted(((".".join(k), k) for k in self.by_key), key=lambda d: -len(d[0]))

    def where(self, message: str) -> str:
        """`message` (`path: rule`) with the file and line of the deepest key its path names."""
        for dotted, key in self._dotted:
            if message.startswith(dotted) and message[len(dotted):len(dotted) + 1] in (".", ":"):
                return f"{message} ({', '.join(str(o) for o in self.by_key[key])})"
        return message

    def misspelt_model(self, name: str) -> str:
        """For a model id only the local file sets: the closest model id of the base file, which the
        local entry was most likely meant to change ("" when there is none)."""
        origins = self.by_key.get(("engine", "models", name), ())
        if not origins or any(o.file == self.base for o in origins):
            return ""
        base_ids = [k[2] for k, found in self.by_key.items()
                    if len(k) == 3 and k[:2] == ("engine", "models") and any(o.file == self.base for o in found)]
        close = difflib.get_close_matches(name, sorted(base_ids), n=1, cutoff=0.6)
        if not close:
            return ""
        return f"; `{name}` is set only in {origins[0].file}: did you mean `{close[0]}` of {self.base}?"


def _key_origins(node: yaml.Node, file: Path, key: Key = (), seen: frozenset[int] = frozenset()
                 ) -> Iterator[tuple[Key, Origin]]:
    """Every key (and list item) under `node`, pre-order, with the line it starts on."""
    if id(node) in seen:  # an alias of a node that holds itself
        return
    seen = seen | {id(node)}
    if isinstance(node, yaml.MappingNode):
        items = [(str(k.value), k, v) for k, v in node.value]
    elif isinstance(node, yaml.SequenceNode):
        items = [(str(i), v, v) for i, v in enumerate(node.value)]
    else:
        return
    for name, at, value in items:
        yield key + (name,), Origin(file, at.start_mark.line + 1)
        yield from _key_origins(value, file, key + (name,), seen)


def _duplicate_keys(node: yaml.Node, file: Path, key: Key = (), seen: frozenset[int] = frozenset()
                    ) -> Iterator[str]:
    """A key given twice in one mapping, with both lines: YAML keeps the last one and drops the
    other without a word. Read from the composed nodes, before a merge key (`<<`) adds its keys,
    which a mapping may override by design."""
    if id(node) in seen:
        return
    seen = seen | {id(node)}
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for k, v in node.value:
            name = str(k.value)
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                line = k.start_mark.line + 1
                if (k.tag, name) in first:
                    yield (f"{_json_path(key + (name,))}: set twice in one mapping ({file}:{first[k.tag, name]} "
                           f"and {file}:{line}); YAML keeps only the last, so remove one")
                first.setdefault((k.tag, name), line)
            yield from _duplicate_keys(v, file, key + (name,), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicate_keys(item, file, key + (str(i),), seen)


def _value_at(doc: Any, key: Key) -> Any:
    for part in key:
        if isinstance(doc, dict):
            doc = doc[part] if part in doc else next((v for k, v in doc.items() if str(k) == part), None)
        elif isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        else:
            return None
    return doc


def _merge_origins(by_key: dict[Key, tuple[Origin, ...]], base_doc: Any, over: list[tuple[Key, Origin]],
                   over_doc: Any) -> None:
    """What deep_merge does to the values, done to their origins (`over` in pre-order)."""
    for key, origin in over:
        if key in by_key:
            if isinstance(_value_at(base_doc, key), dict) and isinstance(_value_at(over_doc, key), dict):
                by_key[key] += (origin,)
                continue
            for old in [k for k in by_key if k[:len(key)] == key]:
                del by_key[old]
        by_key[key] = (origin,)


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


def deep_merge(base: Any, over: Any) -> Any:
    """`over` wins per key; mappings merge recursively, anything else (lists too) is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        merged = dict(base)
        for key, value in over.items():
            merged[key] = deep_merge(base[key], value) if key in base else value
        return merged
    return over


def changed(base: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """What `current` sets differently from `base`; of a nested mapping, only the keys that differ."""
    found: dict[str, Any] = {}
    for key, value in current.items():
        was = base.get(key)
        if isinstance(was, dict) and isinstance(value, dict):
            if inner := changed(was, value):
                found[key] = inner
        elif was != value:
            found[key] = value
    return found


def _read_document(path: Path) -> tuple[dict[str, Any], list[tuple[Key, Origin]], list[str]]:
    """The file's document, the line of each of its keys (from the composed nodes' marks; JSON
    is YAML, so a settings.json has its lines too) and its keys given twice in one mapping."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        duplicates = list(_duplicate_keys(node, path)) if node is not None else []
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
    return doc, list(_key_origins(node, path)), duplicates


def settings_paths(config: str | os.PathLike[str] | None = None) -> tuple[Path, Path]:
    """The base and local settings paths: explicit argument, then environment, then conf/.

    The local file sits beside the base file and has its extension: settings.json pairs with
    local.json (the seed's layout), pool.yaml with local.yaml.
    """
    base = Path(config or os.environ.get("LLM_POOL_SETTINGS_PATH") or DEFAULT_SETTINGS).expanduser()
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
        _merge_origins(by_key, doc, local_keys, local_doc)
        doc = deep_merge(doc, local_doc)
        sources.append(local)
        duplicates += local_duplicates
    return doc, tuple(sources), Origins(by_key, base), duplicates


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


def did_you_mean(given: str, known: Any) -> str:
    """`; did you mean `x`?` naming the closest of `known`, or "" when none is close."""
    close = difflib.get_close_matches(given, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else ""


def _unknown_key(path: list[Any], key: str, known: Any) -> str:
    return f"{_json_path(path + [key])}: unknown field, ignored{did_you_mean(key, known)}"


def model_properties() -> dict[str, Any]:
    """conf/schema.json's rule for each field of a model definition (load overrides are checked,
    shown and documented by these)."""
    properties: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))["$defs"]["model"]["properties"]
    return properties


def schema_findings(doc: Mapping[str, Any], origins: Origins | None = None) -> tuple[list[str], list[str]]:
    """(errors, warnings): errors break a rule and stop the start; warnings are unknown keys. Without
    `origins`, messages say no file."""
    origins = origins or Origins()
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
            typo = origins.misspelt_model(str(where[2])) if where[:2] == ["engine", "models"] and len(where) == 3 \
                else ""
            problems.append(f"{_json_path(where + [missing])}: required{because}{typo}")
            continue
        if "propertyNames" in err.absolute_schema_path:
            problems.append(f"{_json_path(where)}: model id {err.instance!r} must be 1-128 characters of "
                            "letters, digits and ._:@+- (model ids are names, never paths)")
            continue
        problems.append(f"{_json_path(where)}: {err.message}{because}")
    return sorted({origins.where(p) for p in problems}), sorted({origins.where(w) for w in warnings})


def schema_problems(doc: Mapping[str, Any], origins: Origins | None = None) -> list[str]:
    """Every rule broken, unknown keys included (what `check-config --strict` reports)."""
    problems, warnings = schema_findings(doc, origins)
    return sorted(problems + warnings)


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
    )


def _host(name: str, raw: Mapping[str, Any]) -> HostSettings:
    url = str(raw["url"]).rstrip("/")
    return HostSettings(name=name, url=url, username=str(raw.get("username") or DEFAULT_NODE_USERNAME),
                        password_env=str(raw["password_env"]),
                        address=str(raw.get("address") or urlsplit(url).hostname or ""),
                        cpu_budget_mib=raw.get("cpu_budget_mib"))


def secret_env_names(settings: Settings) -> set[str]:
    """Variables that hold the proxy's secrets: the admin token's, and every variable a model names
    in a `*_env` field (provider API keys). Model servers never see them."""
    names = {settings.service.admin_token_env} if settings.service.admin_token_env else set()
    names.update(h.password_env for h in settings.supervisor.hosts.values())
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
    hosts = settings.supervisor.host_names
    if LOCAL_HOST in settings.supervisor.hosts:
        problems.append(f"supervisor.hosts.{LOCAL_HOST}: the name is this machine's own supervisord; give the "
                        "host another name")
    if settings.supervisor.mode == "hosts" and not settings.supervisor.hosts:
        problems.append("supervisor.mode: hosts needs at least one host in supervisor.hosts")
    for name, model in settings.models.items():
        for host in model.hosts:
            if host not in hosts:
                problems.append(f"engine.models.{name}.hosts: {host!r} is not a host here"
                                f"{did_you_mean(host, hosts)} (hosts: {', '.join(hosts) or 'none'})")
    lo, hi = settings.supervisor.port_range
    if lo > hi:
        problems.append(f"supervisor.port_range: start {lo} is above end {hi}")
    for name, model in settings.models.items():
        where = f"engine.models.{name}"
        if not model.backend:
            problems.append(f"{where}.backend: required (or set engine.backend){settings.origins.misspelt_model(name)}")
        if model.replicas > model.replica_max:
            problems.append(f"{where}.replicas: {model.replicas} is above replica_max {model.replica_max}")
        # The renderers' own list (shims/prompts.py) is the one source: an unknown name loaded, showed
        # READY and then failed every request with a 400 that blamed the client.
        prompt_format = model.options.get("prompt_format")
        if prompt_format is not None and prompt_format not in PROMPT_FORMATS:
            problems.append(f"{where}.prompt_format: {prompt_format!r} is not a prompt format llm-pool knows"
                            f"{did_you_mean(prompt_format, PROMPT_FORMATS)} (one of {', '.join(PROMPT_FORMATS)})")
    return [settings.where(p) for p in problems]


def load_settings(config: str | os.PathLike[str] | None = None, strict: bool = False) -> Settings:
    """Load, merge and validate; raise ConfigError listing every problem found (a key given twice in
    one mapping among them). Unknown keys are returned as `Settings.warnings` (the ConfigError's
    `warnings` when there are problems), or are problems too when `strict`."""
    doc, sources, origins, duplicates = load_document(config)
    problems, warnings = schema_findings(doc, origins)
    if strict:
        problems, warnings = sorted(problems + warnings), []
    problems = duplicates + problems
    if problems:
        raise ConfigError(problems, tuple(warnings))
    base_dir = sources[0].resolve().parent
    service = {**DEFAULT_SERVICE, **doc.get("service", {})}
    supervisor = {**DEFAULT_SUPERVISOR, **doc.get("supervisor", {})}
    engine = doc.get("engine", {})
    lifecycle = {**DEFAULT_LIFECYCLE, **(engine.get("lifecycle") or {})}
    memory = {**DEFAULT_MEMORY, **(lifecycle.pop("memory", None) or {})}
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
                                reload_timeout_s=float(service["reload_timeout_s"]),
                                admin_token_env=service.get("admin_token_env"),
                                admin_host=service.get("admin_host"), admin_port=service.get("admin_port"),
                                admin_allow_unauthenticated_remote=bool(
                                    service.get("admin_allow_unauthenticated_remote", False)),
                                **{k: type(v)(service.get(k, v)) for k, v in DEFAULT_RELIABILITY.items()}),
        supervisor=SupervisorSettings(mode=supervisor["mode"], url=supervisor.get("url"), programs_dir=programs_dir,
                                      port_range=(int(supervisor["port_range"][0]), int(supervisor["port_range"][1])),
                                      poll_interval_s=float(supervisor["poll_interval_s"]),
                                      rpc_timeout_s=float(supervisor["rpc_timeout_s"]),
                                      stopwaitsecs=int(supervisor["stopwaitsecs"]),
                                      pass_env=tuple(supervisor["pass_env"] or ()),
                                      hosts={n: _host(n, h) for n, h in (supervisor.get("hosts") or {}).items()}),
        decoding=dict(engine.get("decoding") or {}),
        fairness=dict(engine.get("fairness") or {}),
        models={name: _model(name, raw, engine.get("backend"), base_dir, lifecycle, engine.get("routing"))
                for name, raw in (engine.get("models") or {}).items()},
        sources=sources,
        lifecycle=LifecycleSettings(max_loaded_models=lifecycle["max_loaded_models"],
                                    swap_max_wait_s=float(lifecycle["swap_max_wait_s"]),
                                    min_residence_s=float(lifecycle["min_residence_s"]),
                                    gpu_headroom_mib=memory["gpu_headroom_mib"],
                                    cpu_budget_mib=memory["cpu_budget_mib"],
                                    footprint_margin=float(memory["footprint_margin"]),
                                    footprint_percentile=float(memory["footprint_percentile"])),
        warnings=tuple(warnings),
        origins=origins,
    )
    problems = semantic_problems(settings)
    if problems:
        raise ConfigError(problems, settings.warnings)
    return settings


def override_problems(model: ModelConfig, overrides: Mapping[str, Any], allowed: tuple[str, ...]) -> list[str]:
    """Problems with temporary load overrides: only the backend's live knobs, each valid per the schema."""
    properties = model_properties()
    problems = []
    for key, value in overrides.items():
        config_only = _config_only({"properties": properties}, {key: value}, "overrides")
        if config_only:
            problems += config_only
            continue
        if key not in allowed:
            problems.append(f"overrides.{key}: not a live override for backend {model.backend!r}; "
                            f"allowed: {', '.join(allowed) or 'none'}")
            continue
        for err in jsonschema.Draft202012Validator(properties[key]).iter_errors(value):
            problems.append(f"overrides.{key}: {err.message}")
    return problems


def _config_only(rule: Mapping[str, Any], value: Any, where: str) -> list[str]:
    """The keys of `value`, at any depth (`overrides.sim.python`), that the schema marks readOnly:
    they name what runs (an executable, a path, a library), which only the config files choose."""
    if not isinstance(value, Mapping):
        return []
    found = []
    for key, inner in value.items():
        sub = rule.get("properties", {}).get(key, {})
        if sub.get("readOnly") and inner is not None:   # a null only removes it: the default is the config's
            found.append(f"{where}.{key}: set in the config files only (it names an executable, a path or a "
                         "library); a load cannot set it")
        else:
            found += _config_only(sub, inner, f"{where}.{key}")
    return found


def override_rule(rule: Mapping[str, Any]) -> dict[str, Any]:
    """A field's schema rule as a load override may use it: a readOnly field only as null (removed
    for that load), an object without its readOnly keys."""
    if rule.get("readOnly"):
        return {"type": "null", "description": "set in the config files only; a load may remove it"}
    shown = dict(rule)
    if isinstance(rule.get("properties"), Mapping):
        shown["properties"] = {k: override_rule(v) for k, v in rule["properties"].items() if not v.get("readOnly")}
    return shown


def replicas_problem(value: object, replica_max: int) -> str | None:
    """The one rule for a replica count a load or a scale asks for."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= replica_max:
        return f"replicas: must be an integer from 1 to replica_max ({replica_max})"
    return None
