"""The JSON schemas of GET /openapi.json, each taken from what the code validates or answers with.

Nothing here restates a rule: the /v1/responses request is responses.REQUEST_SCHEMA itself, the
pass-through bodies are body.REQUIRED plus the fields the proxy reads (reach.PROXY_ONLY_FIELDS),
a load's overrides are each launcher's LOAD_OVERRIDES with the rule conf/schema.json gives the
field, the error codes are errors.CODES, and the states are the lifecycle's enums. So the
document cannot say what the code does not do (tests/proxy/serving/test_openapi.py holds it to that).
"""
from __future__ import annotations

import json
from typing import Any

from launchers import LAUNCHERS
from proxy.config.checks import model_properties, override_rule
from proxy.errors import CODES
from proxy.events import KINDS as EVENT_KINDS
from proxy.lifecycle.state.replicas import ModelState, ReplicaState
from proxy.edge.anthropic import ANTHROPIC_ERROR_TYPES
from proxy.edge.ollama import SCHEMAS as OLLAMA_SCHEMAS
from proxy.serving.body import REQUIRED
from proxy.edge.relay import KNOWN_BACKEND_CODES
from proxy.serving.responses import REQUEST_SCHEMA

_JSON_TYPES = {list: "array", str: "string", dict: "object", int: "integer", float: "number", bool: "boolean"}
# What the proxy reads of a pass-through body besides the endpoint's required field (body.py,
# affinity_key.py, the remote kind's gate); everything else goes to the backend as it is.
PROXY_READS: dict[str, dict[str, Any]] = {
    "model": {"type": "string", "minLength": 1, "description": "a configured model id (GET /v1/models)"},
    "fairness_key": {"type": ["string", "null"],
                     "description": "whose queue the request waits in (else the X-Fairness-Key header)"},
    "allow_remote": {"type": "boolean", "description": "a remote model is used only when true"},
    "prompt_cache_key": {"type": ["string", "null"], "description": "the affinity key: same key, same replica"},
    "stream": {"type": "boolean", "description": "answer as server-sent events"},
}


def error_schema() -> dict[str, Any]:
    """The OpenAI error envelope. `code` is one of the proxy's (errors.CODES) or, on an answer a
    replica gave (the X-Replica header says which), the backend's own."""
    return {
        "type": "object", "required": ["error"], "additionalProperties": False,
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "code", "param"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": "string", "description": "one of x-codes (the proxy's), or a backend's own code "
                                                          "on an answer that carries X-Replica",
                         "x-codes": dict(CODES), "x-backend-codes": sorted(KNOWN_BACKEND_CODES)},
                "param": {"type": ["string", "null"]},
            }}},
    }


def anthropic_error_schema() -> dict[str, Any]:
    """Anthropic's error shape (/v1/messages): what its SDK reads to raise RateLimitError and the like."""
    return {"type": "object", "required": ["type", "error"],
            "properties": {"type": {"const": "error"}, "error": {
                "type": "object", "required": ["type", "message"],
                "properties": {"type": {"enum": sorted(set(ANTHROPIC_ERROR_TYPES.values()) | {"api_error"})},
                               "message": {"type": "string"}}}}}


def ollama_error_schema() -> dict[str, Any]:
    """Ollama's error shape (/api/*): what its clients raise as ResponseError."""
    return {"type": "object", "required": ["error"], "additionalProperties": False,
            "properties": {"error": {"type": "string"}}}


def ollama_request(path: str) -> dict[str, Any]:
    """An Ollama route's body, as proxy/edge/ollama.py checks it (a copy: the document may be changed)."""
    schema: dict[str, Any] = json.loads(json.dumps(OLLAMA_SCHEMAS[path]))
    return schema


def ollama_model(ps: bool) -> dict[str, Any]:
    """One model of GET /api/tags, or of GET /api/ps."""
    details = {"type": "object", "required": ["parent_model", "format", "family", "families", "parameter_size",
                                              "quantization_level"]}
    fields = ["name", "model", "size", "digest", "details", *(["expires_at", "size_vram", "context_length"] if ps
                                                              else ["modified_at"])]
    return {"type": "object", "required": fields,
            "properties": {"name": {"type": "string"}, "model": {"type": "string"}, "size": {"type": "integer"},
                           "digest": {"type": "string"}, "details": details, "modified_at": {"type": "string"},
                           "expires_at": {"type": "string"}, "size_vram": {"type": "integer"},
                           "context_length": {"type": "integer"}}}


