"""POST /v1/responses: the llm-pool contract on top of a backend's OpenAI chat endpoint.

JSON in one envelope, or SSE: `response.created` at once, `response.output_text.delta` for each
backend chunk as it arrives, then `response.metrics` and `response.completed`. A failure after the
stream began is an `error` event and then the end of the stream.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Mapping

import aiohttp
from aiohttp import web

from proxy import response_metrics
from proxy.capabilities import capabilities
from proxy.errors import BackendError, PoolError, sse_error_event
from proxy.forward import fairness_key, read_json, servable, slot, upstream
from proxy.keys import HTTP, POOL, SETTINGS
from proxy.responses import IGNORED_HEADER, backend_request, parse, validate_for_model
from proxy.runtime import ModelRuntime

routes = web.RouteTableDef()

CHAT_PATH = "/v1/chat/completions"


def _envelope(response_id: str, model: str, text: str, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    envelope: dict[str, Any] = {"id": response_id, "object": "response", "model": model,
                                "output": [{"type": "output_text", "text": text}], "output_text": text}
    if metrics is not None:
        envelope["metrics"] = metrics
    return envelope


def _upstream_error(status: int, raw: bytes) -> PoolError:
    """The backend's own error, passed on with its status."""
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode(errors="replace")[:500] or f"HTTP {status}"
    return BackendError(f"backend: {message}", code="backend_error", status=status)


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps({"type": name, **data}).encode() + b"\n\n"


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    timer = response_metrics.Timer()
    body = await read_json(request)
    req = parse(body)
    pool = request.app[POOL]
    runtime = servable(request, pool, req.model, body)
    model = runtime.active or runtime.config
    caps = capabilities(model)
    validate_for_model(req, model, caps)
    payload = backend_request(req, model, request.app[SETTINGS].decoding)
    request_id = request.headers.get("X-Request-Id") or f"req_{uuid.uuid4().hex}"
    headers = {"X-Request-Id": request_id, **({IGNORED_HEADER: ", ".join(req.ignored)} if req.ignored else {})}
    response_id = f"resp_{uuid.uuid4().hex}"
    queued = runtime.admission.enqueue(fairness_key(request, body))  # a full queue is a plain 429
    timer.mark("enqueued")
    if req.stream:
        return await _stream(request, timer, queued, runtime, payload, request_id, response_id, req.model, headers)

    async with slot(runtime, queued):
        timer.mark("admitted")
        timer.mark("sent")
        async with upstream(pool, request.app[HTTP], runtime, CHAT_PATH, payload, request_id) as (replica, resp):
            raw = await resp.read()
            timer.mark("received")
            own_timings = replica.reach.engine_timings
        if resp.status != 200:
            raise _upstream_error(resp.status, raw)
    try:
        answer = json.loads(raw)
        text = answer["choices"][0]["message"].get("content") or ""
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise BackendError("backend answered with an unreadable chat completion") from None
    timer.mark("finished")
    metrics = response_metrics.build(timer, answer.get("usage"), answer.get("timings") if own_timings else None)
    return web.json_response(_envelope(response_id, req.model, text, metrics), headers=headers)


async def _stream(request: web.Request, timer: response_metrics.Timer, queued: Any, runtime: ModelRuntime,
                  payload: dict[str, Any], request_id: str, response_id: str, model: str,
                  headers: Mapping[str, str]) -> web.StreamResponse:
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
    try:
        async with slot(runtime, queued):
            timer.mark("admitted")
            timer.mark("sent")
            async with upstream(request.app[POOL], request.app[HTTP], runtime, CHAT_PATH, payload,
                                request_id) as (replica, resp):
                if resp.status != 200:
                    raise _upstream_error(resp.status, await resp.read())
                async for chunk in _sse_data(resp):
                    for choice in chunk.get("choices") or []:
                        delta = (choice.get("delta") or {}).get("content")
                        if delta:
                            if timer.first_token is None:
                                timer.mark("first_token")
                            pieces.append(delta)
                            await out.write(_event("response.output_text.delta",
                                                   {"item_id": response_id, "delta": delta}))
                    usage = chunk.get("usage") or usage
                    if replica.reach.engine_timings:  # a provider's timings are not GPU times we measured
                        timings = chunk.get("timings") or timings
                timer.mark("received")
    except ConnectionResetError:
        return out  # the client left; its slot and the upstream request are already released
    except (PoolError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        err = exc if isinstance(exc, PoolError) else \
            BackendError(f"the backend broke off the stream: {type(exc).__name__}")
        await out.write(sse_error_event(err))
        await out.write_eof()
        return out
    timer.mark("finished")
    metrics = response_metrics.build(timer, usage, timings)
    await out.write(_event("response.metrics", {"metrics": metrics}))
    await out.write(_event("response.completed", {"response": _envelope(response_id, model, "".join(pieces), metrics)}))
    await out.write_eof()
    return out


async def _sse_data(resp: aiohttp.ClientResponse) -> Any:
    """The JSON payloads of an upstream SSE stream, one per `data:` line, as they arrive."""
    async for line in resp.content:
        if not line.startswith(b"data:"):
            if line.startswith(b"event: error"):
                raise BackendError("the backend reported an error in its stream")
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            continue
