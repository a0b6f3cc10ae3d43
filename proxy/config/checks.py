"""The rules a settings document must meet: conf/schema.json's (unknown keys are warnings with the
closest known name), those across fields the schema cannot state (`semantic_problems`), and those of
what a load may ask for (overrides, replica counts)."""
from __future__ import annotations

import difflib
import hashlib
import json
from fnmatch import fnmatchcase
from typing import Any, Mapping, Sequence

import jsonschema

from proxy.config import files
from proxy.config.model import ModelConfig
from proxy.config.origins import Origins, json_path
from proxy.config.settings import LOCAL_HOST, Settings
from shims.prompts import FORMATS as PROMPT_FORMATS

# A unix socket path longer than this does not fit in sockaddr_un on Linux.
MAX_SOCKET_PATH = 107


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


def _unknown_key(path: list[Any], key: str, known: Any, strict: bool) -> str:
    verdict = "refused under --strict" if strict else "ignored"
    return f"{json_path(path + [key])}: unknown field, {verdict}{did_you_mean(key, known)}"


def model_properties() -> dict[str, Any]:
    """conf/schema.json's rule for each field of a model definition (load overrides are checked,
    shown and documented by these)."""
    schema = json.loads(files.SCHEMA_PATH.read_text(encoding="utf-8"))
    properties: dict[str, Any] = schema["$defs"]["model"]["properties"]
    return properties


