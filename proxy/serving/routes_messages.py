"""POST /v1/messages: Anthropic's Messages API, for the Anthropic SDK and the agents built on it.

A replica that speaks it (llama-server) gets the request as it is, and its answer passes back,
streams event by event, like any pass-through. For one that does not (the shims, a remote chat
provider), and for a model with LoRA adapters, it is translated onto chat completions and back
(proxy/edge/anthropic.py). Either way
the request goes through all the pool does: fairness, queue bounds, affinity (the system prompt
and messages hash as chat's do), load on demand, failover before the first byte, timeouts,
metrics. Errors on this route, the pool's own included, are in Anthropic's shape
(errors_http.error_middleware).
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, AsyncGenerator

import aiohttp
from aiohttp import web

from proxy.errors import BackendError, PoolError
from proxy.lifecycle.state.replicas import ModelState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.edge import anthropic, response_metrics
from proxy.serving.affinity_key import affinity_key
from proxy.serving.body import fairness_key, priority_class, read_body, requested_model, servable
from proxy.serving.chat_relay import CHAT_PATH, Piece, count_usage, relay_chat
from proxy.edge.anthropic import MESSAGES_PATH
from proxy.serving.fallbacks import with_fallbacks
from proxy.serving.forward import forward
from proxy.serving.image_urls import check_image_urls
from proxy.serving.keys import POOL, REPLICA, REPLICA_HEADER, STREAM_ERROR
from proxy.serving.stream_usage import mark_ended, settle

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

@routes.post(MESSAGES_PATH)
@with_fallbacks
async def messages(request: web.Request) -> web.StreamResponse:
    body, raw = await read_body(request)
    name = requested_model(body)
    anthropic.check_request(body)   # before servable: a malformed request loads nothing on demand
    runtime = servable(request, request.app[POOL], name, body, endpoint=request.path)
    name = runtime.name   # the model that answers (an alias's, a fallback)
    chat = anthropic.to_chat(body)
    await check_image_urls(chat, runtime.model)   # the same URLs as the body's image blocks
    affinity = affinity_key(runtime, CHAT_PATH, request.headers, body, chat)
    key = fairness_key(request, body)
    # A model with LoRA adapters goes through chat: llama-server's own Messages endpoint does not
    # read a request's `lora` list (measured: it ran every request at the server's global scales).
    if "messages" in runtime.traits.apis and not runtime.config.adapters:
        return await forward(request, runtime, key, body, affinity, raw)
    request_id = request.headers.get("X-Request-Id") or f"req_{os.urandom(16).hex()}"
    timer = response_metrics.Timer()
    cold = runtime.state != ModelState.LOADED   # it waits for its model to load (on demand)
    queued = runtime.admission.enqueue(key, priority_class(request, runtime.policy))   # a full queue: a plain 429
    timer.mark("enqueued")
    relay = relay_chat(request, runtime, queued, chat, request_id, timer, affinity, cold)
    message_id = f"msg_{os.urandom(12).hex()}"
    headers = {"X-Request-Id": request_id}
    if chat.get("stream"):
        return await _as_events(request, relay, queued, runtime, anthropic.MessageStream(name, message_id), headers,
                                chat)
    async with contextlib.aclosing(relay):
        pieces = [piece async for piece in relay]
    last = pieces[-1]
    count_usage(request, runtime, last)
    calls = [call for p in pieces for call in p.tool_calls or ()]
    answer = anthropic.to_message(_completion("".join(p.text for p in pieces), last, calls), name, message_id)
    return web.json_response(answer, headers={**headers, REPLICA_HEADER: str(request[REPLICA].index)})


def _completion(text: str, last: Piece, calls: list[Any]) -> dict[str, Any]:
    """The chat completion the pieces make, as anthropic.to_message reads one."""
    return {"choices": [{"message": {"content": text, "tool_calls": calls}, "finish_reason": last.finish_reason}],
            "usage": last.usage or {}}


async def _as_events(request: web.Request, relay: AsyncGenerator[Piece, None], queued: Any, runtime: ModelRuntime,
                     stream: anthropic.MessageStream, headers: dict[str, str],
                     chat: dict[str, Any]) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    try:
        await out.prepare(request)
        await out.write(stream.start())
    except BaseException:
        runtime.admission.abandon(queued)  # the client is gone before it took its place
        raise
    last: Piece | None = None
    texts = 0   # the text and tool call events that went out: what an answer cut short is charged for
    try:
        # aclosing: a client that leaves while an event is written ends the relay (slot, upstream) now.
        async with contextlib.aclosing(relay):
            async for piece in relay:
                # The usage chunk comes last, with no text: what it and the finish reason say is kept.
                finish = piece.finish_reason or (last.finish_reason if last is not None else None)
                last = Piece(piece.text, piece.usage or (last.usage if last is not None else None), None, finish)
                event = stream.feed(_chunk(piece))
                if event:
                    await out.write(event)
                    texts += 1
    except ConnectionResetError:
        return out  # the client left; its slot and the upstream request are already released
    except (PoolError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
        err = exc if isinstance(exc, PoolError) else \
            BackendError(f"the backend broke off the stream: {type(exc).__name__}")
        log.warning("POST %s stream ended with an error: %s", MESSAGES_PATH, err.message)
        request[STREAM_ERROR] = err.metric_code
        return await _end_with(out, err)
    except Exception:
        log.exception("POST %s stream failed", MESSAGES_PATH)   # a bug of ours: still an error event
        request[STREAM_ERROR] = "internal_error"
        return await _end_with(out, PoolError("internal error in llm-pool; see the proxy log"))
    finally:
        # However it ended (a cancelled handler too), before the metrics middleware records it; a
        # stream that never began (it waited for a slot, the backend refused it) is charged nothing.
        if last is not None:
            settle(request, runtime.name, chat, last.usage, texts, request.get(REPLICA))
    with contextlib.suppress(ConnectionResetError):
        await out.write(stream.end())
        mark_ended(request, out)
        await out.write_eof()
    return out


def _chunk(piece: Piece) -> dict[str, Any]:
    """A piece as the chat stream chunk it came from, for anthropic.MessageStream."""
    return {"choices": [{"delta": {"content": piece.text, "tool_calls": piece.tool_calls},
                         "finish_reason": piece.finish_reason}], "usage": piece.usage}


async def _end_with(out: web.StreamResponse, err: PoolError) -> web.StreamResponse:
    with contextlib.suppress(ConnectionResetError):
        await out.write(anthropic.error_event(err))
        await out.write_eof()
    return out
