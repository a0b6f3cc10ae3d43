"""The public OpenAI-compatible API."""
from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.config.settings import LOCAL_HOST
from proxy.errors import Unavailable
from proxy.lifecycle.state.replicas import ModelState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.serving.affinity_key import affinity_key
from proxy.serving.body import check_required, fairness_key, read_body, requested_model, servable
from proxy.serving.fallbacks import with_fallbacks
from proxy.serving.forward import forward
from proxy.serving.image_urls import check_image_urls
from proxy.serving.keys import METRICS, ON_ADMIN_LISTENER, POOL, SETTINGS, VOCABULARIES
from proxy.edge.relay import ENGINE_JUDGES_INPUT
from proxy.serving.shutdown import SHUTDOWN, handed_over_error, stopping_error
from proxy.serving.tenancy import TENANCY

routes = web.RouteTableDef()

# Passed to a replica as they are (its answer back, streams as they arrive), where it speaks them.
PASS_THROUGH = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages/count_tokens",
                "/v1/rerank", "/infill", "/tokenize", "/detokenize")
# Of them, those another model may answer in its place (a model's `fallbacks`): generation. Another
# model's embeddings, token ids or scores would mean something else.
GENERATION = ("/v1/chat/completions", "/v1/completions")


async def pass_through(request: web.Request) -> web.StreamResponse:
    body, raw = await read_body(request)
    runtime = servable(request, request.app[POOL], requested_model(body), body, endpoint=request.path)
    vocabularies = request.app[VOCABULARIES]
    engine_judges = check_required(request.path, body,
                                   lambda: vocabularies.size(runtime.model, runtime.traits.model_field))
    await check_image_urls(body, runtime.model)
    # A provider's 500 stays the provider's: only our own engines' failures on input are the client's.
    judging = ENGINE_JUDGES_INPUT.set(engine_judges and not runtime.traits.remote)
    try:
        return await forward(request, runtime, fairness_key(request, body), body,
                             affinity_key(runtime, request.path, request.headers, body), raw)
    finally:
        ENGINE_JUDGES_INPUT.reset(judging)


for _path in PASS_THROUGH:
    routes.post(_path)(with_fallbacks(pass_through) if _path in GENERATION else pass_through)


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    """Every model a request may use now: the loaded ones and those that load on demand (a chat UI
    that picks from this list offers a cold model, and the request it sends loads it). A model that is
    neither stays unlisted: a load by an admin brings it. With tenants, the key's tenant sees the
    models its globs allow. An alias says its model (`alias_of`), a LoRA adapter its base (`parent`,
    as vLLM lists its own)."""
    data = []
    for name, runtime, alias_of in visible(request):
        entry = model_entry(name, runtime)
        if alias_of is not None:
            entry["alias_of"] = alias_of
        if name != runtime.name and alias_of is None:
            entry["parent"] = runtime.name
        data.append(entry)
    return web.json_response({"object": "list", "data": data})


def visible(request: web.Request) -> list[tuple[str, ModelRuntime, str | None]]:
    """The public ids a request may use now (GET /v1/models, GET /api/tags), each with its model and,
    for an alias, the id it stands for. An adapter is listed where its base model is, an alias where
    its target is; the tenant's globs judge each id itself (`demo:*` shows the adapters, not demo)."""
    models, settings = request.app[POOL].models, request.app[SETTINGS]
    listed_now = {name for name, runtime in models.items() if listed(runtime)}
    names = [name for name in models if name in listed_now]
    names += [aid for aid, (base, _) in settings.adapters.items() if base.name in listed_now]
    tenancy = request.app.get(TENANCY)
    if tenancy is not None:
        names = tenancy.allowed_models(request, names)   # a tenant sees the models it may use
    runtime_of = {name: models[settings.adapters[name][0].name] if name in settings.adapters else models[name]
                  for name in names}
    return [*((name, runtime, None) for name, runtime in runtime_of.items()),
            *((alias, runtime_of[target], target) for alias, target in settings.aliases.items()
              if target in runtime_of)]


def listed(runtime: ModelRuntime) -> bool:
    return runtime.state == ModelState.LOADED or (runtime.config.load_on_demand and runtime.kind is not None)