def usage() -> dict[str, Any]:
    """GET /v1/admin/usage: one row per group, with the grouped fields present and the sums."""
    number = {"type": "number"}
    return {"type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
                "type": "object", "required": ["requests", "prompt_tokens", "cached_tokens", "output_tokens", "cost"],
                "properties": {"requests": {"type": "integer"}, "prompt_tokens": {"type": "integer"},
                               "cached_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
                               "cost": number, "tenant": {"type": "string"}, "model": {"type": "string"},
                               "day": {"type": "string"}}}}}}


def messages_request() -> dict[str, Any]:
    """POST /v1/messages: what the route checks before anything is sent (anthropic.check_request)."""
    return {"type": "object", "required": ["model", "messages", "max_tokens"], "additionalProperties": True,
            "properties": {**PROXY_READS,
                           "messages": {"type": "array", "minItems": 1, "items": {"type": "object"},
                                        "description": "user and assistant turns: text, or blocks: text, image, "
                                                       "tool_use (an assistant's) and tool_result (a user's)"},
                           "max_tokens": {"type": "integer", "minimum": 1},
                           "system": {"type": ["string", "array"]},
                           "stop_sequences": {"type": "array", "items": {"type": "string"}},
                           "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"]},
                                     "description": "custom tools: name, description, input_schema"},
                           "tool_choice": {"type": "object", "required": ["type"],
                                           "description": "auto, any, tool (with name) or none"}}}


def pass_through_request(path: str) -> dict[str, Any]:
    """What the proxy itself reads of a pass-through body; the rest is the backend's and passes on."""
    fields: dict[str, Any] = {}
    for name, types, what, item_type in REQUIRED[path]:
        field: dict[str, Any] = {"type": [_JSON_TYPES[t] for t in types], "description": what}
        if list in types:
            field["minItems"] = 1
        if item_type is not None:
            field["items"] = {"type": _JSON_TYPES[item_type]}
        fields[name] = field
    return {"type": "object", "required": ["model", *fields], "additionalProperties": True,
            "properties": {**PROXY_READS, **fields}}


def responses_request() -> dict[str, Any]:
    # A copy: the validator keeps the original, and the document may be changed by whoever reads it.
    schema: dict[str, Any] = json.loads(json.dumps(REQUEST_SCHEMA))
    schema["description"] = ("Unknown fields, at the top level and in `decoding`, are ignored and named back in "
                             "the X-Ignored-Fields response header. Exactly one of `input` and `messages`.")
    return schema


def load_request() -> dict[str, Any]:
    """POST .../load: each backend's temporary overrides (its launcher's LOAD_OVERRIDES), with the
    rule the config schema gives each field. Which apply depends on the model's backend: a model's
    own list, with its configured values, is its `load_constraints` in GET /v1/admin/models."""
    fields = model_properties()
    by_backend = {backend: list(launcher.LOAD_OVERRIDES) for backend, launcher in sorted(LAUNCHERS.items())}
    names = sorted({n for ns in by_backend.values() for n in ns})
    return {
        "type": "object", "additionalProperties": False,
        "properties": {
            "overrides": {"type": ["object", "null"], "additionalProperties": False,
                          "properties": {n: override_rule(fields[n]) for n in names},
                          "description": "only the model's backend's fields (x-overrides-by-backend)",
                          "x-overrides-by-backend": by_backend},
            "replicas": {"type": "integer", "minimum": 1, "description": "at most the model's replica_max"},
        },
    }


def unload_request() -> dict[str, Any]:
    """POST .../unload takes no fields; like every admin POST it is sent as application/json."""
    return {"type": "object", "additionalProperties": False, "properties": {}}


def scale_request() -> dict[str, Any]:
    return {"type": "object", "required": ["replicas"], "additionalProperties": False,
            "properties": {"replicas": {"type": "integer", "minimum": 1,
                                        "description": "at most the model's replica_max"}}}


