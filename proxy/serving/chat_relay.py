"""One request through the pool onto a replica's chat endpoint, for the routes that translate
(/v1/responses, and /v1/messages where the replica does not speak it): wait for a slot, send to a
replica, and yield the answer's text as it comes (a JSON answer as one piece, a stream chunk by
chunk). A backend failure is raised; the route's output decides how the client hears it.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncGenerator

import aiohttp
from aiohttp import web

from proxy.errors import BackendError, PoolError
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.edge import response_metrics
from proxy.serving.forward import Slot, label, read_answer, upstream
from proxy.serving.keys import (ADAPTER, CACHE_SCOPE, ENGINE_SLOT, FAIRNESS_KEY, HTTP, METRICS, POOL, QUEUE_WAIT,
                                REPLICA, SETTINGS, USAGE)
from proxy.serving.slot_reuse import note_reuse
from proxy.edge.relay import Timeouts, sse_data

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"


@dataclass
class Piece:
    """What the relay hands its output: text, and the backend's usage, timings, finish reason and
    tool calls (a message's, or a stream chunk's pieces of them: untrusted, as sent) when it sent them."""

    text: str
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    finish_reason: str | None = None
    tool_calls: list[Any] | None = None


def numbers(value: Any) -> dict[str, Any] | None:
    """A backend's usage or timings object, keeping numbers only (and usage's token details), so
    that garbage there cannot break the metrics."""
    if not isinstance(value, dict):
        return None
    kept: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            kept[key] = item
        elif key == "prompt_tokens_details" and isinstance(item, dict):
            kept[key] = numbers(item)
    return kept


def _piece_of_chunk(chunk: dict[str, Any], own_timings: bool) -> Piece:
    """A stream chunk's text, usage, timings, finish reason and tool calls' pieces (untrusted:
    anything else reads as none)."""
    choices = chunk.get("choices")
    pieces = []
    finish = None
    calls: list[Any] = []
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(choice.get("text"), str):   # a completions stream's chunk
            pieces.append(choice["text"])
        elif isinstance(delta, dict):
            content = delta.get("content")
            if isinstance(content, str):
                pieces.append(content)
            if isinstance(delta.get("tool_calls"), list):
                calls += delta["tool_calls"]
        if isinstance(choice.get("finish_reason"), str):
            finish = choice["finish_reason"]
    return Piece("".join(pieces), numbers(chunk.get("usage")), numbers(chunk.get("timings")) if own_timings else None,
                 finish, calls or None)


def _chat_completion(raw: bytes) -> Piece | None:
    """A chat completion's text, usage, timings and finish reason; None when it cannot be read as one."""
    try:
        answer = json.loads(raw)
        choice = answer["choices"][0]
        # A completion's text, or a chat completion's message.
        text = choice["text"] if "text" in choice else choice["message"].get("content") or ""
        if not isinstance(text, str):
            return None
        finish = choice.get("finish_reason")
        calls = choice["message"].get("tool_calls") if "message" in choice else None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError):
        return None
    return Piece(text, numbers(answer.get("usage")), numbers(answer.get("timings")),
                 finish if isinstance(finish, str) else None, calls if isinstance(calls, list) else None)


async def relay_chat(request: web.Request, runtime: ModelRuntime, queued: Any, payload: dict[str, Any],
                     request_id: str, timer: response_metrics.Timer,
                     affinity: str | None, cold: bool, path: str = CHAT_PATH) -> AsyncGenerator[Piece, None]:
    """Send `payload` (a chat completions body, or a completions one to `path` /v1/completions) once
    a slot is free; yield the answer as Pieces."""
    outcomes = request.app[POOL].outcomes
    settings = request.app[SETTINGS]
    async with Slot(runtime, queued):
        timer.mark("admitted")
        timer.mark("sent")
        if timer.enqueued is not None and timer.admitted is not None:
            request[QUEUE_WAIT] = timer.admitted - timer.enqueued
            if cold:
                request.app[METRICS].load_wait.labels(runtime.name).observe(timer.admitted - timer.enqueued)
        timeouts = Timeouts.of(settings.service, runtime.model)
        sent = upstream(outcomes, request.app[HTTP], runtime, path, payload, request_id,
                        timeouts, affinity, scope=request.get(CACHE_SCOPE), adapter=request.get(ADAPTER))
        async with sent as (replica, resp):
            request[REPLICA] = replica
            if sent.slot is not None:
                request[ENGINE_SLOT] = sent.slot
            # A provider's timings are not engine times we measured.
            own_timings = replica.reach.engine_timings
            if not payload.get("stream"):
                raw = await read_answer(outcomes, replica, resp, timeouts, settings.service.max_response_bytes)
                timer.mark("received")
                answer = _chat_completion(raw)
                if answer is None:
                    outcomes.report_outcome(replica, "unreadable chat completion")
                    log.warning("POST %s: %s answered an unreadable chat completion", request.path, label(replica))
                    raise BackendError(f"{label(replica)} answered with an unreadable chat completion")
                if not own_timings:
                    answer.timings = None
                yield answer
                return
            if resp.status != 200 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                await read_answer(outcomes, replica, resp, timeouts, settings.service.max_response_bytes)
                raise BackendError(f"{label(replica)} did not answer with an event stream")
            try:
                async for chunk in sse_data(resp, timeouts, label(replica)):
                    yield _piece_of_chunk(chunk, own_timings)
            except ConnectionResetError:
                raise  # the client left (aiohttp's reset error is a ClientConnectionError too)
            except (PoolError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                resp.close()
                outcomes.report_outcome(replica, exc.message if isinstance(exc, PoolError) else type(exc).__name__)
                raise
            outcomes.report_outcome(replica, None)
            timer.mark("received")


def count_usage(request: web.Request, runtime: ModelRuntime, last: Piece | None) -> None:
    """The answer's usage (its last piece's) into the model's counters and the request's USAGE."""
    metrics = request.app[METRICS]
    usage = last.usage if last is not None else None
    request[USAGE] = metrics.count_usage(runtime.name, metrics.key_label(request.get(FAIRNESS_KEY)), usage,
                                         request.get(REPLICA))
    note_reuse(request, request.get(REPLICA), usage)
