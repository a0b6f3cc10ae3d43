"""OpenAI-compatible pass-through: take a slot, pick a replica, forward, stream back as it arrives."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Hashable

import aiohttp
from aiohttp import web

from proxy.errors import (BackendError, BackendTimeout, BadRequest, Conflict, PoolError, TooLarge, Unavailable,
                          sse_error_event)
from proxy.fairness import normalize_key
from proxy.serving.keys import FAIRNESS_KEY, METRICS, MODEL, SETTINGS, STARTED, STREAM_ERROR
from proxy.serving.metrics import usage_in
from proxy.lifecycle.pool import Pool
from proxy.serving.relay import Timeouts, backend_error, chunks, read_capped, within
from proxy.lifecycle.replicas import ModelState, Replica
from proxy.lifecycle.runtime import ModelRuntime

log = logging.getLogger(__name__)

# Fields only llm-pool reads; a backend must never see them (the fairness key least of all).
PROXY_ONLY_FIELDS = ("fairness_key", "allow_remote")
# Only connecting is bounded here; waiting for the answer is bounded by the model's Timeouts.
UPSTREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5)
# Deeper bodies are refused before anything walks them (schema checks, re-encoding recurse).
MAX_JSON_DEPTH = 128
# How a send fails on a pooled connection that the server had already closed, before any byte of
# an answer: the read meets the close, or the write or read is reset (aiohttp >= 3.10 raises its
# ClientConnectionResetError, a ConnectionResetError, for a write to a closing transport). A
# refused connection, ClientConnectorError, is a ClientOSError too but is not one of these.
CLOSED_UNDER_US = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionResetError)


class _Send:
    """One request's way to a replica: whether aiohttp put it on a pooled (reused) connection, and
    the session of its second send, if it needed one."""

    def __init__(self) -> None:
        self.reused = False
        self.second: aiohttp.ClientSession | None = None


# The request being sent in this task. A context variable, because a replica's Reach builds the
# request itself: aiohttp runs trace callbacks in the sending task, so what they note is its own.
_SEND: contextvars.ContextVar[_Send] = contextvars.ContextVar("upstream_send")


async def _request_starts(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
    send = _SEND.get(None)
    if send is not None:
        send.reused = False   # what counts is the request that failed (a Reach may send several)


async def _connection_reused(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
    send = _SEND.get(None)
    if send is not None:
        send.reused = True


def upstream_session() -> aiohttp.ClientSession:
    """The app's one pooled session for every upstream call. No per-connection limit, since
    admission already bounds how many requests a replica gets. It notes which sends went out on a
    reused connection: the one failure upstream() sends again."""
    tracing = aiohttp.TraceConfig()
    tracing.on_request_start.append(_request_starts)
    tracing.on_connection_reuseconn.append(_connection_reused)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0), trace_configs=[tracing])


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SETTINGS].service.max_body_bytes
        raise TooLarge(f"request body is over the limit of {limit} bytes (service.max_body_bytes)") from None
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    if _deeper_than(body, MAX_JSON_DEPTH):
        raise _too_deep()
    return body


def _too_deep() -> BadRequest:
    return BadRequest(f"request body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json")


def _deeper_than(value: Any, limit: int) -> bool:
    """Iterative, so a deep document cannot exhaust the stack while it is measured."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


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
    key = normalize_key(key if key is not None else request.headers.get("X-Fairness-Key"))
    request[FAIRNESS_KEY] = key
    return key


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


def label(replica: Replica) -> str:
    return f"replica {replica.index} of {replica.model!r}"


def timeouts_of(pool: Pool, runtime: ModelRuntime) -> Timeouts:
    return Timeouts.of(pool.settings.service, runtime.active or runtime.config)