def model_state() -> dict[str, Any]:
    """A model's runtime state (the answer of load, unload and scale)."""
    return {
        "type": "object", "required": ["id", "backend", "state", "replicas", "admission"], "additionalProperties": True,
        "properties": {
            "id": {"type": "string"},
            "backend": {"type": "string"},
            "state": {"enum": [s.value for s in ModelState]},
            "replicas": {"type": "array", "items": {
                "type": "object", "required": ["index", "state"], "additionalProperties": True,
                "properties": {"index": {"type": "integer", "minimum": 0},
                               "state": {"enum": [s.value for s in ReplicaState]},
                               "pid": {"type": ["integer", "null"]},
                               "outdated": {"type": ["string", "null"],
                                            "description": "adopted running other settings than the model's now "
                                                           "(which, by name); replaced one at a time (a roll)"}}}},
            "last_error": {"type": ["string", "null"]},
            "admission": {
                "type": "object", "required": ["open", "code", "reason"], "additionalProperties": False,
                "description": "whether requests may queue for the model; when not, the error each one gets",
                "properties": {"open": {"type": "boolean"}, "code": {"type": ["string", "null"]},
                               "reason": {"type": ["string", "null"]}}},
        },
    }


def admin_models() -> dict[str, Any]:
    row = model_state()
    row = {**row, "required": [*row["required"], "load_constraints", "definition"],
           "properties": {**row["properties"],
                          "load_constraints": {"type": "object", "required": ["loadable", "overrides", "replicas"]},
                          "definition": {"type": "object"}}}
    return {"type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": row},
                           "supervisord": {"type": "object"}}}


def models_list() -> dict[str, Any]:
    return {"type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"},
                           "data": {"type": "array", "items": {
                               "type": "object",
                               "required": ["id", "object", "owned_by", "created", "status", "load_on_demand",
                                            "capabilities"],
                               "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                              "owned_by": {"type": "string"}, "created": {"type": "integer"},
                                              "status": {"enum": ["loaded", "loading", "cold"],
                                                         "description": "cold: not loaded; a request loads it"},
                                              "load_on_demand": {"type": "boolean"},
                                              "alias_of": {"type": "string", "description": "an alias "
                                                           "(engine.aliases): the model that serves it"},
                                              "parent": {"type": "string", "description": "a LoRA adapter "
                                                         "(lora_adapters): its base model, whose replicas serve it"},
                                              "capabilities": {"type": "object", "description": "as in GET "
                                                               "/v1/admin/models: modalities, endpoints, ..."}}}}}}


def responses_answer() -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "model", "output", "output_text"],
            "properties": {"id": {"type": "string"}, "object": {"const": "response"}, "model": {"type": "string"},
                           "output": {"type": "array", "items": {
                               "type": "object", "required": ["type", "text"],
                               "properties": {"type": {"const": "output_text"}, "text": {"type": "string"}}}},
                           "output_text": {"type": "string"}, "metrics": {"type": "object"}}}


def health() -> dict[str, Any]:
    host = {"type": "object", "required": ["answering", "down_for_s", "error", "last_contact_s"],
            "properties": {"answering": {"type": "boolean"}, "down_for_s": {"type": ["number", "null"]},
                           "error": {"type": ["string", "null"]}, "last_contact_s": {"type": ["number", "null"]}}}
    return {"type": "object", "required": ["status", "supervisord", "hosts", "models", "errors"],
            "properties": {"status": {"enum": ["ok", "degraded", "shutting_down"]},
                           "supervisord": {"type": "object"},
                           "hosts": {"type": "object", "additionalProperties": host,
                                     "description": "each host of supervisor.hosts: degraded while one "
                                                    "does not answer"},
                           "models": {"type": "object",
                                      "additionalProperties": {"enum": [s.value for s in ModelState]}},
                           "errors": {"type": "object", "additionalProperties": {"type": "string"}}}}


def ready(statuses: list[str]) -> dict[str, Any]:
    return {"type": "object", "required": ["status", "models"],
            "properties": {"status": {"enum": statuses}, "waiting_for": {"type": "array", "items": {"type": "string"}},
                           "reason": {"type": "string"},
                           "models": {"type": "object", "additionalProperties": {
                               "type": "object", "required": ["state"],
                               "properties": {"state": {"enum": [s.value for s in ModelState]}}}}}}


def logs() -> dict[str, Any]:
    return {"type": "object", "required": ["model", "replica", "program", "text", "offset", "overflow"],
            "properties": {"model": {"type": "string"}, "replica": {"type": "integer"},
                           "program": {"type": ["string", "null"]}, "text": {"type": "string"},
                           "host": {"type": "string", "description": "the host whose supervisord has the log"},
                           "offset": {"type": "integer", "minimum": 0}, "overflow": {"type": "boolean"}}}


