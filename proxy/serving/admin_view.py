"""What `GET /v1/admin/models` shows about a model's definition: its load constraints, read from the
JSON schema, and its configured fields with secrets redacted.

A UI builds its load form from this alone: every temporary override the backend's launcher accepts
(`LOAD_OVERRIDES`), with the type and range the schema gives it, and the replica bounds. Nothing here
restates a rule: a field's constraint is whatever `conf/schema.json` says, so the form and the
validation of `POST .../load` (proxy.config.checks.override_problems) can never disagree.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from launchers import launcher_for
from proxy.config.checks import override_rule
from proxy.config.model import ModelConfig
from proxy.masking import shown_url

# Field names whose values are secrets: *_api_key, *token* as a word (so `max_tokens` is not one),
# passwords and secrets. Matched on whole `_`-separated words.
SECRET_FIELD = re.compile(r"(?:^|_)(?:api_key|token|secret|password)(?:$|_)", re.IGNORECASE)
# Command-line flags in *_extra_args whose next argument (or `=value`) is a secret: --api-key, --hf-token.
SECRET_FLAG = re.compile(r"^--?[\w-]*(?:api[-_]key|token|secret|password)(?:=|$)", re.IGNORECASE)
REDACTED = "<redacted>"
# Schema keywords a form needs to offer and check a value; descriptions help label it.
CONSTRAINT_KEYWORDS = ("enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "items",
                       "properties", "additionalProperties", "minItems", "maxItems", "description")
# Shown at the top level of `definition`, with the field naming the model the backend serves (its
# traits' model_field); every other configured field goes under `fields`.
DEFINITION_FIELDS = ("model_path", "prompt_format", "description")


def load_constraints(model: ModelConfig, properties: Mapping[str, Any], loadable: bool) -> dict[str, Any]:
    """Every temporary override the model's backend takes, with its type and allowed range from the
    schema and its configured value, and the replica count a load may ask for. `loadable`: whether
    this version can run the backend at all (the pool has a kind for it)."""
    launcher = launcher_for(model.backend)
    names = launcher.LOAD_OVERRIDES if launcher is not None else ()
    overrides = {}
    for name in names:
        rule = override_rule(properties.get(name, {}))
        types = rule.get("type", [])
        types = [types] if isinstance(types, str) else list(types)
        if "enum" in rule:
            types = sorted({_json_type(v) for v in rule["enum"]} | set(types))
        entry: dict[str, Any] = {"type": [t for t in types if t != "null"], "nullable": "null" in types}
        entry.update({k: rule[k] for k in CONSTRAINT_KEYWORDS if k in rule})
        entry["configured"] = redact_value(name, model.options.get(name))
        overrides[name] = entry
    return {
        "loadable": loadable,
        "overrides": overrides,
        "replicas": {"type": ["integer"], "minimum": 1, "maximum": model.replica_max, "configured": model.replicas},
    }


def definition(model: ModelConfig, environ: Mapping[str, str], model_field: str = "model_path") -> dict[str, Any]:
    """The model as configured (not as loaded), secrets redacted: API keys and tokens are never shown,
    and a `*_env` field shows which variable it names and whether that variable is set."""
    top = tuple(dict.fromkeys((model_field, *DEFINITION_FIELDS)))
    fields = {k: redact(k, v, environ) for k, v in sorted(model.options.items())
              if k not in top and k not in ("backend", "modalities", "replicas", "replica_max")}
    return {
        "backend": model.backend,
        **{k: redact(k, model.options.get(k), environ) for k in top},
        "modalities": list(model.modalities),
        "replicas": model.replicas,
        "replica_max": model.replica_max,
        "fields": fields,
    }


def redact(name: str, value: Any, environ: Mapping[str, str]) -> Any:
    """`value` as it may be shown for a field called `name`."""
    if name.lower().endswith("_env") and value is not None:
        if isinstance(value, Mapping):
            # Variables set for the engine's process: their names, never their values.
            return {key: REDACTED for key in sorted(value)}
        return {"variable": value, "set": bool(environ.get(str(value)))}
    return redact_value(name, value)


def redact_value(name: str, value: Any) -> Any:
    if value is None:
        return None
    if SECRET_FIELD.search(name):
        return REDACTED
    if isinstance(value, Mapping):
        return {k: redact_value(str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _redact_args([redact_value(name, v) for v in value])
    if isinstance(value, str) and "://" in value:
        return shown_url(value)   # `https://user:key@host` keeps its host, not the credentials
    return value


def _redact_args(items: list[Any]) -> list[Any]:
    """Extra command-line arguments: the value after a secret flag (`--api-key X`, `--hf-token=X`)."""
    out: list[Any] = []
    hide_next = False
    for item in items:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if isinstance(item, str) and SECRET_FLAG.match(item):
            if "=" in item:
                item = item.split("=", 1)[0] + "=" + REDACTED
            else:
                hide_next = True
        out.append(item)
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string"


def admin_row(described: dict[str, Any], model: ModelConfig, properties: Mapping[str, Any],
              environ: Mapping[str, str], loadable: bool, model_field: str = "model_path") -> dict[str, Any]:
    """A runtime's `describe()` with its load constraints and its definition added."""
    return {**described, "load_constraints": load_constraints(model, properties, loadable),
            "definition": definition(model, environ, model_field)}
