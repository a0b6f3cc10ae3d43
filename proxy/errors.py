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


class UnsupportedMediaType(PoolError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


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


# Every `code` the proxy itself answers with, and when: the published contract (GET /openapi.json
# lists them) and the set tests/proxy/test_error_codes.py holds the source to, so a new code cannot
# ship undocumented. A backend's own code passes on as it sent it (proxy/edge/relay.py).
CODES: dict[str, str] = {
    "invalid_request": "a field breaks the request schema of /v1/responses, or a field of the Ollama API's is wrong",
    "unsupported_field": "an Ollama API field no engine behind the pool honours (template, suffix, context; "
                         "system or images with raw)",
    "not_implemented": "an Ollama API route that manages models (pull, push, create, copy, delete): the admin "
                       "API's and conf/'s (501)",
    "invalid_request_error": "a backend refused the request as malformed (its message and status pass on)",
    "context_length_exceeded": "the prompt does not fit the model's context (a backend's refusal)",
    "invalid_json": "the body is not a UTF-8 JSON object (no BOM, NaN or Infinity), is nested too deep, or holds "
                    "too many values",
    "missing_model": "`model` is missing or not a non-empty string",
    "missing_required_parameter": "the pass-through endpoint's required field is missing",
    "invalid_type": "the pass-through endpoint's required field has the wrong JSON type",
    "invalid_token_id": "a token id that is no token of the model (negative, past int32, or past its vocabulary)",
    "invalid_fairness_key": "`fairness_key` is not a string",
    "invalid_input": "not exactly one of `input` and `messages`, or the prompt format needs `input`",
    "invalid_messages": "a role other than user/assistant, or the last message is not the user's",
    "invalid_file": "a file item the remote provider cannot take",
    "image_url_not_allowed": "an image URL that the model's image_url_* rules refuse",
    "modality_unsupported": "an image or file item for a model that does not take them",
    "multi_turn_unsupported": "`messages` for a single-turn model",
    "thinking_unsupported": "a `thinking` mode the model does not offer",
    "target_lang_required": "the translation prompt format needs `target_lang_code`",
    "instructions_not_allowed": "the translation prompt format carries its own instructions",
    "embeddings_unsupported": "/v1/embeddings for a model that serves none",
    "endpoint_unsupported": "a route the model's replicas do not speak (the message names those they do)",
    "invalid_load_request": "a load body with unknown fields, a bad override or replica count",
    "invalid_scale_request": "a scale body that is not {\"replicas\": N} within 1..replica_max",
    "invalid_log_request": "a log query parameter out of range",
    "invalid_events_request": "an events query parameter out of range, or an unknown event kind",
    "invalid_unload_request": "an unload body that is not empty or {}",
    "invalid_adapter_request": "an adapter load or unload with a body that is not empty or {}",
    "unsupported_media_type": "an admin POST without `Content-Type: application/json` (415)",
    "origin_not_allowed": "an admin request whose Origin is another site's (403)",
    "host_not_allowed": "an admin request to an unauthenticated admin API under a host name it does not know (403)",
    "method_not_allowed": "the route exists but not with this method (405)",
    "invalid_admin_token": "admin routes need `Authorization: Bearer <token>` (service.admin_token_env)",
    "forbidden": "not allowed",
    "remote_not_allowed": "a remote model needs `allow_remote: true` in the request, and a tenant allowed remote "
                          "models (403)",
    "invalid_api_key": "with tenants configured, a request without a key the pool knows (401)",
    "model_not_allowed": "a model outside the tenant's `models` globs (403)",
    "rate_limited": "the tenant's requests_per_minute or tokens_per_minute is used up (429, Retry-After)",
    "budget_exceeded": "the tenant's token or cost budget for its period is spent (429, Retry-After: the "
                       "period's end)",
    "tenants_not_configured": "a tenants admin route on a pool without `tenants` (409)",
    "tenant_not_found": "no tenant of that name is configured (404)",
    "key_not_found": "the tenant has no live minted key of that id (404)",
    "invalid_usage_request": "a usage query parameter that is not a time, a group_by field or a format",
    "invalid_key_request": "a key mint with a body other than empty or {}",
    "remote_auth_failed": "the remote provider refused the configured credentials (502)",
    "model_not_found": "no model of that name is configured",
    "not_found": "no such route (on this listener)",
    "conflict": "the pool's state forbids it now",
    "model_not_loaded": "the model is configured but not loaded, and does not load on demand",
    "model_already_loaded": "a load asked for a model that is loaded with other settings",
    "model_not_loadable": "a setting stops the model from starting (a missing file, a refused value); "
                          "`llm-pool check-config` names it, and no wait helps (no Retry-After)",
    "no_process_log": "a remote replica has no process log",
    "adapter_not_found": "the model has no LoRA adapter of that name (lora_adapters)",
    "adapter_not_unloadable": "the model's engine holds its LoRA adapters until it stops (llama-server)",
    "backend_not_supported": "the backend has no launcher in this version",
    "request_too_large": "the body is over service.max_body_bytes",
    "queue_full": "the model's queue is full",
    "fairness_key_queue_full": "this fairness key has max_pending_per_key requests waiting",
    "executor_queue_full": "the model has max_pending_per_executor requests waiting",
    "invalid_priority_class": "X-Priority-Class names no class of engine.fairness.classes",
    "priority_not_allowed": "X-Priority-Class names a class above the request's own (a request may lower it only)",
    "invalid_file_upload": "POST /v1/files is not a multipart form with the fields purpose and file",
    "invalid_purpose": "a file's purpose is not batch (the pool keeps files for the Batch API only)",
    "invalid_batch_file": "a batch file's line is wrong (the message names it), or its lines do not fit the batch",
    "file_too_large": "the file is over engine.batches.max_file_bytes",
    "file_storage_full": "the kept files would pass engine.batches.max_storage_bytes: delete some",
    "file_not_found": "no such file (or another tenant's)",
    "invalid_batch_request": "a field of the batch request is wrong (`param` names it)",
    "batch_not_found": "no such batch (or another tenant's)",
    "batch_not_cancellable": "the batch has ended: only one in progress can be cancelled",
    "queue_timeout": "the request waited max_queue_wait_s without a slot",
    "remote_rate_limited": "the remote provider rate-limits the configured account",
    "internal_error": "a bug in llm-pool (the trace is in the proxy log)",
    "http_error": "an HTTP error aiohttp raised itself",
    "backend_error": "the model server failed, or answered something that is not an OpenAI answer",
    "backend_response_too_large": "the backend's answer is over service.max_response_bytes",
    "backend_timeout": "the model server did not answer, or went silent, within the model's timeouts",
    "remote_timeout": "the remote provider did not answer in time",
    "model_unavailable": "the model has no healthy replica right now",
    "model_loading": "the model is loading",
    "model_unloading": "the model is being unloaded",
    "model_load_failed": "the model's load failed (an on-demand load's back-off says when it is tried again)",
    "model_too_large": "the model can never fit the memory budgets, even with all else unloaded (409)",
    "insufficient_memory": "no room now: loaded models are busy or pinned",
    "model_scale_failed": "a scale could not start its replicas",
    "scale_failed": "a scale could not be carried out",
    "unload_failed": "an unload could not stop the model's replicas",
    "no_free_port": "no free port in supervisor.port_range",
    "supervisor_unavailable": "supervisord does not answer",
    "shutting_down": "the proxy is stopping and takes no new work",
    "reloading": "GET /metrics reached a reload's new process before it took over (it shows the counters then)",
}


def sse_error_event(err: PoolError) -> bytes:
    """The error as an SSE event, for failures after a stream has started (headers already sent)."""
    return b"event: error\ndata: " + json.dumps(err.body()).encode() + b"\n\n"
