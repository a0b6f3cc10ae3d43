"""A model's fallbacks (docs/routing.md: Aliases and fallbacks): a generation request that its
model cannot serve goes to the next model its settings name, before any byte of an answer went out,
and the answer says which model served it (X-LLM-Pool-Model, and the body's `model`).

A route's error before its answer began is an exception that leaves the handler (after that, a
stream ends with an error event instead); `with_fallbacks` catches it, reads which of the reasons
it is, and runs the route again with the fallback's name in the body. The request is the same
request throughout: one ledger row, one tenant admission (re-priced for the model that serves).
"""
from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.errors import Forbidden, PoolError
from proxy.serving.body import read_body
from proxy.serving.keys import ADAPTER, ANSWERED, FALLBACK_BODY, METRICS, MODEL, POOL, SETTINGS

log = logging.getLogger(__name__)

MODEL_HEADER = "X-LLM-Pool-Model"
# The codes of each reason a model's `fallbacks` may name; any other error is the request's own.
REASONS = {
    "overloaded": frozenset(("queue_full", "fairness_key_queue_full", "executor_queue_full", "queue_timeout")),
    "unavailable": frozenset(("model_unavailable", "model_loading", "model_unloading", "model_not_loaded",
                              "model_load_failed", "model_not_loadable", "model_too_large", "insufficient_memory",
                              "supervisor_unavailable", "backend_error", "backend_timeout")),
    "context_length_exceeded": frozenset(("context_length_exceeded",)),
}


def reason_of(err: PoolError) -> str | None:
    return next((reason for reason, codes in REASONS.items() if err.code in codes), None)


def with_fallbacks(handler: Handler) -> Handler:
    """`handler`, a generation route, run again for each fallback its model names for the error it
    raised. Without fallbacks (the common case) it costs a try."""
    async def route(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except PoolError as err:
            return await _fall_back(request, handler, err)
    return route


async def _fall_back(request: web.Request, handler: Handler, err: PoolError) -> web.StreamResponse:
    first = request.get(MODEL)   # set once the request's model is known (body.servable)
    runtime = request.app[POOL].models.get(first) if first is not None else None
    if first is None or runtime is None or not runtime.config.fallbacks or request.get(ANSWERED):
        raise err
    aliases = request.app[SETTINGS].aliases
    body: dict[str, Any] = (await read_body(request))[0]
    last = err
    for fallback in runtime.config.fallbacks:
        reason = reason_of(last)
        if reason is None:
            break
        if reason not in fallback.on:
            continue
        target = aliases.get(fallback.model, fallback.model)
        log.info("%s %s: model %r %s (%s); its fallback %r answers", request.method, request.path,
                 request.get(MODEL), reason, last.code, target)
        request.app[METRICS].child(request.app[METRICS].fallbacks, first, target, reason).inc()
        # No raw bytes: the replica gets the body encoded again, with its model's name.
        request[FALLBACK_BODY] = ({**body, "model": target}, None)
        try:
            return await handler(request)
        except PoolError as exc:
            if request.get(ANSWERED):
                raise
            if isinstance(exc, Forbidden):
                continue   # not this request's to use (its tenant's models, a remote model's gate): the next
            last = exc
    raise last


async def model_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the model that served the request (an alias's target, a fallback, a
    LoRA adapter's id)."""
    request[ANSWERED] = True
    adapter = request.get(ADAPTER)
    name = adapter.id if adapter is not None else request.get(MODEL)
    if name is not None and MODEL_HEADER not in response.headers:
        response.headers[MODEL_HEADER] = name
