"""POST /v1/responses: the llm-pool contract on top of a backend's OpenAI chat endpoint.

JSON in one envelope, or SSE: `response.created` at once, `response.output_text.delta` for each
backend chunk as it arrives, then `response.metrics` and `response.completed`. A failure after the
stream began is an `error` event and then the end of the stream: a backend that breaks its
stream (a malformed chunk, no `[DONE]`, a timeout) is never reported as `response.completed`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import Any, AsyncGenerator, Mapping

import aiohttp
from aiohttp import web

from proxy.errors import BackendError, PoolError, sse_error_event
from proxy.lifecycle.state.replicas import ModelState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.edge import response_metrics
from proxy.serving.affinity_key import affinity_key
from proxy.serving.body import fairness_key, priority_class, read_json, servable
from proxy.serving.chat_relay import Piece, relay_chat
from proxy.serving.fallbacks import with_fallbacks
from proxy.serving.image_urls import check_image_urls
from proxy.serving.keys import FAIRNESS_KEY, METRICS, POOL, REPLICA, REPLICA_HEADER, SETTINGS, STREAM_ERROR, USAGE
from proxy.serving.slot_reuse import note_reuse
from proxy.serving.responses import IGNORED_HEADER, backend_request, ignored_header, parse, validate_for_model
from proxy.serving.stream_usage import mark_ended, settle

log = logging.getLogger(__name__)
routes = web.RouteTableDef()


def _envelope(response_id: str, model: str, text: str, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    envelope: dict[str, Any] = {"id": response_id, "object": "response", "model": model,
                                "output": [{"type": "output_text", "text": text}], "output_text": text}
    if metrics is not None:
        envelope["metrics"] = metrics
    return envelope


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps({"type": name, **data}).encode() + b"\n\n"


@routes.post("/v1/responses")
@with_fallbacks
async def responses(request: web.Request) -> web.StreamResponse:
    timer = response_metrics.Timer()
    body = await read_json(request)
    req = parse(body)
    runtime = servable(request, request.app[POOL], req.model, body)
    validate_for_model(req, runtime.model, runtime.capabilities())
    await check_image_urls(body, runtime.model)
    payload = backend_request(req, runtime.model, runtime.traits, request.app[SETTINGS].decoding)
    affinity = affinity_key(runtime, request.path, request.headers, body, payload)
    request_id = request.headers.get("X-Request-Id") or f"req_{os.urandom(16).hex()}"
    headers = {"X-Request-Id": request_id, **({IGNORED_HEADER: ignored_header(req.ignored)} if req.ignored else {})}
    response_id = f"resp_{os.urandom(16).hex()}"
    cold = runtime.state != ModelState.LOADED   # it waits for its model to load (on demand)
    # a full queue is a plain 429
    queued = runtime.admission.enqueue(fairness_key(request, body), priority_class(request, runtime.policy))
    timer.mark("enqueued")
    relay = relay_chat(request, runtime, queued, payload, request_id, timer, affinity, cold)
    if req.stream:
        return await _as_events(request, relay, timer, queued, runtime, response_id, runtime.name, headers, payload)
    return await _as_json(request, relay, timer, runtime, response_id, runtime.name, headers)


async def _as_json(request: web.Request, relay: AsyncGenerator[Piece, None], timer: response_metrics.Timer,
                   runtime: ModelRuntime, response_id: str, model: str, headers: Mapping[str, str]) -> web.Response:
    async with contextlib.aclosing(relay):
        pieces = [piece async for piece in relay]
    timer.mark("finished")
    metrics = response_metrics.build(timer, pieces[-1].usage, pieces[-1].timings)
    _count(request, runtime.name, metrics, None)
    text = "".join(p.text for p in pieces)
    # A stream's headers go out with response.created, before a replica is chosen: only here.
    return web.json_response(_envelope(response_id, model, text, metrics),
                             headers={**headers, REPLICA_HEADER: str(request[REPLICA].index)})


async def _as_events(request: web.Request, relay: AsyncGenerator[Piece, None], timer: response_metrics.Timer,
                     queued: Any, runtime: ModelRuntime, response_id: str, model: str,
                     headers: Mapping[str, str], payload: Mapping[str, Any]) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    try:
        await out.prepare(request)
        await out.write(_event("response.created", {"response": _envelope(response_id, model, "", None)}))
    except BaseException:
        runtime.admission.abandon(queued)  # the client is gone before it took its place
        raise
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    whole = began = False
    try:
        # aclosing: a client that leaves while a piece is written ends the relay (slot, upstream) now.
        async with contextlib.aclosing(relay):
            async for piece in relay:
                began = True
                if piece.text:
                    if timer.first_token is None:
                        timer.mark("first_token")
                    pieces.append(piece.text)
                    await out.write(_event("response.output_text.delta",
                                           {"item_id": response_id, "delta": piece.text}))
                usage = piece.usage or usage
                timings = piece.timings or timings
        whole = True
    except ConnectionResetError:
        return out  # the client left; its slot and the upstream request are already released
    except (PoolError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        err = exc if isinstance(exc, PoolError) else \
            BackendError(f"the backend broke off the stream: {type(exc).__name__}")
        log.warning("POST /v1/responses stream ended with an error: %s", err.message)
        request[STREAM_ERROR] = err.metric_code
        return await _end_with(out, err)
    except Exception:
        # A bug of ours: the client still gets an error event, never a silent close.
        log.exception("POST /v1/responses stream failed")
        request[STREAM_ERROR] = "internal_error"
        return await _end_with(out, PoolError("internal error in llm-pool; see the proxy log"))
    finally:
        if began and not whole:
            # Cut short (a cancelled handler too): what went out is counted, before the metrics
            # middleware records the request. One that never began (it waited for a slot, the
            # backend refused it) is charged nothing.
            settle(request, runtime.name, payload, usage, len(pieces), request.get(REPLICA))
    timer.mark("finished")
    metrics = response_metrics.build(timer, usage, timings)
    _count(request, runtime.name, metrics,
           timer.first_token - timer.handler if timer.first_token is not None else None)
    await out.write(_event("response.metrics", {"metrics": metrics}))
    with contextlib.suppress(ConnectionResetError):
        await out.write(_event("response.completed",
                               {"response": _envelope(response_id, model, "".join(pieces), metrics)}))
        mark_ended(request, out)
        await out.write_eof()
    return out


def _count(request: web.Request, model: str, metrics: Mapping[str, Any], first_text_s: float | None) -> None:
    counters = request.app[METRICS]
    request[USAGE] = counters.count_response(model, counters.key_label(request.get(FAIRNESS_KEY)), metrics,
                                             first_text_s, request.get(REPLICA))
    note_reuse(request, request.get(REPLICA), {"prompt_tokens": metrics.get("engine_prompt_tokens"),
                                               "cached_tokens": metrics.get("engine_cached_prompt_tokens")})


async def _end_with(out: web.StreamResponse, err: PoolError) -> web.StreamResponse:
    try:
        await out.write(sse_error_event(err))
        await out.write_eof()
    except ConnectionResetError:
        pass  # the client left as well
    return out
