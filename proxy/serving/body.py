"""The edge of a request: its body, its model, its fairness key and whether it may be served now.

What a route decides before the data path (proxy/serving/forward.py) takes a slot: read once here,
in this order, by every public route.
"""
from __future__ import annotations

from typing import Any, Callable

from aiohttp import web

from proxy.capabilities import ROUTES
from proxy.errors import BadRequest, Conflict, Forbidden, TooLarge, Unavailable
from proxy.fairness import DEFAULT_CLASS, FairnessPolicy, normalize_key
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import ModelState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.config.model import Adapter
from proxy.serving.keys import ADAPTER, ADOPTING, CACHE_SCOPE, FAIRNESS_KEY, FALLBACK_BODY, MODEL, SETTINGS
from proxy.serving.shutdown import SHUTDOWN, handed_over_error
from proxy.edge.strict_json import decode
from proxy.serving.token_ids import check_token_ids
from proxy.serving.tenancy import TENANCY, TICKET

# What each pass-through endpoint cannot do without (OpenAI's, llama-server's and Anthropic's required
# parameters, and their JSON types): checked here, so that a client hears a clear error, not an
# engine's internals. Each: the field, its types, what it must be, and the type of each of its items
# where an engine would otherwise fail on a wrong one with a 500 of its own (the sim, for one, on
# `messages: [null]`: a client's mistake then became a replica's failure).
Required = tuple[str, tuple[type, ...], str, "type | None"]
REQUIRED: dict[str, tuple[Required, ...]] = {
    "/v1/chat/completions": (("messages", (list,), "an array of messages", dict),),
    "/v1/completions": (("prompt", (str, list), "a string or an array", None),),
    "/v1/embeddings": (("input", (str, list), "a string or an array", None),),
    "/v1/messages/count_tokens": (("messages", (list,), "an array of messages", dict),),
    "/v1/rerank": (("query", (str,), "a string", None), ("documents", (list,), "an array of strings", str)),
    # llama-server's 500 (`key 'input_suffix' not found`) without it: its own check does not return.
    "/infill": (("input_prefix", (str,), "a string", None), ("input_suffix", (str,), "a string", None)),
    "/tokenize": (("content", (str,), "a string", None),),
    "/detokenize": (("tokens", (list,), "an array of token ids", int),),
}
ITEM_WHAT = {dict: "an object", str: "a string", int: "an integer"}


async def read_json(request: web.Request) -> dict[str, Any]:
    return (await read_body(request))[0]


async def read_body(request: web.Request) -> tuple[dict[str, Any], bytes | None]:
    """The request's JSON object (proxy/edge/strict_json.py), and the bytes it was read from:
    exactly those that were checked, forwarded as they are where nothing in them must change. A
    fallback's run reads its own body (no bytes: proxy/serving/fallbacks.py)."""
    fallback: tuple[dict[str, Any], None] | None = request.get(FALLBACK_BODY)
    if fallback is not None:
        return fallback
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SETTINGS].service.max_body_bytes
        raise TooLarge(f"request body is over the limit of {limit} bytes (service.max_body_bytes)") from None
    return decode(raw), raw


def requested_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required and must be a non-empty string", code="missing_model", param="model")
    return model


def fairness_key(request: web.Request, body: dict[str, Any]) -> str:
    """From the body's `fairness_key`, else the X-Fairness-Key header (for plain OpenAI clients);
    a tenant's request waits in its tenant's queue whatever it names (docs/tenants.md)."""
    ticket = request.get(TICKET)
    if ticket is not None:
        tenant_key: str = ticket.caller.tenant.fairness_key
        request[FAIRNESS_KEY] = tenant_key
        return tenant_key
    key = body.get("fairness_key")
    if key is not None and not isinstance(key, str):
        raise BadRequest("`fairness_key` must be a string", code="invalid_fairness_key", param="fairness_key")
    key = normalize_key(key if key is not None else request.headers.get("X-Fairness-Key"))
    request[FAIRNESS_KEY] = key
    return key


# A request may lower its priority class with this header (a service's background work under its
# interactive key), never raise it: its tenant's `priority`, else `default`, is its ceiling.
PRIORITY_HEADER = "X-Priority-Class"


def priority_class(request: web.Request, policy: FairnessPolicy) -> str:
    """The priority class the request waits in (engine.fairness.classes, issue 44)."""
    ticket = request.get(TICKET)
    ceiling: str = (ticket.caller.tenant.priority if ticket is not None else None) or DEFAULT_CLASS
    asked = request.headers.get(PRIORITY_HEADER)
    if asked is None:
        return ceiling
    asked = asked.strip()
    names = [c.name for c in policy.classes]
    if asked not in names:
        raise BadRequest(f"{PRIORITY_HEADER} {asked[:64]!r} is no priority class of this pool: one of "
                         f"{', '.join(names)}", code="invalid_priority_class", param=PRIORITY_HEADER)
    if policy.rank(asked) < policy.rank(ceiling):
        raise Forbidden(f"{PRIORITY_HEADER} may lower a request's priority class, never raise it: {asked!r} is "
                        f"above this request's {ceiling!r}", code="priority_not_allowed", param=PRIORITY_HEADER)
    return asked


def model_of(request: web.Request, pool: Pool, name: str) -> tuple[ModelRuntime, Adapter | None, str]:
    """The model a request's `model` names (404 model_not_found for none), the LoRA adapter it
    names of that model, and the public id the tenant's globs judge: an alias's target, an
    adapter's own id (docs/adapters.md)."""
    settings = request.app[SETTINGS]
    public = settings.aliases.get(name, name)
    adapted = settings.adapters.get(public)
    if adapted is not None:
        return pool.get(adapted[0].name), adapted[1], public
    return pool.get(public), None, public