def sse_event(events: list[str]) -> dict[str, Any]:
    """One server-sent event of a stream (`message` is an event without an `event:` line: the
    backend's chunks, then `[DONE]`); `error` is a failure after the stream began, then the end."""
    return {"type": "object", "required": ["data"],
            "properties": {"event": {"enum": events}, "data": {"type": "string"}, "id": {"type": "string"}}}


def any_object(description: str) -> dict[str, Any]:
    return {"type": "object", "description": description}


def events() -> dict[str, Any]:
    text_or_null = {"type": ["string", "null"]}
    event = {"type": "object", "required": ["id", "time", "kind", "message"],
             "properties": {"id": {"type": "integer", "minimum": 1}, "time": {"type": "number"},
                            "kind": {"enum": list(EVENT_KINDS)}, "message": {"type": "string"},
                            "model": text_or_null, "replica": {"type": ["integer", "null"]}, "host": text_or_null,
                            "reason": text_or_null, "cause": text_or_null, "actor": text_or_null}}
    return {"type": "object", "required": ["object", "data", "last_id"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": event},
                           "last_id": {"type": "integer", "minimum": 0}}}


def process() -> dict[str, Any]:
    """One row of GET /v1/admin/processes (proxy/serving/workers.py: Processes.view)."""
    count = {"type": ["integer", "null"], "minimum": 0}
    return {"type": "object", "required": ["role", "index", "pid", "state", "connections", "requests", "leases",
                                           "restarts"],
            "properties": {"role": {"enum": ["single", "controller", "worker"]},
                           "index": {"type": ["integer", "null"], "minimum": 0},
                           "pid": {"type": ["integer", "null"]},
                           "state": {"enum": ["running", "starting", "exited"]},
                           "connections": {**count, "description": "open client connections (null: no answer)"},
                           "requests": {**count, "description": "requests in flight"},
                           "leases": {**count, "description": "sends to replicas its controller leased to it"},
                           "restarts": count}}


# -- the Batch API (docs/batches.md) ---------------------------------------------------------------

BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                  "cancelled")


def file_upload() -> dict[str, Any]:
    """POST /v1/files' form: OpenAI's."""
    return {"type": "object", "required": ["purpose", "file"],
            "properties": {"purpose": {"enum": ["batch"], "description": "this pool keeps files for batches only"},
                           "file": {"type": "string", "format": "binary",
                                    "description": "JSONL: a {custom_id, method, url, body} request a line"}}}


def file_object() -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
            "properties": {"id": {"type": "string", "pattern": "^file-"}, "object": {"const": "file"},
                           "bytes": {"type": "integer", "minimum": 0}, "created_at": {"type": "integer"},
                           "filename": {"type": "string"}, "purpose": {"enum": ["batch", "batch_output"]}}}


def batch_request(endpoints: tuple[str, ...]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False,
            "required": ["input_file_id", "endpoint", "completion_window"],
            "properties": {"input_file_id": {"type": "string", "description": "a file uploaded with purpose batch"},
                           "endpoint": {"enum": list(endpoints)},
                           "completion_window": {"enum": ["24h"]},
                           "metadata": {"type": ["object", "null"], "maxProperties": 16,
                                        "propertyNames": {"maxLength": 64},
                                        "additionalProperties": {"type": "string", "maxLength": 512}},
                           "output_expires_after": {"type": "object", "description": "accepted, not applied: "
                                                    "a batch's files are kept until deleted"}}}


def batch_object() -> dict[str, Any]:
    counts = {"type": "object", "required": ["total", "completed", "failed"],
              "properties": {k: {"type": "integer", "minimum": 0} for k in ("total", "completed", "failed")}}
    file_id = {"type": ["string", "null"]}
    return {"type": "object", "required": ["id", "object", "endpoint", "input_file_id", "completion_window", "status",
                                           "created_at", "request_counts"],
            "properties": {"id": {"type": "string", "pattern": "^batch_"}, "object": {"const": "batch"},
                           "endpoint": {"type": "string"}, "input_file_id": {"type": "string"},
                           "completion_window": {"type": "string"}, "status": {"enum": list(BATCH_STATUSES)},
                           "output_file_id": file_id, "error_file_id": file_id, "created_at": {"type": "integer"},
                           "request_counts": counts}}


def listing(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": item},
                           "has_more": {"type": "boolean"}}}