def schema_findings(doc: Mapping[str, Any], origins: Origins | None = None,
                    strict: bool = False) -> tuple[list[str], list[str]]:
    """(errors, warnings): errors break a rule and stop the start; warnings are unknown keys, or
    errors too when `strict` (check-config --strict), each message saying which. Without `origins`,
    messages say no file."""
    origins = origins or Origins()
    schema = json.loads(files.SCHEMA_PATH.read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    problems: list[str] = []
    warnings: list[str] = []
    for err in validator.iter_errors(_with_effective_backends(doc)):
        where = list(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = set(err.schema.get("properties", {}))
            unknown = [_unknown_key(where, key, allowed, strict) for key in sorted(set(err.instance) - allowed)]
            (problems if strict else warnings).extend(unknown)
            continue
        # A backend-specific rule (an if/then of the schema) says why in its description.
        why = err.schema.get("description") if "then" in err.absolute_schema_path else None
        because = f" ({why})" if why else ""
        if err.validator == "required":
            missing = err.message.split("'")[1] if "'" in err.message else err.message
            typo = origins.misspelt_model(str(where[2])) if where[:2] == ["engine", "models"] and len(where) == 3 \
                else ""
            problems.append(f"{json_path(where + [missing])}: required{because}{typo}")
            continue
        if "propertyNames" in err.absolute_schema_path and where[:1] == ["tenants"]:
            problems.append(f"{json_path(where)}: tenant name {err.instance!r} must be 1-64 characters of "
                            "letters, digits and ._- (it names the tenant in admin paths and metric labels)")
            continue
        if "propertyNames" in err.absolute_schema_path and where[-1:] == ["lora_adapters"]:
            problems.append(f"{json_path(where)}: adapter name {err.instance!r} must be 1-64 characters of "
                            "letters, digits and ._@+- (its model id is `<model>:<name>`)")
            continue
        if "propertyNames" in err.absolute_schema_path:
            problems.append(f"{json_path(where)}: model id {err.instance!r} must be 1-128 characters of "
                            "letters, digits and ._:@+- (model ids are names, never paths)")
            continue
        problems.append(f"{json_path(where)}: {err.message}{because}")
    return sorted({origins.where(p) for p in problems}), sorted({origins.where(w) for w in warnings})


def schema_problems(doc: Mapping[str, Any], origins: Origins | None = None) -> list[str]:
    """Every rule broken, unknown keys included (what `check-config --strict` reports)."""
    return schema_findings(doc, origins, strict=True)[0]


def secret_env_names(settings: Settings) -> set[str]:
    """Variables that hold the proxy's secrets: the admin token's, the tenants' keys, and every
    variable a model names in a `*_env` field (provider API keys). Model servers never see them."""
    names = {settings.service.admin_token_env} if settings.service.admin_token_env else set()
    names.update(h.password_env for h in settings.supervisor.hosts.values())
    names.update(var for tenant in settings.tenants.values() for var in tenant.key_env)
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
    problems += _alias_and_fallback_problems(settings) + _adapter_problems(settings) + _class_problems(settings)
    return [settings.where(p) for p in problems]


# The engines that choose an adapter per request (docs/adapters.md); the others would need a load each.
ADAPTER_BACKENDS = ("llama_server", "vllm_serve", "vllm")


def _adapter_problems(settings: Settings) -> list[str]:
    """A LoRA adapter's id is a public model id: no model's, alias's or other adapter's; its base's
    engine serves adapters. Its file is the launcher's to check (launchers/llama_server.py, vllm_serve.py)."""
    problems = []
    seen: dict[str, str] = {}
    for name, model in settings.models.items():
        where = f"engine.models.{name}.lora_adapters"
        if model.adapters and model.backend not in ADAPTER_BACKENDS:
            problems.append(f"{where}: backend {model.backend!r} serves no LoRA adapters per request "
                            f"(one of {', '.join(ADAPTER_BACKENDS)} does)")
        for adapter in model.adapters:
            if adapter.id in settings.models:
                problems.append(f"{where}.{adapter.name}: its id {adapter.id!r} is a model's name; give it an id "
                                "of its own")
            elif adapter.id in settings.aliases:
                problems.append(f"{where}.{adapter.name}: its id {adapter.id!r} is an alias (engine.aliases)")
            elif adapter.id in seen:
                problems.append(f"{where}.{adapter.name}: its id {adapter.id!r} is also {seen[adapter.id]}'s")
            seen.setdefault(adapter.id, f"engine.models.{name}.lora_adapters.{adapter.name}")
    return problems


def _class_problems(settings: Settings) -> list[str]:
    """engine.fairness.classes: each named once, `default` among them; a tenant's priority is one."""
    classes = settings.fairness.get("classes")
    # Unset: proxy/fairness.py's DEFAULT_CLASSES (the settings wing imports none of its siblings).
    names = [str(c["name"]) for c in classes] if classes else ["interactive", "default", "batch"]
    problems = [f"engine.fairness.classes.{i}.name: {name!r} is named twice" for i, name in enumerate(names)
                if name in names[:i]]
    if "default" not in names:
        problems.append("engine.fairness.classes: needs a class named default (a request's class without a "
                        "tenant's priority)")
    for name, tenant in settings.tenants.items():
        if tenant.priority is not None and tenant.priority not in names:
            problems.append(f"tenants.{name}.priority: {tenant.priority!r} is not a priority class"
                            f"{did_you_mean(tenant.priority, names)} (engine.fairness.classes: {', '.join(names)})")
    return problems


def _alias_and_fallback_problems(settings: Settings) -> list[str]:
    """An alias names a model and is none; a fallback names another model (an alias resolves)."""
    problems = []
    models = settings.models
    for alias, target in settings.aliases.items():
        if alias in models:
            problems.append(f"engine.aliases.{alias}: {alias!r} is a model's name; an alias needs a name of its own")
        elif target not in models and target not in settings.adapters:
            problems.append(f"engine.aliases.{alias}: {target!r} is not a configured model"
                            f"{did_you_mean(target, [*models, *settings.adapters])}")
    for name, model in models.items():
        for i, fallback in enumerate(model.fallbacks):
            target = settings.aliases.get(fallback.model, fallback.model)
            if target not in models:
                problems.append(f"engine.models.{name}.fallbacks.{i}: {fallback.model!r} is not a configured model"
                                f"{did_you_mean(fallback.model, [*models, *settings.aliases])}")
            elif target == name:
                problems.append(f"engine.models.{name}.fallbacks.{i}: {fallback.model!r} is the model itself")
    return problems


def tenant_findings(settings: Settings, environ: Mapping[str, str],
                    minted: Sequence[tuple[str, str]] | None) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the tenants' keys and models, as `serve` would take them (Keys.configured:
    each tenant's key_env values, then its key_sha256, then the minted keys; the first tenant to
    name a key keeps it; the admin token's value is dropped). An error where a tenant is left with
    no key that works or no model it may use (no request can be its), a warning otherwise. `minted`:
    the live minted keys (tenant, digest) as the ledger keeps them, None when it cannot be read.
    A message names a key by where the settings give it, or by its id: never a key or a digest."""
    admin_env = settings.service.admin_token_env
    admin_token = environ.get(admin_env, "") if admin_env else ""
    admin_digest = _sha256(admin_token) if admin_token else None
    owner: dict[str, tuple[str, str]] = {}    # digest: (tenant, where it was named), the first wins
    kept: dict[str, set[str]] = {name: set() for name in settings.tenants}
    key_notes: dict[str, list[str]] = {name: [] for name in settings.tenants}

    def named(tenant: str, sha: str, where: str, what: str) -> None:
        if sha == admin_digest:
            key_notes[tenant].append(f"{where}: {what} is the admin token ({admin_env}), which opens the admin "
                                     "API only: that key is dropped")
            return
        first = owner.setdefault(sha, (tenant, where))
        if first[0] == tenant:
            kept[tenant].add(sha)
        else:
            key_notes[tenant].append(f"{where}: {what} is tenant {first[0]}'s key too ({first[1]}, key id "
                                     f"{sha[:12]}); it stays {first[0]}'s, so tenant {tenant} cannot use it")

    for name, tenant in settings.tenants.items():
        for i, var in enumerate(tenant.key_env):
            where = f"tenants.{name}.key_env.{i}"
            value = environ.get(var, "")
            if value:
                named(name, _sha256(value), where, f"the key in {var}")
            else:
                key_notes[name].append(f"{where}: {var} is unset or empty, so that key does not work")
        for i, sha in enumerate(tenant.key_sha256):
            named(name, sha, f"tenants.{name}.key_sha256.{i}", "this digest's key")
    for tenant_name, sha in minted or ():
        if tenant_name in settings.tenants:
            named(tenant_name, sha, f"tenants.{tenant_name}", f"the minted key {sha[:12]}")

    errors: list[str] = []
    warnings: list[str] = []
    for name, tenant in settings.tenants.items():
        unknown = minted is None and not kept[name]   # a minted key may still work: the ledger was unreadable
        if not tenant.key_env and not tenant.key_sha256 and not kept[name]:
            # A warning, not an error: minting needs a running proxy, and check-config is the systemd
            # unit's ExecStartPre, so an error here would keep the first key from ever being minted.
            warnings.append(f"tenants.{name}: the tenant has no key (no key_env, no key_sha256, "
                            f"{'and the ledger of minted keys could not be read' if unknown else 'no key minted'}); "
                            f"no request can be its until one is: set key_env or key_sha256, or mint one "
                            f"(llm-pool ctl keys mint {name})")
        cannot = "; the tenant has no other key, so no request can be its"
        for note in key_notes[name]:
            if kept[name] or unknown:
                warnings.append(note)
            else:
                errors.append(note + cannot)
        allowed = [glob for glob in tenant.models if any(fnmatchcase(m, glob) for m in settings.models)]
        for i, glob in enumerate(tenant.models):
            if glob not in allowed:
                note = f"tenants.{name}.models.{i}: {glob!r} matches no configured model"
                if allowed:
                    warnings.append(note)
                else:
                    errors.append(note + "; the tenant may use no model, so no request can be its")
    warnings += [f"engine.models.{name}.llama_server_extra_args: {flag} turns llama-server's RAM prompt cache "
                 "back on, which the pool turns off where there are tenants: it hands a slot the best-matching "
                 "saved prompt of any slot, so one tenant's cached count can show what another sent"
                 for name, model in settings.models.items() if model.backend == "llama_server"
                 for flag in _RAM_CACHE_FLAGS & {str(a).split("=", 1)[0]
                                                 for a in model.get("llama_server_extra_args") or ()}]
    return [settings.where(e) for e in errors], [settings.where(w) for w in warnings]


# llama-server's RAM prompt cache (proxy/lifecycle/kvcache/keeper.py turns it off with tenants).
_RAM_CACHE_FLAGS = frozenset({"--cache-ram", "-cram"})


def _sha256(key: str) -> str:
    # As proxy/tenants/keys.py's digest(): the settings wing reads no wing above it.
    return hashlib.sha256(key.encode()).hexdigest()


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
