"""The admin API: model state, load with temporary overrides, graceful unload, GPU memory, replica
logs, the proxy's request counters."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from launchers import launcher_for
from proxy.serving.admin_view import admin_row
from proxy.config.checks import model_properties, override_problems, replicas_problem
from proxy.config.settings import LOCAL_HOST
from proxy.errors import BadRequest, Conflict, NotFound, PoolError, Unavailable
from proxy.events import ADMIN, KINDS as EVENT_KINDS
from proxy.serving.admin_guard import admit
from proxy.serving.body import read_json
from proxy.lifecycle import adapters
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import ModelState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.gpu.report import ModelSnapshot, gpu_report
from proxy.serving.keys import HTTP, METRICS, POOL, SETTINGS, VRAM
from proxy.serving.traffic import traffic
from proxy.serving.shutdown import SHUTDOWN
from proxy.serving.workers import PROCESSES
from proxy.serving.leases import PEER
from proxy.supervisord.supervisor import SupervisorError

routes = web.RouteTableDef()


@routes.get("/v1/admin/models")
async def admin_models(request: web.Request) -> web.Response:
    admit(request)
    pool = request.app[POOL]
    properties = model_properties()
    rows = [admin_row(pool.describe(rt), rt.config, properties, pool.environ, loadable=rt.kind is not None,
                      model_field=rt.traits.model_field) for rt in pool.models.values()]
    return web.json_response({"object": "list", "data": rows,
                              "supervisord": pool.supervisord_status()})


async def _load_request(request: web.Request, name: str) -> dict[str, Any]:
    body = await read_json(request) if request.can_read_body else {}
    unknown = sorted(set(body) - {"overrides", "replicas"})
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; a load request takes `overrides` and `replicas`",
                         code="invalid_load_request")
    overrides = body.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise BadRequest("`overrides` must be an object", code="invalid_load_request", param="overrides")
    model = request.app[POOL].get(name).config
    launcher = launcher_for(model.backend)
    problems = override_problems(model, overrides, launcher.LOAD_OVERRIDES if launcher is not None else ())
    if "replicas" in body:
        problem = replicas_problem(body["replicas"], model.replica_max)
        if problem:
            problems.append(problem)
        else:
            overrides = {**overrides, "replicas": body["replicas"]}
    if not problems and overrides and launcher is not None:
        # Each override may be valid alone and still clash with the configured fields, or hold a
        # value the binary would refuse.
        problems = launcher.option_problems(model.with_overrides(overrides))
    if problems:
        raise BadRequest("; ".join(problems), code="invalid_load_request")
    return overrides


def actor_of(request: web.Request) -> str:
    """Who made an admin request, for the events feed: the peer's address (a reverse proxy's when
    there is one: a forwarded header is the client's word, not a fact) and whether it had to show
    the admin token."""
    token = "with the token" if request.app[SETTINGS].service.admin_token_env else "no token needed"
    return f"{request.get(PEER) or request.remote or 'unknown peer'} ({token})"


async def _act(request: web.Request, action: str, act: Callable[[str, str], Awaitable[ModelRuntime]],
               reason: str | None = None) -> web.Response:
    """Carry out an admin action on the model the path names and record it in the events feed with
    who asked: what it did, or its refusal with the code the caller got. Called after `admit`: a
    request that is not an admin's (no token, another site) leaves no event, so none can flood the
    feed."""
    pool = request.app[POOL]
    name = request.match_info["name"]
    actor = actor_of(request)
    known = name in pool.models
    # A name that is no model is the caller's text: quoted and cut, so it cannot forge a log line.
    shown = name if known else repr(name)[:80]
    try:
        runtime = await act(name, actor)
    except PoolError as exc:
        pool.events.record(ADMIN, f"{action} {shown} by {actor} refused: {exc.status} {exc.code}: {exc.message}",
                           model=name if known else None, reason=reason or action, cause=exc.code,
                           actor=actor, level=logging.WARNING)
        raise
    except Exception as exc:
        pool.events.record(ADMIN, f"{action} {shown} by {actor} failed: {type(exc).__name__}: {exc}",
                           model=name if known else None,
                           reason=reason or action, cause="internal_error", actor=actor, level=logging.ERROR)
        raise
    ready = len(runtime.ready())
    replicas = f", {ready} of {len(runtime.replicas)} replicas ready" if runtime.replicas else ""
    pool.events.record(ADMIN, f"{action} {name} by {actor}: {runtime.state.value}{replicas}", model=name,
                       reason=reason or action, actor=actor)
    return web.json_response(pool.describe(runtime))


@routes.post("/v1/admin/models/{name}/load")
async def admin_load(request: web.Request) -> web.Response:
    admit(request)
    pool = request.app[POOL]

    async def load(name: str, actor: str) -> ModelRuntime:
        pool.get(name)
        overrides = await _load_request(request, name)
        return await pool.detached(pool.load(name, overrides, actor=actor))
    return await _act(request, "load", load)


@routes.post("/v1/admin/models/{name}/unload")
async def admin_unload(request: web.Request) -> web.Response:
    admit(request)
    pool = request.app[POOL]

    async def unload(name: str, actor: str) -> ModelRuntime:
        pool.get(name)   # 404 before the body is read
        if request.can_read_body and await read_json(request):
            raise BadRequest("an unload takes no fields: send no body or {}", code="invalid_unload_request")
        return await pool.detached(pool.unload(name, actor=actor))
    return await _act(request, "unload", unload)


@routes.post("/v1/admin/models/{name}/adapters/{adapter}/load")
@routes.post("/v1/admin/models/{name}/adapters/{adapter}/unload")
async def admin_adapter(request: web.Request) -> web.Response:
    """Load or unload one of a model's LoRA adapters on every replica that serves (docs/adapters.md).
    vLLM changes what it holds at run time; llama-server holds its adapters from its start to its end
    (a load finds them there, an unload is refused: unloading the model frees them)."""
    admit(request)
    pool = request.app[POOL]
    action = request.path.rsplit("/", 1)[1]   # load or unload: the route's last part

    async def change(name: str, actor: str) -> ModelRuntime:
        runtime = pool.get(name)   # 404 model_not_found
        wanted = request.match_info["adapter"]
        adapter = runtime.config.adapter(wanted)
        if adapter is None:
            known = ", ".join(a.name for a in runtime.config.adapters) or "none"
            raise NotFound(f"model {name!r} has no LoRA adapter {wanted[:64]!r} (its adapters: {known})",
                           code="adapter_not_found", param="adapter")
        if request.can_read_body and await read_json(request):
            raise BadRequest(f"an adapter {action} takes no fields: send no body or {{}}",
                             code="invalid_adapter_request")
        serving = runtime.ready()
        if runtime.state != ModelState.LOADED or not serving:
            raise Conflict(f"model {name!r} is not loaded; its adapters come with its replicas "
                           f"(POST /v1/admin/models/{name}/load)", code="model_not_loaded", param="model")
        if not all(adapters.changeable(r) for r in serving):
            if action == "load":
                return runtime   # held since the replica's start
            raise Conflict(f"the engine of model {name!r} holds its LoRA adapters from its start until it stops; "
                           f"unload the model to free them", code="adapter_not_unloadable", param="adapter")
        do = adapters.load if action == "load" else adapters.unload
        await asyncio.gather(*(do(request.app[HTTP], r, adapter) for r in serving))
        return runtime
    return await _act(request, f"{action} adapter {request.match_info['adapter'][:64]!r} of", change,
                      reason=f"adapter_{action}")


@routes.post("/v1/admin/models/{name}/scale")
async def admin_scale(request: web.Request) -> web.Response:
    admit(request)
    pool = request.app[POOL]

    async def scale(name: str, actor: str) -> ModelRuntime:
        pool.get(name)   # 404 before the body is read
        body = await read_json(request) if request.can_read_body else {}
        if set(body) != {"replicas"}:
            raise BadRequest("a scale request is {\"replicas\": N}", code="invalid_scale_request", param="replicas")
        return await pool.detached(pool.scale(name, body["replicas"], actor=actor))
    return await _act(request, "scale", scale)


@routes.get("/v1/admin/gpu-memory")
async def admin_gpu_memory(request: web.Request) -> web.Response:
    admit(request)
    # NVML, /proc and model file headers are blocking reads: off the event loop.
    pool = request.app[POOL]
    report = await asyncio.to_thread(gpu_report, _snapshot(pool), request.app[VRAM])
    # Devices per host: this machine's are the report's own; each node reads its own, now.
    hosts = await pool.gpu_memory_by_host({k: report[k] for k in ("available", "gpus", "reason") if k in report})
    if hosts is not None:
        report["hosts"] = hosts
    return web.json_response(report)


@routes.get("/v1/admin/memory")
async def admin_memory(request: web.Request) -> web.Response:
    """What placement works with: each device's budget, what loaded models hold and loads in flight
    reserve, the count cap, and the loads in flight and waiting for room, in order."""
    admit(request)
    return web.json_response(request.app[POOL].memory_report())


@routes.get("/v1/admin/traffic")
async def admin_traffic(request: web.Request) -> web.Response:
    """The proxy's request counters per model (what /metrics exports), for a reader without
    Prometheus: the status page takes rates and quantiles from two readings."""
    admit(request)
    return web.json_response(traffic(request.app[METRICS], request.app[POOL].models))


@routes.get("/v1/admin/hosts")
async def admin_hosts(request: web.Request) -> web.Response:
    """Every host replicas may run on: whether its supervisord answers, its devices (a node's as it
    reported them), each limited device's budget and free memory, and the replicas it runs."""
    admit(request)
    return web.json_response({"object": "list", "data": request.app[POOL].describe_hosts()})