def model_entry(name: str, runtime: ModelRuntime) -> dict[str, object]:
    """OpenAI's model object, with llm-pool's fields: whether it is loaded now, and what it serves."""
    status = {ModelState.LOADED: "loaded", ModelState.LOADING: "loading"}.get(runtime.state, "cold")
    return {"id": name, "object": "model", "owned_by": "llm-pool", "created": 0, "status": status,
            "load_on_demand": runtime.config.load_on_demand, "capabilities": runtime.capabilities().as_dict()}


REASON_ELSEWHERE = "the reason is shown on the admin listener (service.admin_port)"


def shows_reasons(request: web.Request) -> bool:
    """A failure's reason holds paths, commands and a replica's log tail, for admins only: with a
    separate admin listener, only it shows them (the public one keeps the states)."""
    return request.app[SETTINGS].service.admin_port is None or request.get(ON_ADMIN_LISTENER, False)


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    # A model that could not start is named with its reason; the others serve, so the service is up.
    # Without supervisord answering, what runs serves but nothing can start or stop: degraded.
    # Another configured host that does not answer takes its replicas out of rotation: degraded
    # too, while it lasts (named in `hosts`, with how long).
    # Stopping is still alive (200): an orchestrator that killed it then would cut the drain short.
    supervisord = pool.supervisord_status()
    hosts = {name: s for name, s in pool.host_status().items() if name != LOCAL_HOST}
    whole = supervisord["answering"] and all(s["answering"] for s in hosts.values())
    status = "shutting_down" if request.app[SHUTDOWN].started else "ok" if whole else "degraded"
    reasons = shows_reasons(request)
    if not reasons:
        if supervisord["error"] is not None:
            supervisord = {**supervisord, "error": REASON_ELSEWHERE}
        hosts = {name: {**s, "error": REASON_ELSEWHERE} if s["error"] is not None else s
                 for name, s in hosts.items()}
    return web.json_response({"status": status,
                              "supervisord": supervisord,
                              "hosts": hosts,
                              "models": {name: rt.state.value for name, rt in pool.models.items()},
                              "errors": {name: rt.last_error if reasons else REASON_ELSEWHERE
                                         for name, rt in pool.models.items()
                                         if rt.state == ModelState.FAILED and rt.last_error}})


@routes.get("/ready")
async def ready(request: web.Request) -> web.Response:
    """Readiness, unlike /health (liveness): 503 until every model loading at startup has loaded
    or failed once, and again once the proxy is stopping or while the tenants' usage ledger cannot
    write (`ledger_failing`, with why); the body gives each one's state, a failed
    model's reason, and when its load is tried again (a retry pending or running does not make the
    proxy unready again)."""
    pool = request.app[POOL]
    pending = pool.startup_pending
    reasons = shows_reasons(request)
    models = {}
    for name, rt in pool.models.items():
        if rt.config.enabled or name in pending:
            entry: dict[str, object] = {"state": rt.state.value}
            if reasons and rt.state != ModelState.LOADED and rt.last_error and name not in pending:
                entry["reason"] = rt.last_error
            if rt.load_retry is not None:
                entry["load_retry"] = rt.load_retry.describe()
            models[name] = entry
    if request.app[SHUTDOWN].started:
        # A load balancer takes it out of rotation; the requests it still sends get 503 shutting_down.
        error = stopping_error()
        return web.json_response({"status": "shutting_down", "models": models}, status=503, headers=error.headers())
    if pending:
        return web.json_response({"status": "loading", "waiting_for": sorted(pending), "models": models},
                                 status=503, headers={"Retry-After": "1"})
    tenancy = request.app.get(TENANCY)
    failing = tenancy.ledger.failing() if tenancy is not None else None
    if failing is not None:
        # Requests are still served and their rows kept in memory; a balancer may send them elsewhere.
        return web.json_response({"status": "ledger_failing", "reason": failing if reasons else REASON_ELSEWHERE,
                                  "models": models}, status=503, headers={"Retry-After": "5"})
    return web.json_response({"status": "ready", "models": models})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    # Only the process that holds the service answers: a reload's successor before it has its
    # predecessor's counters, or the predecessor after it handed them over, would show a counter
    # going down, which `rate()` reads as a reset. A missed scrape is only a gap.
    shutdown = request.app[SHUTDOWN]
    if shutdown.handed_over:
        raise handed_over_error()
    if shutdown.succeeding:
        raise Unavailable("llm-pool is reloading: this process shows the counters once it has taken over from its "
                          "predecessor; scrape again", code="reloading", retry_after=1)
    body = generate_latest(request.app[METRICS].exposed)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
