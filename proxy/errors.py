"""One error hierarchy for the proxy, as values: each knows its OpenAI envelope and headers.

It is rendered to HTTP in one place, proxy/serving/errors_http.py; this module stays free of aiohttp so
that the pure decisions (admission, fairness) can raise these.
"""
from __future__ import annotations

import json
import math
from typing import Any

# Every 429 and 503 tells the client when to come back, even where nothing better is known.
DEFAULT_RETRY_AFTER_S = 2.0


class PoolError(Exception):
    """An error the proxy answers with: an HTTP status, an OpenAI `type` and a stable `code`."""

    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after: float | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.param = param
        self.retry_after = retry_after
        # The `code` label of the request metrics. Ours are a fixed set; one a backend chose is kept
        # only when well known (see relay.backend_error), so the label's values stay bounded.
        self.metric_code = self.code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def headers(self) -> dict[str, str]:
        retry_after = self.retry_after
        if retry_after is None and self.status in (429, 503):
            retry_after = DEFAULT_RETRY_AFTER_S
        if retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(retry_after)))}


class BadRequest(PoolError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class RefusedByBackend(PoolError):
    """A backend refused the request as malformed (its 400, 413 or 422): the client's mistake, passed
    on with the backend's message and status, and counted as a client error, not a backend one."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request_error"


class Unauthorized(PoolError):
    status = 401
    type = "authentication_error"
    code = "invalid_admin_token"


class Forbidden(PoolError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(PoolError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class Conflict(PoolError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class TooLarge(PoolError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class TooManyRequests(PoolError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class Unavailable(PoolError):
    status = 503
    type = "server_error"
    code = "model_unavailable"


class BackendError(PoolError):
    """The model server failed or could not be reached."""

    status = 502
    type = "server_error"
    code = "backend_error"


class BackendTimeout(PoolError):
    """The model server did not answer, or went silent, within the model's timeouts."""

    status = 504
    type = "server_error"
    code = "backend_timeout"


def sse_error_event(err: PoolError) -> bytes:
    """The error as an SSE event, for failures after a stream has started (headers already sent)."""
    return b"event: error\ndata: " + json.dumps(err.body()).encode() + b"\n\n"
