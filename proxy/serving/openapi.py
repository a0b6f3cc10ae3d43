"""GET /openapi.json: the API as an OpenAPI 3.1 document, built from the code's own schemas.

Every route of the app is one entry of `operations()` (tests/proxy/serving/test_openapi.py fails on a
route that has none); the schemas come from proxy/serving/openapi_schemas.py, which takes them from
what the code validates with. The configured model ids are given as examples, so that a client
generator or a fuzzer (tests/contract/) reaches real models.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.config.settings import Settings
from proxy.errors import CODES
from proxy.events import KINDS as EVENT_KINDS
from proxy.serving import openapi_schemas as schemas
from proxy.serving import ui
from proxy.serving.keys import SETTINGS
from proxy.serving.batch_lines import ENDPOINTS
from proxy.serving.routes_admin import MAX_LOG_BYTES

routes = web.RouteTableDef()

OPENAPI_VERSION = "3.1.0"
BATCH_PATHS = ("/v1/files", "/v1/batches", "/v1/admin/batches")
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
RESPONSE_EVENTS = ("response.created", "response.output_text.delta", "response.metrics", "response.completed")
MESSAGE_EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                  "message_stop", "ping")
PASS_THROUGH_SUMMARY = {
    "/v1/chat/completions": "OpenAI chat completions", "/v1/completions": "OpenAI completions",
    "/v1/embeddings": "OpenAI embeddings", "/v1/messages/count_tokens": "Anthropic's token count of a Messages request",
    "/v1/rerank": "documents scored against a query (llama-server's rerank, Jina/Cohere-style)",
    "/infill": "code infill: the text between input_prefix and input_suffix (llama-server's)",
    "/tokenize": "a text's token ids in the model's vocabulary (llama-server's)",
    "/detokenize": "token ids back to text (llama-server's)",
}
# The statuses of each kind of route's errors, each with the error envelope; 429 and 503 with
# Retry-After (errors.PoolError.headers). A backend's own status passes on: `default`.
# Without tenants, 403 and 415 as the admin routes' for a page of another site (proxy/serving/edge_guard.py).
MODEL_ERRORS = (400, 401, 403, 404, 409, 413, 415, 429, 502, 503, 504)
# Admin routes: 403 for a request from a page of another site (its Origin, or a rebinding Host),
# 415 for a POST that is not application/json (proxy/serving/admin_guard.py).
ADMIN_ERRORS = (400, 401, 403, 404, 409, 413, 415, 502, 503, 504)
ADMIN_READ_ERRORS = (401, 403)
STATUS_TEXT = {400: "the request is wrong (`param` says where)",
               401: "no or a wrong key: the admin token, or with tenants a tenant's API key",
               403: "not allowed for this request", 404: "no such model or route",
               409: "the pool's state forbids it now",
               415: "an admin POST, or without tenants any POST, without `Content-Type: application/json` "
                    "(even with no body)",
               413: "the body is over service.max_body_bytes", 429: "queue full or waited too long",
               502: "the model server failed", 503: "not available now; come back after Retry-After",
               504: "the model server did not answer in time",
               501: "not served here: the message says what does it"}


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    ok: dict[str, Any]                          # the 200's content, by media type
    body: dict[str, Any] | None = None          # the request body's schema (JSON)
    errors: tuple[int, ...] = ()
    admin: bool = False
    parameters: tuple[dict[str, Any], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)   # more responses (status: response object)
    links: tuple[str, ...] = ()     # what may follow a 200 for the same model (admin: load, scale, unload)
    error_schema: str = "Error"     # the shape of its errors: OpenAI's envelope, Anthropic's or Ollama's
    body_media: str = "application/json"


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _query(name: str, lo: int, hi: int, what: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": what,
            "schema": {"type": "integer", "minimum": lo, "maximum": hi}}


def operations() -> tuple[Operation, ...]:
    """Every route of the app (schemas read from the code and conf/schema.json, so built on call)."""
    chat_answer = {**_json({"type": "object"}), SSE: {"schema": schemas.sse_event(["message", "error"])}}
    pass_through = tuple(
        Operation("post", path, f"{PASS_THROUGH_SUMMARY[path]}, passed to a replica of a model that serves it "
                  "(capabilities.endpoints; else 400 endpoint_unsupported)", chat_answer,
                  body=schemas.pass_through_request(path), errors=MODEL_ERRORS,
                  error_schema="AnthropicError" if path.startswith("/v1/messages") else "Error")
        for path in PASS_THROUGH_SUMMARY)
    state = _json(schemas.model_state())
    tenant_name = {"name": "tenant", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1},
                   "description": "a configured tenant"}
    by_name = ({"name": "name", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1},
                "description": "a configured model id"},)
    return (*pass_through, *_ollama_operations(), *_batch_operations(),
            Operation("post", "/v1/responses", "the llm-pool request: input or messages, decoding, thinking, "
                      "translation; JSON or SSE (response.created, response.output_text.delta, response.metrics, "
                      "response.completed, error)",
                      {**_json(schemas.responses_answer()),
                       SSE: {"schema": schemas.sse_event([*RESPONSE_EVENTS, "error"])}},
                      body=schemas.responses_request(), errors=MODEL_ERRORS),
            Operation("post", "/v1/messages", "Anthropic Messages: passed to a replica that speaks it, translated "
                      "onto chat completions for one that does not; JSON or SSE (message_start, "
                      "content_block_start, content_block_delta, content_block_stop, message_delta, message_stop, "
                      "error); errors in Anthropic's shape",
                      {**_json({"type": "object"}), SSE: {"schema": schemas.sse_event([*MESSAGE_EVENTS, "error"])}},
                      body=schemas.messages_request(), errors=MODEL_ERRORS, error_schema="AnthropicError"),
            Operation("get", "/v1/models", "every model a request may use now: the loaded ones and those that "
                      "load on demand (status: loaded, loading or cold), with what each serves; with tenants, "
                      "those the key's tenant may use",
                      _json(schemas.models_list()), errors=(401,)),
            Operation("get", "/health", "liveness, with every model's state", _json(schemas.health())),
            Operation("get", "/ready", "readiness: 503 until the startup loads are done, while stopping, and "
                      "while the tenants' usage ledger cannot write",
                      _json(schemas.ready(["ready"])),
                      extra={"503": {"description": "loading, shutting down, or the usage ledger failing",
                                     "headers": _retry_after(),
                                     "content": _json(schemas.ready(["loading", "shutting_down", "ledger_failing"]))}}),
            Operation("get", "/metrics", "Prometheus metrics; during a reload 503 (`reloading`, `shutting_down`) "
                      "from the process that does not hold the service: a missed scrape, never a counter reset",
                      {"text/plain": {"schema": {"type": "string"}}}, errors=(503,)),
            Operation("get", "/openapi.json", "this document", _json({"type": "object"})),
            Operation("get", "/v1/admin/models", "every configured model: state, replicas, load constraints, "
                      "definition (secrets redacted)", _json(schemas.admin_models()), errors=ADMIN_READ_ERRORS,
                      admin=True),
            Operation("post", "/v1/admin/models/{name}/load", "load (or adopt) with temporary overrides",
                      state, body=schemas.load_request(), errors=ADMIN_ERRORS, admin=True, parameters=by_name,
                      links=("scale", "unload", "logs")),
            Operation("post", "/v1/admin/models/{name}/unload", "drain, then stop", state,
                      body=schemas.unload_request(), errors=ADMIN_ERRORS, admin=True, parameters=by_name,
                      links=("load",)),
            *(Operation("post", f"/v1/admin/models/{{name}}/adapters/{{adapter}}/{action}",
                        f"{action} one of a loaded model's LoRA adapters on its replicas (vLLM at run time; "
                        "llama-server holds its adapters from its start: a load finds them, an unload is 409 "
                        "adapter_not_unloadable)", state, body=schemas.unload_request(), errors=ADMIN_ERRORS,
                        admin=True, parameters=(*by_name, {"name": "adapter", "in": "path", "required": True,
                                                           "schema": {"type": "string", "minLength": 1},
                                                           "description": "the adapter's name under lora_adapters"}))
              for action in ("load", "unload")),
            Operation("post", "/v1/admin/models/{name}/scale", "change a loaded model's replica count", state,
                      body=schemas.scale_request(), errors=ADMIN_ERRORS, admin=True, parameters=by_name,
                      links=("scale", "unload", "load")),
            Operation("get", "/v1/admin/models/{name}/logs", "a replica's log through supervisord (tail or follow)",
                      _json(schemas.logs()), errors=(400, *ADMIN_READ_ERRORS, 404, 409, 503), admin=True,
                      parameters=(*by_name, _query("replica", 0, 2 ** 31, "replica index (default 0)"),
                                  _query("bytes", 1, MAX_LOG_BYTES, "at most this many bytes (default 16384)"),
                                  _query("offset", 0, 2 ** 62, "what came after this offset (follow)"))),
            Operation("get", "/v1/admin/gpu-memory", "NVML readings per GPU and per replica process",
                      _json(schemas.any_object("the GPU report")), errors=ADMIN_READ_ERRORS, admin=True),
            Operation("get", "/v1/admin/memory", "placement's view: budgets, what models hold, loads waiting",
                      _json(schemas.any_object("the placer's description")), errors=ADMIN_READ_ERRORS, admin=True),
            Operation("get", "/v1/admin/hosts", "every host replicas may run on: whether its supervisord "
                      "answers, its devices, budgets and free memory, and its replicas",
                      _json({"type": "object", "required": ["object", "data"],
                             "properties": {"object": {"const": "list"},
                                            "data": {"type": "array", "items": {"type": "object"}}}}),
                      errors=ADMIN_READ_ERRORS, admin=True),
            Operation("get", "/v1/admin/processes", "the proxy's processes: this one (role `single`, or "
                      "`controller` with service.workers > 1) and its workers, each with its PID, state, open client "
                      "connections and requests in flight",
                      _json({"type": "object", "required": ["object", "data"],
                             "properties": {"object": {"const": "list"},
                                            "data": {"type": "array", "items": schemas.process()}}}),
                      errors=ADMIN_READ_ERRORS, admin=True),
            Operation("get", "/v1/admin/events", "what happened, oldest first: loads, unloads with their reason "
                      "and cause, evictions, restarts, crashes, ejections, hosts down and up, admin actions",
                      _json(schemas.events()), errors=(400, *ADMIN_READ_ERRORS, 404), admin=True,
                      parameters=(_query("after", 0, 2 ** 62, "only events with a larger id (poll with last_id)"),
                                  _query("limit", 1, 1000, "at most this many, the newest (default 200)"),
                                  {"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
                                   "description": "only this model's events"},
                                  {"name": "kind", "in": "query", "required": False, "schema": {"type": "string"},
                                   "description": f"comma-separated kinds of {', '.join(EVENT_KINDS)}"})),
            Operation("get", "/v1/admin/usage", "the usage ledger summed per group_by (tenant, model, day, key_id, "
                      "backend, host) between from and to; JSON or format=csv",
                      {**_json(schemas.usage()), "text/csv": {"schema": {"type": "string"}}},
                      errors=(400, *ADMIN_READ_ERRORS, 409), admin=True,
                      parameters=({"name": "from", "in": "query", "required": False, "schema": {"type": "string"},
                                   "description": "unix seconds or an ISO 8601 date or time"},
                                  {"name": "to", "in": "query", "required": False, "schema": {"type": "string"},
                                   "description": "unix seconds or an ISO 8601 date or time"},
                                  {"name": "group_by", "in": "query", "required": False,
                                   "schema": {"type": "string"}, "description": "comma-separated fields"},
                                  {"name": "format", "in": "query", "required": False,
                                   "schema": {"enum": ["json", "csv"]}})),
            Operation("get", "/v1/admin/tenants", "each tenant: its settings and its keys by id (never a key)",
                      _json(schemas.any_object("the tenants")), errors=(*ADMIN_READ_ERRORS, 409), admin=True),
            Operation("post", "/v1/admin/tenants/{tenant}/keys", "mint a key for the tenant: {id, key}, the key shown "
                      "once", _json({"type": "object", "required": ["id", "key"],
                                     "properties": {"id": {"type": "string"}, "key": {"type": "string"}}}),
                      body={"type": "object", "additionalProperties": False, "maxProperties": 0},
                      errors=ADMIN_ERRORS, admin=True, parameters=(tenant_name,)),
            Operation("delete", "/v1/admin/tenants/{tenant}/keys/{key_id}",
                      "revoke a minted key: its next request is 401",
                      _json({"type": "object"}), errors=(*ADMIN_READ_ERRORS, 404, 409), admin=True,
                      parameters=(tenant_name, {"name": "key_id", "in": "path", "required": True,
                                                "schema": {"type": "string", "minLength": 1}})),
            Operation("get", "/v1/admin/traffic", "the proxy's request counters per model (requests by status, "
                      "latency, time-to-first-token and queue-wait histograms), with the reading's time",
                      _json(schemas.any_object("the counters")), errors=ADMIN_READ_ERRORS, admin=True),
            # The status page: its files need no token (the page reads the admin API with the one typed
            # into it); with service.admin_port they answer on the admin listener only.
            Operation("get", "/ui", "the status page (HTML)", {"text/html": {"schema": {"type": "string"}}}),
            Operation("get", "/ui/", "redirects to the status page", {},
                      extra={"308": {"description": "to ../ui"}}),
            Operation("get", "/ui/{asset}", "one of the status page's scripts and styles",
                      {"text/javascript": {"schema": {"type": "string"}}, "text/css": {"schema": {"type": "string"}}},
                      errors=(404,),
                      parameters=({"name": "asset", "in": "path", "required": True,
                                   "schema": {"type": "string", "enum": sorted(ui.ASSETS)}},)),
            )



def _ollama_operations() -> tuple[Operation, ...]:
    """The Ollama API (docs/api.md: The Ollama API): its answers' and errors' shapes are Ollama's."""
    def post(path: str, summary: str, ok: dict[str, Any], errors: tuple[int, ...] = MODEL_ERRORS) -> Operation:
        return Operation("post", path, summary, ok, body=schemas.ollama_request(path), errors=errors,
                         error_schema="OllamaError")

    answer = {**_json({"type": "object", "required": ["model", "created_at", "done"]}),
              NDJSON: {"schema": {"type": "string", "description": "one JSON object a line, the last `done`"}}}
    managed = tuple(Operation(method, path, "not served: models are the admin's (501, naming the admin API)",
                              {}, errors=(501,), error_schema="OllamaError")
                    for method, path in (("post", "/api/pull"), ("post", "/api/push"), ("post", "/api/create"),
                                         ("post", "/api/copy"), ("delete", "/api/delete")))
    return (
        post("/api/chat", "Ollama chat: onto the model's chat completions; NDJSON lines (stream: true, the default) "
             "or one object", answer),
        post("/api/generate", "Ollama generate: a prompt (raw: to /v1/completions as it is); no prompt loads the "
             "model", answer),
        post("/api/embed", "Ollama embed: /v1/embeddings of each input",
             _json({"type": "object", "required": ["model", "embeddings"],
                    "properties": {"embeddings": {"type": "array", "items": {"type": "array"}}}})),
        post("/api/embeddings", "Ollama's older embeddings route: one prompt, one embedding",
             _json({"type": "object", "required": ["embedding"], "properties": {"embedding": {"type": "array"}}})),
        post("/api/show", "a model's details and capabilities", _json({"type": "object", "required": [
             "details", "model_info", "capabilities"]}), errors=(400, 401, 403, 404, 413, 415)),
        Operation("get", "/api/tags", "the models a request may use now, as GET /v1/models lists them",
                  _json({"type": "object", "required": ["models"],
                         "properties": {"models": {"type": "array", "items": schemas.ollama_model(ps=False)}}}),
                  errors=(401,), error_schema="OllamaError"),
        Operation("get", "/api/ps", "the loaded models, with when the pool's lifecycle would unload each",
                  _json({"type": "object", "required": ["models"],
                         "properties": {"models": {"type": "array", "items": schemas.ollama_model(ps=True)}}}),
                  errors=(401,), error_schema="OllamaError"),
        Operation("get", "/api/version", "the Ollama API version this follows",
                  _json({"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}})),
        *managed)


def _batch_operations() -> tuple[Operation, ...]:
    """The OpenAI Batch API (docs/batches.md); with tenants, a tenant's own files and batches only."""
    file_id = ({"name": "file_id", "in": "path", "required": True,
                "schema": {"type": "string", "pattern": "^file-[0-9a-f]{24}$"}, "description": "a file's id"},)
    batch_id = ({"name": "batch_id", "in": "path", "required": True,
                 "schema": {"type": "string", "pattern": "^batch_[0-9a-f]{24}$"}, "description": "a batch's id"},)
    file_object, batch_object = _json(schemas.file_object()), _json(schemas.batch_object())
    return (
        Operation("post", "/v1/files", "upload a batch's JSONL file (multipart: purpose batch, file), checked line "
                  "by line as the live routes check a request", file_object, body=schemas.file_upload(),
                  errors=(400, 401, 403, 413, 415), body_media="multipart/form-data"),
        Operation("get", "/v1/files", "the files kept (with tenants, the key's tenant's)",
                  _json(schemas.listing(schemas.file_object())), errors=(401,),
                  parameters=({"name": "purpose", "in": "query", "required": False, "schema": {"type": "string"}},)),
        Operation("get", "/v1/files/{file_id}", "a file's record", file_object, errors=(401, 404),
                  parameters=file_id),
        Operation("get", "/v1/files/{file_id}/content", "a file's bytes (a batch's input, output or errors)",
                  {"application/octet-stream": {"schema": {"type": "string"}}}, errors=(401, 404),
                  parameters=file_id),
        Operation("delete", "/v1/files/{file_id}", "delete a file", _json({"type": "object", "required": ["deleted"]}),
                  errors=(401, 404), parameters=file_id),
        Operation("post", "/v1/batches", "run a file's lines inside the pool at the batch priority class, as "
                  "the free slots allow; its answers and errors become files", batch_object,
                  body=schemas.batch_request(ENDPOINTS), errors=(400, 401, 403, 404, 413, 415)),
        Operation("get", "/v1/batches", "the batches, newest first (with tenants, the key's tenant's)",
                  _json(schemas.listing(schemas.batch_object())), errors=(400, 401),
                  parameters=(_query("limit", 1, 100, "at most this many (default 20)"),
                              {"name": "after", "in": "query", "required": False, "schema": {"type": "string"},
                               "description": "the last id of the previous page"})),
        Operation("get", "/v1/batches/{batch_id}", "a batch: its status, counts and files", batch_object,
                  errors=(401, 404), parameters=batch_id),
        Operation("post", "/v1/batches/{batch_id}/cancel", "cancel: its lines in flight end, no other is sent, "
                  "then its files are written", batch_object, errors=(401, 403, 404, 409, 415),
                  parameters=batch_id),
        Operation("get", "/v1/admin/batches", "every tenant's batches with their progress and rate, and each "
                  "model's batch class queue", _json(schemas.any_object("the batches")),
                  errors=ADMIN_READ_ERRORS, admin=True),
    )


def _retry_after() -> dict[str, Any]:
    return {"Retry-After": {"required": True, "description": "seconds to wait before trying again",
                            "schema": {"type": "string", "pattern": "^[0-9]+$"}}}


def _error_response(status: int, schema: str) -> dict[str, Any]:
    response: dict[str, Any] = {"description": STATUS_TEXT[status],
                                "content": _json({"$ref": f"#/components/schemas/{schema}"})}
    if status in (429, 503):
        response["headers"] = _retry_after()
    return response


def _operation(op: Operation, models: list[str]) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": op.ok}}
    if op.links:
        # The admin's walk through a model's states (a fuzzer's stateful run follows them).
        responses["200"]["links"] = {
            then: {"operationId": _operation_id(Operation("get" if then == "logs" else "post",
                                                          f"/v1/admin/models/{{name}}/{then}", "", {})),
                   "parameters": {"name": "$request.path.name"}} for then in op.links}
    for status in op.errors:
        responses[str(status)] = _error_response(status, op.error_schema)
    responses.update(op.extra)
    # Any route: 500 (a bug), 405 (another method), and a backend's own status passed on.
    responses["default"] = {"description": {"Error": "an error, as the OpenAI envelope",
                                            "AnthropicError": "an error, in Anthropic's shape"}.get(
                                                op.error_schema, "an error, in Ollama's shape"),
                            "content": _json({"$ref": f"#/components/schemas/{op.error_schema}"})}
    out: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(op), "responses": responses}
    parameters = [dict(p) for p in op.parameters]
    for p in parameters:
        if p["name"] == "name" and models:
            p["examples"] = {m: {"value": m} for m in models}
    if parameters:
        out["parameters"] = parameters
    if op.body is not None:
        body = dict(op.body)
        if "model" in body.get("properties", {}) and models:
            body = {**body, "properties": {**body["properties"],
                                           "model": {**body["properties"]["model"], "examples": models}}}
        out["requestBody"] = {"required": op.method == "post" and "required" in body,
                              "content": {op.body_media: {"schema": body}}}
    if op.admin:
        out["security"] = [{"adminToken": []}]
        out["tags"] = ["admin"]
    return out


def _operation_id(op: Operation) -> str:
    words = [w.strip("{}") for w in op.path.replace(".", "_").replace("-", "_").split("/") if w]
    return "_".join([op.method, *words]) + ("_slash" if op.path.endswith("/") else "")


def build(settings: Settings | None = None) -> dict[str, Any]:
    """The OpenAPI document; with `settings`, the configured model ids as examples."""
    models = sorted(settings.models) if settings is not None else []
    paths: dict[str, dict[str, Any]] = {}
    batches_off = settings is not None and not settings.batches.enabled
    for op in operations():
        if batches_off and op.path.startswith(BATCH_PATHS):
            continue
        paths.setdefault(op.path, {})[op.method] = _operation(op, models)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "llm-pool", "version": "0.1.0",
                 "description": "One OpenAI-compatible endpoint in front of many LLM runtimes. Errors are the "
                                "OpenAI envelope; `code` is one of components.schemas.Error's x-codes. On "
                                "/v1/messages and its count_tokens they are Anthropic's shape instead, on /api/* "
                                "(the Ollama API) Ollama's."},
        "paths": paths,
        "components": {
            "schemas": {"Error": schemas.error_schema(), "AnthropicError": schemas.anthropic_error_schema(),
                        "OllamaError": schemas.ollama_error_schema()},
            # Required only when service.admin_token_env names a variable; then every admin call needs it.
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer",
                                               "description": "the token in service.admin_token_env's variable"}},
        },
        "x-error-codes": dict(CODES),
    }


@routes.get("/openapi.json")
async def openapi_document(request: web.Request) -> web.Response:
    return web.json_response(build(request.app[SETTINGS]))
