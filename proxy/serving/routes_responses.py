"""POST /v1/responses: the llm-pool contract on top of a backend's OpenAI chat endpoint.

JSON in one envelope, or SSE: `response.created` at once, `response.output_text.delta` for each
backend chunk as it arrives, then `response.metrics` and `response.completed`. A failure after the
stream began is an `error` event and then the end of the stream: a backend that breaks its
stream (a malformed chunk, no `[DONE]`, a timeout) is never reported as `response.completed`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Mapping

import aiohttp
from aiohttp import web

from proxy.serving import response_metrics
from proxy.capabilities import capabilities
from proxy.errors import BackendError, PoolError, sse_error_event
from proxy.serving.forward import fairness_key, label, read_answer, read_json, servable, slot, timeouts_of, upstream
from proxy.serving.image_urls import check_image_urls
from proxy.serving.keys import FAIRNESS_KEY, HTTP, METRICS, POOL, SETTINGS, STREAM_ERROR
from proxy.serving.relay import sse_data
from proxy.serving.responses import IGNORED_HEADER, backend_request, parse, validate_for_model
from proxy.lifecycle.runtime import ModelRuntime

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

CHAT_PATH = "/v1/chat/completions"


def _envelope(response_id: str, model: str, text: str, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    envelope: dict[str, Any] = {"id": response_id, "object": "response", "model": model,
                                "output": [{"type": "output_text", "text": text}], "output_text": text}
    if metrics is not None:
        envelope["metrics"] = metrics
    return envelope


def _numbers(value: Any) -> dict[str, Any] | None:
    """A backend's usage or timings object, keeping numbers only (and usage's token details), so
    that garbage there cannot break the metrics."""
    if not isinstance(value, dict):
        return None
    kept: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            kept[key] = item
        elif key == "prompt_tokens_details" and isinstance(item, dict):
            kept[key] = _numbers(item)
    return kept


def _text_of_chunk(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices")
    pieces = []
    for choice in choices if isinstance(choices, list) else []:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        content = delta.get("content") if isinstance(delta, dict) else None
        if isinstance(content, str):
            pieces.append(content)
    return "".join(pieces)


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
    await check_image_urls(body, model)
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
        timeouts = timeouts_of(pool, runtime)
        async with upstream(pool, request.app[HTTP], runtime, CHAT_PATH, payload, request_id,
                            timeouts) as (replica, resp):
            raw = await read_answer(pool, replica, resp, timeouts)
            timer.mark("received")
            own_timings = replica.reach.engine_timings
    try:
        answer = json.loads(raw)
        text = answer["choices"][0]["message"].get("content") or ""
        if not isinstance(text, str):
            raise TypeError("content is not a string")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError):
        pool.report_outcome(replica, "unreadable chat completion")
        log.warning("POST /v1/responses: %s answered an unreadable chat completion", label(replica))
        raise BackendError(f"{label(replica)} answered with an unreadable chat completion") from None
    timer.mark("finished")
    metrics = response_metrics.build(timer, _numbers(answer.get("usage")),
                                     _numbers(answer.get("timings")) if own_timings else None)
    _count(request, runtime.name, metrics, None)
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
    pool = request.app[POOL]
    try:
        async with slot(runtime, queued):
            timer.mark("admitted")
            timer.mark("sent")
            timeouts = timeouts_of(pool, runtime)
            async with upstream(pool, request.app[HTTP], runtime, CHAT_PATH, payload, request_id,
                                timeouts) as (replica, resp):
                if resp.status != 200 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                    await read_answer(pool, replica, resp, timeouts)
                    raise BackendError(f"{label(replica)} did not answer with an event stream")
                try:
                    async for chunk in sse_data(resp, timeouts, label(replica)):
                        delta = _text_of_chunk(chunk)
                        if delta:
                            if timer.first_token is None:
                                timer.mark("first_token")
                            pieces.append(delta)
                            await out.write(_event("response.output_text.delta",
                                                   {"item_id": response_id, "delta": delta}))
                        usage = _numbers(chunk.get("usage")) or usage
                        if replica.reach.engine_timings:  # a provider's timings are not GPU times we measured
                            timings = _numbers(chunk.get("timings")) or timings
                except ConnectionResetError:
                    raise  # the client left (aiohttp's reset error is a ClientConnectionError too)
                except (PoolError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                    resp.close()
                    pool.report_outcome(replica, exc.message if isinstance(exc, PoolError) else type(exc).__name__)
                    raise
                pool.report_outcome(replica, None)
                timer.mark("received")
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
    timer.mark("finished")
    metrics = response_metrics.build(timer, usage, timings)
    _count(request, runtime.name, metrics,
           timer.first_token - timer.handler if timer.first_token is not None else None)
    await out.write(_event("response.metrics", {"metrics": metrics}))
    await out.write(_event("response.completed", {"response": _envelope(response_id, model, "".join(pieces), metrics)}))
    await out.write_eof()
    return out


def _count(request: web.Request, model: str, metrics: Mapping[str, Any], first_text_s: float | None) -> None:
    counters = request.app[METRICS]
    counters.count_response(model, counters.key_label(request.get(FAIRNESS_KEY)), metrics, first_text_s)


async def _end_with(out: web.StreamResponse, err: PoolError) -> web.StreamResponse:
    try:
        await out.write(sse_error_event(err))
        await out.write_eof()
    except ConnectionResetError:
        pass  # the client left as well
    return out