@routes.get("/v1/admin/processes")
async def admin_processes(request: web.Request) -> web.Response:
    """This process and, with service.workers > 1, its workers (docs/workers.md): each one's role,
    PID, open client connections and requests in flight."""
    admit(request)
    rows = await request.app[PROCESSES].view(request.app[SHUTDOWN].inflight)
    return web.json_response({"object": "list", "data": rows})


@routes.get("/v1/admin/events")
async def admin_events(request: web.Request) -> web.Response:
    """What happened, oldest first: loads, unloads with their reason and cause, evictions with the
    model they made room for, restarts, crashes, ejections, hosts down and up, admin actions with
    who. `after` (the last id seen, to poll), `limit`, `model` and `kind` (comma-separated) filter."""
    admit(request)
    events = request.app[POOL].events
    after = _int_param(request, "after", 0, 0, 2 ** 62, code="invalid_events_request")
    limit = _int_param(request, "limit", 200, 1, 1000, code="invalid_events_request")
    kinds = None
    if "kind" in request.query:
        kinds = frozenset(k for k in request.query["kind"].split(",") if k)
        unknown = sorted(kinds - set(EVENT_KINDS))
        if unknown or not kinds:
            raise BadRequest(f"`kind` must be comma-separated event kinds of {list(EVENT_KINDS)}",
                             code="invalid_events_request", param="kind")
    model = request.query.get("model")
    if model is not None:
        request.app[POOL].get(model)   # 404 model_not_found for a model that is not configured
    picked = events.since(after, limit, model=model, kinds=kinds)
    return web.json_response({"object": "list", "data": [e.to_json() for e in picked], "last_id": events.last_id})