def servable(request: web.Request, pool: Pool, name: str, body: dict[str, Any],
             endpoint: str | None = None) -> ModelRuntime:
    """The model's runtime if this request may be sent to it, or queue for it, now; otherwise the
    right error. A model that loads on demand takes requests while it is not loaded: they wait in
    its queue and placement loads it (proxy/lifecycle/placement/placer.py). `endpoint`: the route,
    refused for a model not served on it before anything loads or counts."""
    tenancy = request.app.get(TENANCY)
    caller = tenancy.caller(request) if tenancy is not None else None   # 401 before anything else
    runtime, adapter, public = model_of(request, pool, name)
    if adapter is not None:
        request[ADAPTER] = adapter
    else:
        request.pop(ADAPTER, None)   # a fallback's run: the first model's adapter is not this one's
    name = request[MODEL] = runtime.name
    if tenancy is not None and caller is not None:
        tenancy.allow(caller, runtime, public)   # 403: never this model, whatever the request says
        request[CACHE_SCOPE] = caller.tenant.name   # no cache of another tenant's is reused
    if runtime.kind is not None:
        runtime.kind.gate(runtime.model, request.headers, body)  # e.g. allow_remote
    if endpoint is not None:
        check_endpoint(runtime, endpoint)
    if tenancy is not None and caller is not None:
        tenancy.admit(request, caller, runtime, body)   # 429 for a limit or the budget; what passes reserves
    state = runtime.state
    if state == ModelState.LOADED:
        if not runtime.ready():
            raise Unavailable(f"model {name!r} has no healthy replica right now", code="model_unavailable",
                              retry_after=2)
        return runtime
    if request.app[SHUTDOWN].handed_over:
        raise handed_over_error()   # a reload's old process loads nothing: its successor does
    # Adopting the replicas a previous proxy left running (a restart, a reload) is a health check
    # away from serving: wait in the queue for it, not a 503; its end (loaded or failed) ends the wait.
    if state == ModelState.LOADING and name in pool.startup_pending and name in request.app[ADOPTING]:
        return runtime
    # An admin's unload is meant: its model is not brought back while it unloads.
    if runtime.config.load_on_demand and runtime.kind is not None and not (
            state == ModelState.UNLOADING and runtime.unload_reason == "admin"):
        pool.demand(runtime)
        return runtime
    if state == ModelState.LOADING:
        raise Unavailable(f"model {name!r} is loading", code="model_loading", retry_after=5)
    if state == ModelState.UNLOADING:
        raise Unavailable(f"model {name!r} is being unloaded", code="model_unloading", retry_after=5)
    # A tenant is no admin: it is told whom to ask, not an admin path it cannot use.
    how = "ask the pool's admin to load it" if caller is not None else \
        f"load it with POST /v1/admin/models/{name}/load"
    raise Conflict(f"model {name!r} is configured but not loaded; {how}", code="model_not_loaded", param="model")


def check_required(path: str, body: dict[str, Any], vocabulary: Callable[[], int | None] | None = None) -> bool:
    """400 when the body lacks what `path` needs (`messages`, `prompt`, `input`, ...) or has it in the
    wrong JSON type, or holds a token id that is no token of the model (`vocabulary`: its size, None
    where unknown; proxy/serving/token_ids.py); nothing is sent to a backend then. Returns whether
    only the engine can judge the body (its 500 is then the client's 400: forward.read_answer)."""
    for name, types, what, item_type in REQUIRED[path]:
        if name not in body:
            raise BadRequest(f"Missing required parameter: '{name}'.", code="missing_required_parameter", param=name)
        value = body[name]
        if not isinstance(value, types) or (isinstance(value, list) and not value):
            raise BadRequest(f"'{name}' must be {what}, not empty", code="invalid_type", param=name)
        if item_type is not None and isinstance(value, list):
            for i, item in enumerate(value):
                # bool is an int to Python, never a token id to an engine.
                if not isinstance(item, item_type) or (item_type is int and isinstance(item, bool)):
                    raise BadRequest(f"'{name}.{i}' must be {ITEM_WHAT[item_type]}", code="invalid_type",
                                     param=f"{name}.{i}")
    return check_token_ids(path, body, vocabulary or _unknown)


def _unknown() -> None:
    return None


def embeddings_unsupported(runtime: ModelRuntime) -> BadRequest:
    """The refusal of /v1/embeddings, saying what applies to the model's backend (its traits)."""
    field = runtime.traits.embeddings_field
    how = f"set {field}: true to serve them" if field else f"backend {runtime.model.backend!r} serves none"
    return BadRequest(f"model {runtime.name!r} does not serve embeddings (capabilities.embeddings is false; "
                      f"{how})", code="embeddings_unsupported", param="model")


def check_endpoint(runtime: ModelRuntime, path: str) -> None:
    """Refuse, before any slot is taken, a route the model is not served on; otherwise the backend's
    own 404 or 501 would reach the client after a wait in the queue."""
    endpoints = runtime.capabilities().endpoints
    if path in endpoints:
        return
    if path == "/v1/embeddings":
        raise embeddings_unsupported(runtime)
    switch = runtime.traits.rerank_field if path == "/v1/rerank" else None
    how = f"; set {switch}: true to serve it" if switch and path in endpoint_paths(runtime.traits.apis) else ""
    raise BadRequest(f"model {runtime.name!r} (backend {runtime.model.backend!r}) does not serve {path}{how}; "
                     f"it serves {', '.join(endpoints)}", code="endpoint_unsupported", param="model")


def endpoint_paths(apis: frozenset[str]) -> list[str]:
    return [path for path, api in ROUTES.items() if api in apis]