@contextlib.asynccontextmanager
async def upstream(pool: Pool, http: aiohttp.ClientSession, runtime: ModelRuntime, path: str,
                   payload: dict[str, Any], request_id: str,
                   timeouts: Timeouts) -> AsyncIterator[tuple[Replica, aiohttp.ClientResponse]]:
    """POST `payload` to the least loaded READY replica that has room and yield its response once
    its headers arrive (within first_byte_timeout_s, else 504 `backend_timeout`).

    Retried on another replica only when the connection was refused: the request never reached
    the replica. Sent once more to the same replica, on a new connection, when it failed on a
    reused one before any answer came back (`_post`): that never reached a live server either,
    and counts for nothing. (A server that reads a request and then drops a kept-alive connection
    looks the same from here, and gets it twice.) Any other request dropped after it was sent,
    that second send's failure included, is not replayed (it may be what brings replicas down) and
    does not take its replica out of rotation by itself: it counts toward ejection, and the health
    check decides. Leaving the block closes the response, which ends the backend's work on it if
    it is still generating.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeouts.first_byte_s
    for _attempt in range(len(runtime.replicas) + 1):
        replica = runtime.pick_replica()
        while replica is None and runtime.ready() and loop.time() < deadline:
            # Every READY replica already has target_inflight requests (one left READY with its
            # requests still running there): wait for a place rather than overload one.
            await runtime.wait_changed(deadline - loop.time())
            replica = runtime.pick_replica()
        if replica is None:
            break
        assert replica.reach is not None
        replica.inflight += 1
        replica.sent += 1
        send = _Send()
        try:
            try:
                resp = await within(_post(send, http, replica, path, payload, request_id),
                                    max(0.0, deadline - loop.time()))
            except aiohttp.ClientConnectorError as exc:
                pool.report_connection_failure(replica, f"{type(exc).__name__}: {exc}")
                if send.second is None:
                    continue
                # Refused on a new connection just after a reused one was dropped: the replica is
                # gone, perhaps because of this very request, so no other replica is given it.
                raise BackendError(f"{label(replica)} dropped the request: {type(exc).__name__}") from exc
            except asyncio.TimeoutError:
                pool.report_outcome(replica, "no answer within first_byte_timeout_s")
                raise BackendTimeout(f"{label(replica)} sent no answer within {timeouts.first_byte_s:g}s "
                                     "(first_byte_timeout_s)") from None
            except (aiohttp.ClientError, OSError) as exc:
                pool.report_outcome(replica, f"dropped the request: {type(exc).__name__}")
                raise BackendError(f"{label(replica)} dropped the request: {type(exc).__name__}") from exc
            async with resp:
                yield replica, resp
            return
        finally:
            runtime.release(replica)
            if send.second is not None:
                await send.second.close()
    raise Unavailable(f"model {runtime.name!r} has no healthy replica right now", code="model_unavailable",
                      retry_after=2)


async def _post(send: _Send, http: aiohttp.ClientSession, replica: Replica, path: str, payload: dict[str, Any],
                request_id: str) -> aiohttp.ClientResponse:
    """Send to the replica; if that failed on a reused connection before any answer, once more on a
    new one. A server closes a kept-alive connection at its keep-alive timeout and (the pinned
    llama-server, measured) after every streamed answer; a pool can hand out such a connection
    before its close arrives, and a request written to it never reached the server. The second send
    gets a session of its own (`send.second`, closed by the caller), whose connector never pools:
    only that is sure to open a new connection, and it is needed this rarely. A failure there is
    what it is (upstream() decides)."""
    assert replica.reach is not None
    token = _SEND.set(send)
    try:
        return await replica.reach.post(http, path, payload, request_id, UPSTREAM_TIMEOUT)
    except CLOSED_UNDER_US as exc:
        if isinstance(exc, aiohttp.ClientConnectorError) or not send.reused:
            raise
        log.info("%s: a reused connection was closed under the request (%s); sending it again on a new one",
                 label(replica), type(exc).__name__)
    finally:
        _SEND.reset(token)
    send.second = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    return await replica.reach.post(send.second, path, payload, request_id, UPSTREAM_TIMEOUT)


async def forward(request: web.Request, pool: Pool, http: aiohttp.ClientSession, runtime: ModelRuntime,
                  path: str, body: dict[str, Any]) -> web.StreamResponse:
    """Pass an OpenAI request through to a replica and its answer back, streams as they arrive."""
    request_id = request.headers.get("X-Request-Id") or f"req_{uuid.uuid4().hex}"
    payload = {k: v for k, v in body.items() if k not in PROXY_ONLY_FIELDS}
    queued = runtime.admission.enqueue(fairness_key(request, body))
    enqueued = time.perf_counter()
    async with slot(runtime, queued):
        request.app[METRICS].queue_wait.labels(runtime.name).observe(time.perf_counter() - enqueued)
        timeouts = timeouts_of(pool, runtime)
        async with upstream(pool, http, runtime, path, payload, request_id, timeouts) as (replica, resp):
            return await _relay(request, pool, replica, resp, request_id, timeouts)


async def read_answer(pool: Pool, replica: Replica, resp: aiohttp.ClientResponse, timeouts: Timeouts) -> bytes:
    """A non-streamed answer, whole, within service.max_response_bytes; a backend error (5xx, or an
    answer that is not JSON) is raised as an OpenAI error and counted against the replica."""
    try:
        raw = await read_capped(resp, timeouts, pool.settings.service.max_response_bytes, label(replica))
    except (PoolError, aiohttp.ClientError) as exc:
        reason = exc.message if isinstance(exc, PoolError) else f"broke off its answer: {type(exc).__name__}"
        pool.report_outcome(replica, reason)
        if isinstance(exc, PoolError):
            raise
        raise BackendError(f"{label(replica)} {reason}") from exc
    content_type = resp.headers.get("Content-Type", "")
    if resp.status >= 400 or "json" not in content_type:
        pool.report_outcome(replica, f"HTTP {resp.status}" if resp.status >= 500 else None)
        raise backend_error(resp.status if resp.status >= 400 else 502, raw, label(replica),
                            retry_after=resp.headers.get("Retry-After"))
    pool.report_outcome(replica, None)
    return raw


async def _relay(request: web.Request, pool: Pool, replica: Replica, upstream: aiohttp.ClientResponse,
                 request_id: str, timeouts: Timeouts) -> web.StreamResponse:
    content_type = upstream.headers.get("Content-Type", "application/json")
    metrics = request.app[METRICS]
    if not content_type.startswith("text/event-stream") or upstream.status != 200:
        body = await read_answer(pool, replica, upstream, timeouts)
        metrics.count_usage(replica.model, metrics.key_label(request.get(FAIRNESS_KEY)), usage_in(body))
        return web.Response(status=upstream.status, body=body,
                            headers={"Content-Type": content_type, "X-Request-Id": request_id})
    out = web.StreamResponse(status=upstream.status, headers={
        "Content-Type": content_type, "Cache-Control": "no-cache", "X-Request-Id": request_id})
    await out.prepare(request)
    # The last three reads: the usage chunk (sent last, with stream_options.include_usage) is among
    # them, so only they are scanned, once, after the stream; nothing is copied per chunk.
    oldest = older = last = b""
    try:
        # Whatever bytes arrived, so each token reaches the client as it is made.
        async for chunk in chunks(upstream, timeouts, label(replica)):
            if not last:
                metrics.ttft.labels(replica.model, request.path).observe(time.perf_counter() - request[STARTED])
            oldest, older, last = older, last, chunk
            try:
                await out.write(chunk)
            except ConnectionResetError:
                # The client left: closing the upstream connection makes the backend stop generating.
                upstream.close()
                return out
    except (BackendTimeout, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
        upstream.close()
        err = exc if isinstance(exc, PoolError) else \
            BackendError(f"{label(replica)} broke off the stream: {type(exc).__name__}")
        log.warning("%s %s: %s", request.method, request.path, err.message)
        request[STREAM_ERROR] = err.metric_code
        pool.report_outcome(replica, err.message)
        with contextlib.suppress(ConnectionResetError):
            await out.write(sse_error_event(err))
            await out.write_eof()
        return out
    pool.report_outcome(replica, None)
    metrics.count_usage(replica.model, metrics.key_label(request.get(FAIRNESS_KEY)), usage_in(oldest + older + last))
    await out.write_eof()
    return out