MAX_LOG_BYTES = 1024 * 1024


def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int, code: str) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise BadRequest(f"`{name}` must be an integer from {lo} to {hi}", code=code, param=name)
    return value


@routes.get("/v1/admin/models/{name}/logs")
async def admin_logs(request: web.Request) -> web.Response:
    """A replica's log (stdout and stderr) through supervisord: the last `bytes` bytes, or with
    `offset` what came after it; the answer's `offset` is where the next poll starts (follow)."""
    admit(request)
    runtime = request.app[POOL].get(request.match_info["name"])
    if not runtime.replicas:
        raise Conflict(f"model {runtime.name!r} has no replicas to read a log from; load it first",
                       code="model_not_loaded")
    # A replica by its index (its name, `model/r<i>`), not its place in the list: a rolled model's
    # indices may have a gap (proxy/lifecycle/state/indices.py, free_indices).
    indices = [r.index for r in runtime.replicas]
    index = _int_param(request, "replica", indices[0], 0, max(indices), code="invalid_log_request")
    replica = next((r for r in runtime.replicas if r.index == index), None)
    if replica is None:
        raise BadRequest(f"model {runtime.name!r} has no replica {index}; its replicas are {indices}",
                         code="invalid_log_request", param="replica")
    length = _int_param(request, "bytes", 16384, 1, MAX_LOG_BYTES, code="invalid_log_request")
    offset = _int_param(request, "offset", 0, 0, 2 ** 62, code="invalid_log_request")
    if replica.spec is None:
        raise Conflict(f"replica {index} of model {runtime.name!r} is a remote endpoint, not a process of this "
                       "machine: it has no process log (the proxy's own log records its requests)",
                       code="no_process_log")
    # The supervisord of the replica's host: a node's log is read through its own XML-RPC
    # (tailProcessStdoutLog / readProcessStdoutLog, with its username and password).
    host = request.app[POOL].host_of(replica)
    supervisor = host.client
    overflow = False
    try:
        if "offset" not in request.query:
            text, end = await supervisor.tail_log_end(replica.fullname, length)
        else:
            _, size = await supervisor.tail_log_end(replica.fullname, 0)
            if offset > size:
                offset = 0  # supervisord rotated the log: the new file from its start
            if size - offset > length:
                offset, overflow = size - length, True  # more came than one poll takes: skip ahead
            text = await supervisor.read_log(replica.fullname, offset, size - offset) if size > offset else ""
            end = offset + len(text.encode("utf-8"))
    except SupervisorError as exc:
        where = "" if host.local else f" of host {host.name}"
        raise Unavailable(f"supervisord{where}: {exc}", code="supervisor_unavailable", retry_after=1) from exc
    return web.json_response({"model": runtime.name, "replica": index, "host": replica.host,
                              "program": replica.spec.program if replica.spec else None,
                              "text": text, "offset": end, "overflow": overflow})


def _snapshot(pool: Pool) -> list[ModelSnapshot]:
    """What the GPU report needs of each model, taken on the event loop (the report runs in a thread)."""
    return [ModelSnapshot(config=rt.config, state=rt.state.value,
                          # This machine's PIDs only: another host's are measured there (Host.gpu_memory).
                          replica_pids=tuple((r.index, r.pid) for r in rt.replicas
                                             if r.pid and r.alive and r.host == LOCAL_HOST))
            for rt in pool.models.values()]
