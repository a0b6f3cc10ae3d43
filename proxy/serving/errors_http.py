"""The error hierarchy (proxy/errors.py) rendered as HTTP: the OpenAI envelope with a truthful status,
for our own errors, aiohttp's, and anything unexpected (500, never 400); Anthropic's on its
Messages routes, where its SDK reads them (proxy/edge/anthropic.py)."""
from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.errors import BadRequest, NotFound, PoolError, TooLarge
from proxy.edge import anthropic, ollama
from proxy.edge.anthropic import route as anthropic_route
from proxy.serving.keys import REPLICA, REPLICA_HEADER

log = logging.getLogger(__name__)


def error_response(err: PoolError, path: str = "") -> web.Response:
    body = anthropic.error_body(err) if anthropic_route(path) else \
        ollama.error_body(err) if ollama.route(path) else err.body()
    return web.json_response(body, status=err.status, headers=err.headers())


def from_http_exception(exc: web.HTTPException) -> PoolError:
    """aiohttp raises these itself (body too large, unknown route, wrong method)."""
    codes = {404: ("not_found", NotFound), 405: ("method_not_allowed", BadRequest),
             413: ("request_too_large", TooLarge)}
    code, cls = codes.get(exc.status, ("http_error", PoolError))
    return cls(exc.reason if exc.status != 413 else exc.text or exc.reason, code=code, status=exc.status)


# The metrics' error code of a request answered by `error_middleware`.
ERROR_CODE = web.RequestKey("error_code", str)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except PoolError as err:
        request[ERROR_CODE] = err.metric_code
        response = error_response(err, request.path)
        if REPLICA in request:   # a replica took it (its answer was an error): say which
            response.headers[REPLICA_HEADER] = str(request[REPLICA].index)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(from_http_exception(exc), request.path)
    except Exception:
        # Unknown failures are the proxy's fault, never the client's: 500, with the trace in the log.
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(PoolError("internal error in llm-pool; see the proxy log"), request.path)
