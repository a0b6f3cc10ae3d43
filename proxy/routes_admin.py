"""The admin API: model state, load with temporary overrides, graceful unload, GPU memory."""
from __future__ import annotations

import hmac
import os
from typing import Any

from aiohttp import web

from launchers import launcher_for
from proxy.config import override_problems
from proxy.errors import BadRequest, Unauthorized
from proxy.forward import read_json
from proxy.gpu import gpu_memory
from proxy.keys import POOL, SETTINGS

routes = web.RouteTableDef()


def _authorize(request: web.Request) -> None:
    """When service.admin_token_env names a variable, admin calls need that bearer token. `serve`
    refuses to start when it is unset or empty; should it become empty later, every call is refused."""
    env = request.app[SETTINGS].service.admin_token_env
    if not env:
        return
    token = os.environ.get(env, "").strip()
    if not token:
        raise Unauthorized(f"the admin API is closed: {env} is unset or empty")
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise Unauthorized("admin endpoints need `Authorization: Bearer <admin token>`")


@routes.get("/v1/admin/models")
async def admin_models(request: web.Request) -> web.Response:
    _authorize(request)
    pool = request.app[POOL]
    return web.json_response({"object": "list", "data": [rt.describe() for rt in pool.models.values()]})


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
    problems = override_problems(model, overrides, getattr(launcher, "LOAD_OVERRIDES", ()))
    combined = getattr(launcher, "option_problems", None)
    if not problems and combined is not None:
        # Each override may be valid alone and still clash with the configured fields.
        problems = combined(model.with_overrides(overrides))
    if "replicas" in body:
        replicas = body["replicas"]
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= model.replica_max:
            problems.append(f"replicas: must be an integer from 1 to replica_max ({model.replica_max})")
        else:
            overrides = {**overrides, "replicas": replicas}
    option_problems = getattr(launcher, "option_problems", None)
    if not problems and overrides and option_problems is not None:
        problems = option_problems(model.with_overrides(overrides))  # values the binary would refuse
    if problems:
        raise BadRequest("; ".join(problems), code="invalid_load_request")
    return overrides


@routes.post("/v1/admin/models/{name}/load")
async def admin_load(request: web.Request) -> web.Response:
    _authorize(request)
    name = request.match_info["name"]
    pool = request.app[POOL]
    pool.get(name)
    overrides = await _load_request(request, name)
    runtime = await pool.detached(pool.load(name, overrides))
    return web.json_response(runtime.describe())


@routes.post("/v1/admin/models/{name}/unload")
async def admin_unload(request: web.Request) -> web.Response:
    _authorize(request)
    pool = request.app[POOL]
    runtime = await pool.detached(pool.unload(request.match_info["name"]))
    return web.json_response(runtime.describe())


@routes.get("/v1/admin/gpu-memory")
async def admin_gpu_memory(request: web.Request) -> web.Response:
    _authorize(request)
    return web.json_response(gpu_memory(request.app[POOL]))
