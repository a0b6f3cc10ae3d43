"""OpenAI-compatible pass-through: take a slot, pick a replica, forward, stream back as it arrives."""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import Any, AsyncIterator, Hashable

import aiohttp
from aiohttp import web

from proxy.errors import BackendError, BadRequest, Conflict, TooLarge, Unavailable, sse_error_event
from proxy.fairness import normalize_key
from proxy.keys import MODEL, SETTINGS
from proxy.pool import Pool
from proxy.replicas import ModelState, Replica
from proxy.runtime import ModelRuntime

# Fields only llm-pool reads; a backend must never see them (the fairness key least of all).
PROXY_ONLY_FIELDS = ("fairness_key", "allow_remote")
# Generation can run for minutes; only connecting is bounded here.
UPSTREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5)


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SETTINGS].service.max_body_bytes
        raise TooLarge(f"request body is over the limit of {limit} bytes (service.max_body_bytes)") from None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return body


def requested_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required and must be a non-empty string", code="missing_model", param="model")
    return model


def fairness_key(request: web.Request, body: dict[str, Any]) -> str:
    """From the body's `fairness_key`, else the X-Fairness-Key header (for plain OpenAI clients)."""
    key = body.get("fairness_key")
    if key is not None and not isinstance(key, str):
        raise BadRequest("`fairness_key` must be a string", code="invalid_fairness_key", param="fairness_key")
    return normalize_key(key if key is not None else request.headers.get("X-Fairness-Key"))


def servable(request: web.Request, pool: Pool, name: str, body: dict[str, Any]) -> ModelRuntime:
    """The model's runtime if this request may be sent to it now; otherwise the right error."""
    runtime = pool.get(name)
    request[MODEL] = name
    if runtime.kind is not None:
        runtime.kind.gate(runtime.active or runtime.config, request.headers, body)  # e.g. allow_remote
    if runtime.state == ModelState.LOADING:
        raise Unavailable(f"model {name!r} is loading", code="model_loading", retry_after=5)
    if runtime.state == ModelState.UNLOADING:
        raise Unavailable(f"model {name!r} is being unloaded", code="model_unloading", retry_after=5)
    if runtime.state != ModelState.LOADED:
        raise Conflict(f"model {name!r} is configured but not loaded; load it with "
                       f"POST /v1/admin/models/{name}/load", code="model_not_loaded", param="model")
    if not runtime.ready():
        raise Unavailable(f"model {name!r} has no healthy replica right now", code="model_unavailable",
                          retry_after=2)
    return runtime


@contextlib.asynccontextmanager
async def slot(runtime: ModelRuntime, queued: tuple[Hashable, "asyncio.Future[None]"]) -> AsyncIterator[None]:
    """Hold one of the model's slots for the block, waiting for it under the fairness rules;
    `queued` is what `runtime.admission.enqueue` returned."""
    ticket = await runtime.admission.wait(queued)
    completed = True
    try:
        yield
    except asyncio.CancelledError:
        completed = False  # the client left: the slot frees now, and its running time still counts
        raise
    finally:
        runtime.admission.release(ticket, completed)


@contextlib.asynccontextmanager
async def upstream(pool: Pool, http: aiohttp.ClientSession, runtime: ModelRuntime, path: str,
                   payload: dict[str, Any], request_id: str) -> AsyncIterator[tuple[Replica, aiohttp.ClientResponse]]:
    """POST `payload` to the least loaded READY replica and yield its response.

    One retry: a replica that refuses the connection has died since it was picked; the request
    never reached it, so another replica may take it. Leaving the block closes the response, which
    ends the backend's work on it if it is still generating.
    """
    for _attempt in range(2):
        replica = runtime.pick_replica()
        if replica is None:
            break
        assert replica.reach is not None
        replica.inflight += 1
        try:
            try:
                resp = await replica.reach.post(http, path, payload, request_id, UPSTREAM_TIMEOUT)
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, ConnectionResetError) as exc:
                pool.report_connection_failure(replica, f"{type(exc).__name__}: {exc}")
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise BackendError(f"replica {replica.index} of {replica.model!r} failed: "
                                   f"{type(exc).__name__}") from exc
            async with resp:
                yield replica, resp
            return
        finally:
            replica.inflight -= 1
    raise Unavailable(f"model {runtime.name!r} has no healthy replica right now", code="model_unavailable",
                      retry_after=2)


async def forward(request: web.Request, pool: Pool, http: aiohttp.ClientSession, runtime: ModelRuntime,
                  path: str, body: dict[str, Any]) -> web.StreamResponse:
    """Pass an OpenAI request through to a replica and its answer back, streams as they arrive."""
    request_id = request.headers.get("X-Request-Id") or f"req_{uuid.uuid4().hex}"
    payload = {k: v for k, v in body.items() if k not in PROXY_ONLY_FIELDS}
    async with slot(runtime, runtime.admission.enqueue(fairness_key(request, body))), \
            upstream(pool, http, runtime, path, payload, request_id) as (replica, resp):
        return await _relay(request, replica, resp, request_id)


async def _relay(request: web.Request, replica: Replica, upstream: aiohttp.ClientResponse,
                 request_id: str) -> web.StreamResponse:
    content_type = upstream.headers.get("Content-Type", "application/json")
    if not content_type.startswith("text/event-stream"):
        try:
            body = await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise BackendError(f"replica {replica.index} of {replica.model!r} broke off its answer") from exc
        return web.Response(status=upstream.status, body=body,
                            headers={"Content-Type": content_type, "X-Request-Id": request_id})
    out = web.StreamResponse(status=upstream.status, headers={
        "Content-Type": content_type, "Cache-Control": "no-cache", "X-Request-Id": request_id})
    await out.prepare(request)
    try:
        # iter_any yields whatever bytes arrived, so each token reaches the client as it is made.
        async for chunk in upstream.content.iter_any():
            try:
                await out.write(chunk)
            except ConnectionResetError:
                # The client left: closing the upstream connection makes the backend stop generating.
                upstream.close()
                return out
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        err = BackendError(f"replica {replica.index} of {replica.model!r} broke off the stream: "
                           f"{type(exc).__name__}")
        await out.write(sse_error_event(err))
    await out.write_eof()
    return out
