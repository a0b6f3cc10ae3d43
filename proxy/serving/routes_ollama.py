"""The Ollama API on the pool's own port (docs/api.md: The Ollama API), for the tools that speak only
it: the `ollama` clients, editor plugins, Open WebUI's Ollama connection.

/api/chat and /api/generate become the pool's chat completions (or, `raw`, completions) and go
through all it does: admission, tenants and their ledger, fairness, affinity, load on demand,
fallbacks, timeouts, metrics (under the /api/ path). Their answers come back as Ollama writes them
(proxy/edge/ollama.py). /api/embed and /api/embeddings are /v1/embeddings. What manages models
(pull, push, create, copy, delete) is the admin's: a 501 that says where.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from typing import Any, AsyncGenerator

import aiohttp
from aiohttp import web

from proxy.errors import BackendError, BadRequest, PoolError
from proxy.edge import ollama, response_metrics
from proxy.gpu.vram_estimate import configured_context
from proxy.lifecycle.state.replicas import ModelState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.serving.affinity_key import affinity_key
from proxy.serving.body import fairness_key, model_of, priority_class, read_body, servable
from proxy.serving.chat_relay import CHAT_PATH, Piece, count_usage, relay_chat
from proxy.serving.fallbacks import with_fallbacks
from proxy.serving.forward import Slot, read_answer, upstream
from proxy.serving.image_urls import check_image_urls
from proxy.serving.keys import (ADAPTER, CACHE_SCOPE, HTTP, POOL, REPLICA, REPLICA_HEADER, SETTINGS,
                                STARTED, STREAM_ERROR)
from proxy.serving.responses import IGNORED_HEADER, ignored_header
from proxy.serving.routes_public import visible
from proxy.serving.stream_usage import mark_ended, settle
from proxy.serving.tenancy import TENANCY
from proxy.edge.relay import Timeouts

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
# When a model that never idles out expires, as Ollama says "never" (keep_alive: -1).
NEVER = "2318-01-01T00:00:00Z"
MANAGED_ELSEWHERE = ("POST /v1/admin/models/{name}/load (and /unload) loads and unloads the models conf/ "
                     "configures; adding a model is an admin's edit of conf/ and a reload")


@routes.get("/api/version")
async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": ollama.VERSION})


@routes.get("/api/tags")
async def tags(request: web.Request) -> web.Response:
    """The models a request may use now, as GET /v1/models lists them (aliases too)."""
    return web.json_response({"models": [_entry(name, runtime) for name, runtime, _ in visible(request)]})


@routes.get("/api/ps")
async def running(request: web.Request) -> web.Response:
    """The loaded ones, with when the pool's lifecycle would unload each (idle_unload_s)."""
    out = []
    for name, runtime, _ in visible(request):
        if runtime.state != ModelState.LOADED:
            continue
        idle = runtime.config.idle_unload_s
        expires = NEVER if idle is None or runtime.config.pinned else _iso(runtime.last_used + idle)
        context = _context(runtime)
        entry = _entry(name, runtime)
        del entry["modified_at"]   # not among /api/ps' fields
        out.append({**entry, "expires_at": expires, "size_vram": 0, "context_length": context[0] if context else 0})
    return web.json_response({"models": out})


@routes.post("/api/show")
async def show(request: web.Request) -> web.Response:
    body, _ = await read_body(request)
    if "model" not in body and isinstance(body.get("name"), str):
        body = {**body, "model": body["name"]}   # the older clients' field
    ollama.check(request.path, body)
    runtime = _model(request, ollama.model_name(body))
    caps = runtime.capabilities()
    entry = _entry(runtime.name, runtime)
    family = entry["details"]["family"]
    info: dict[str, Any] = {"general.architecture": family}
    context = _context(runtime)
    if context:
        info[f"{family}.context_length"] = context[0]
    served = [("completion", CHAT_PATH in caps.endpoints), ("tools", caps.multi_turn),
              ("vision", "image" in caps.modalities), ("embedding", caps.embeddings),
              ("thinking", "enabled" in caps.thinking_modes)]
    return web.json_response({
        "modelfile": f"# served by llm-pool ({runtime.model.backend}); its settings are the admin's, in conf/\n",
        "parameters": "", "template": "", "details": entry["details"], "model_info": info,
        "capabilities": [name for name, yes in served if yes], "modified_at": entry["modified_at"]})


def _model(request: web.Request, name: str) -> ModelRuntime:
    """The model a request names (an alias's), if the caller may use it: 401, 403, 404 otherwise."""
    runtime, _, public = model_of(request, request.app[POOL], name)
    tenancy = request.app.get(TENANCY)
    if tenancy is not None:
        tenancy.allow(tenancy.caller(request), runtime, public)
    return runtime


def _entry(name: str, runtime: ModelRuntime) -> dict[str, Any]:
    """A model as Ollama lists one. Its size and time are its file's (nothing of its path shows); a
    remote model's are 0 and the epoch."""
    path = runtime.model.get(runtime.traits.model_field)
    size, modified = 0, 0.0
    if isinstance(path, str) and not runtime.traits.remote:
        with contextlib.suppress(OSError):
            stat = os.stat(path)
            size, modified = (stat.st_size if os.path.isfile(path) else 0), stat.st_mtime
    fmt = "gguf" if isinstance(path, str) and path.endswith(".gguf") else \
        "remote" if runtime.traits.remote else "safetensors"
    digest = hashlib.sha256(f"{runtime.name}\0{path}\0{size}\0{modified}".encode()).hexdigest()
    return {"name": name, "model": name, "modified_at": _iso(modified), "size": size, "digest": digest,
            "details": {"parent_model": "", "format": fmt, "family": runtime.model.backend,
                        "families": [runtime.model.backend], "parameter_size": "", "quantization_level": ""}}


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _context(runtime: ModelRuntime) -> tuple[int, str] | None:
    """One request's context where the settings give it (llama_server_n_ctx, vllm_max_model_len, ...)."""
    field, tokens = configured_context(runtime.model)
    return (tokens, field) if tokens else None


@routes.post("/api/chat")
@with_fallbacks
async def chat(request: web.Request) -> web.StreamResponse:
    body, _ = await read_body(request)
    ollama.check(request.path, body)   # before servable: a malformed request loads nothing on demand
    name = ollama.model_name(body)
    runtime = servable(request, request.app[POOL], name, body, endpoint=CHAT_PATH)
    caps = runtime.capabilities()
    messages = ollama.chat_messages(body.get("messages") or [], caps, runtime.name)
    payload: dict[str, Any] = {"messages": messages}
    if body.get("tools"):
        payload["tools"] = ollama.check_tools(body["tools"])
    return await _generate(request, runtime, body, payload, ollama.ignored(body, ollama.CHAT_FIELDS), CHAT_PATH,
                           load_only=not messages)


@routes.post("/api/generate")
@with_fallbacks
async def generate(request: web.Request) -> web.StreamResponse:
    body, _ = await read_body(request)
    ollama.check(request.path, body)
    name = ollama.model_name(body)
    raw = body.get("raw") is True
    runtime = servable(request, request.app[POOL], name, body, endpoint=COMPLETIONS_PATH if raw else CHAT_PATH)
    caps = runtime.capabilities()
    ollama.check_generate(body, COMPLETIONS_PATH in caps.endpoints)
    payload: dict[str, Any] = {"prompt": body.get("prompt") or ""} if raw else \
        {"messages": ollama.generate_messages(body, caps, runtime.name)}
    return await _generate(request, runtime, body, payload, ollama.ignored(body, ollama.GENERATE_FIELDS),
                           COMPLETIONS_PATH if raw else CHAT_PATH, load_only=not body.get("prompt"))


async def _generate(request: web.Request, runtime: ModelRuntime, body: dict[str, Any], payload: dict[str, Any],
                    skipped: list[str], path: str, load_only: bool) -> web.StreamResponse:
    """Send the translated request and answer as Ollama does; `load_only`: no prompt, Ollama's way
    to load a model (it waits for the model and a slot, sends nothing, and says `load`)."""
    is_chat = request.path == "/api/chat"
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise BadRequest("stream: must be true or false", code="invalid_request", param="stream")
    ollama.keep_alive_s(body.get("keep_alive"))
    if "keep_alive" in body:
        skipped.append("keep_alive")   # the pool's lifecycle decides (docs/api.md)
    sampling, ignored_options = ollama.sampling(body.get("options"), runtime.traits, _context(runtime))
    payload.update(sampling)
    fmt = ollama.response_format(body.get("format"))
    if fmt is not None:
        payload["response_format"] = fmt
    if stream:
        payload["stream"], payload["stream_options"] = True, {"include_usage": True}
    headers = {"X-Request-Id": request.headers.get("X-Request-Id") or f"req_{os.urandom(16).hex()}"}
    if skipped or ignored_options:
        headers[IGNORED_HEADER] = ignored_header([*skipped, *ignored_options])
    key = fairness_key(request, body)
    timer = response_metrics.Timer()
    cold = runtime.state != ModelState.LOADED
    queued = runtime.admission.enqueue(key, priority_class(request, runtime.policy))   # a full queue: a plain 429
    timer.mark("enqueued")
    name = runtime.name
    if load_only:
        async with Slot(runtime, queued):
            timer.mark("admitted")
        head: dict[str, Any] = {"model": name, "created_at": ollama.created_at()}
        head.update({"message": {"role": "assistant", "content": ""}} if is_chat else {"response": ""})
        return web.json_response({**head, "done": True, "done_reason": "load"}, headers=headers)
    await check_image_urls(payload, runtime.model)
    affinity = affinity_key(runtime, path, request.headers, payload)
    relay = relay_chat(request, runtime, queued, payload, headers["X-Request-Id"], timer, affinity, cold, path)
    if stream:
        return await _as_lines(request, relay, runtime, ollama.Stream(name, is_chat), headers, payload, timer, cold)
    async with contextlib.aclosing(relay):
        pieces = [piece async for piece in relay]
    first = timer.first_token or time.perf_counter()
    last = pieces[-1]
    count_usage(request, runtime, last)
    text = "".join(p.text for p in pieces)
    head = {"model": name, "created_at": ollama.created_at()}
    if is_chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [call for p in pieces for call in p.tool_calls or ()]
        if calls:
            message["tool_calls"] = ollama.tool_calls_out(calls)
        head["message"] = message
    else:
        head["response"] = text
    done = ollama.done_fields(last.finish_reason, last.usage, last.timings, _spans(request, timer, cold, first))
    return web.json_response({**head, **done}, headers={**headers, REPLICA_HEADER: str(request[REPLICA].index)})


def _spans(request: web.Request, timer: response_metrics.Timer, cold: bool, first: float) -> tuple[int, int, int, int]:
    """(total, waiting for a load, sent to the first piece, the rest) in nanoseconds."""
    now = time.perf_counter()
    load = (timer.admitted or now) - (timer.enqueued or now) if cold else 0.0
    sent = timer.sent or first
    return (int((now - request.get(STARTED, timer.handler)) * 1e9), int(load * 1e9), int(max(0.0, first - sent) * 1e9),
            int(max(0.0, now - first) * 1e9))


async def _as_lines(request: web.Request, relay: AsyncGenerator[Piece, None], runtime: ModelRuntime,
                    stream: ollama.Stream, headers: dict[str, str], payload: dict[str, Any],
                    timer: response_metrics.Timer, cold: bool) -> web.StreamResponse:
    """The answer as NDJSON. The status goes out with the first piece, not before: an error until
    then (the queue, the engine's refusal of a long prompt) is an HTTP error a fallback may answer."""
    last: Piece | None = None
    texts = 0   # the pieces that went out: what an answer cut short is charged for
    out = web.StreamResponse(headers={"Content-Type": ollama.NDJSON, "Cache-Control": "no-cache", **headers})
    try:
        async with contextlib.aclosing(relay):
            async for piece in relay:
                if not out.prepared:
                    timer.mark("first_token")
                    out.headers[REPLICA_HEADER] = str(request[REPLICA].index)
                    await out.prepare(request)
                finish = piece.finish_reason or (last.finish_reason if last is not None else None)
                last = Piece(piece.text, piece.usage or (last.usage if last is not None else None),
                             piece.timings or (last.timings if last is not None else None), finish)
                if piece.tool_calls:
                    stream.call_pieces(piece.tool_calls)
                line = stream.text(piece.text)
                if line:
                    await out.write(line)
                    texts += 1
    except ConnectionResetError:
        return out   # the client left; its slot and the upstream request are already released
    except (PoolError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
        if not out.prepared and isinstance(exc, PoolError):
            raise   # nothing went out: the route's error (a fallback's to answer)
        err = exc if isinstance(exc, PoolError) else \
            BackendError(f"the backend broke off the stream: {type(exc).__name__}")
        log.warning("POST %s stream ended with an error: %s", request.path, err.message)
        request[STREAM_ERROR] = err.metric_code
        return await _end_with(request, out, err)
    finally:
        # However it ended (a cancelled handler too), before the metrics middleware records it.
        if last is not None:
            settle(request, runtime.name, payload, last.usage, texts, request.get(REPLICA))
    if not out.prepared:
        await out.prepare(request)   # an engine's empty stream: the done line alone
    done = ollama.done_fields(last.finish_reason if last else None, last.usage if last else None,
                              last.timings if last else None,
                              _spans(request, timer, cold, timer.first_token or time.perf_counter()))
    with contextlib.suppress(ConnectionResetError):
        await out.write(stream.end(done))
        mark_ended(request, out)
        await out.write_eof()
    return out


async def _end_with(request: web.Request, out: web.StreamResponse, err: PoolError) -> web.StreamResponse:
    with contextlib.suppress(ConnectionResetError):
        if not out.prepared:
            await out.prepare(request)
        await out.write(ollama.error_line(err))
        await out.write_eof()
    return out


@routes.post("/api/embed")
async def embed(request: web.Request) -> web.Response:
    body, _ = await read_body(request)
    ollama.check(request.path, body)
    texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
    answer, took = await _embeddings(request, body, texts)
    return web.json_response({"model": answer["model"], "embeddings": answer["vectors"],
                              "total_duration": took, "load_duration": 0,
                              "prompt_eval_count": answer["prompt_tokens"]})


@routes.post("/api/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    """The older route: one `prompt`, one `embedding`."""
    body, _ = await read_body(request)
    ollama.check(request.path, body)
    answer, _took = await _embeddings(request, body, [body["prompt"]])
    return web.json_response({"embedding": answer["vectors"][0]})


async def _embeddings(request: web.Request, body: dict[str, Any], texts: list[str]) -> tuple[dict[str, Any], int]:
    """The texts' vectors from a replica's /v1/embeddings, in order, with the prompt tokens it counted."""
    name = ollama.model_name(body)
    runtime = servable(request, request.app[POOL], name, body, endpoint=EMBEDDINGS_PATH)
    ollama.keep_alive_s(body.get("keep_alive"))
    payload: dict[str, Any] = {"input": texts}
    if body.get("dimensions") is not None:
        payload["dimensions"] = body["dimensions"]
    started = time.perf_counter()
    queued = runtime.admission.enqueue(fairness_key(request, body), priority_class(request, runtime.policy))
    outcomes, settings = request.app[POOL].outcomes, request.app[SETTINGS]
    request_id = request.headers.get("X-Request-Id") or f"req_{os.urandom(16).hex()}"
    timeouts = Timeouts.of(settings.service, runtime.model)
    async with Slot(runtime, queued):
        async with upstream(outcomes, request.app[HTTP], runtime, EMBEDDINGS_PATH, payload, request_id, timeouts,
                            None, scope=request.get(CACHE_SCOPE), adapter=request.get(ADAPTER)) as (replica, resp):
            request[REPLICA] = replica
            raw = await read_answer(outcomes, replica, resp, timeouts, settings.service.max_response_bytes)
    vectors, usage = _vectors(raw, len(texts))
    if vectors is None:
        raise BackendError(f"model {runtime.name!r} answered with unreadable embeddings")
    last = Piece("", usage)
    count_usage(request, runtime, last)
    return ({"model": runtime.name, "vectors": vectors, "prompt_tokens": (usage or {}).get("prompt_tokens", 0)},
            int((time.perf_counter() - started) * 1e9))


def _vectors(raw: bytes, count: int) -> tuple[list[list[float]] | None, dict[str, Any] | None]:
    """An embeddings answer's vectors in input order (untrusted: anything else is None)."""
    try:
        answer = json.loads(raw)
        data = sorted(answer["data"], key=lambda d: d.get("index", 0))
        vectors = [[float(x) for x in d["embedding"]] for d in data]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None, None
    if len(vectors) != count:
        return None, None
    usage = answer.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return vectors, {"prompt_tokens": prompt} if isinstance(prompt, int) and not isinstance(prompt, bool) else None


async def _managed_elsewhere(request: web.Request) -> web.Response:
    raise PoolError(f"{request.method} {request.path} is not part of llm-pool's Ollama API: the pool serves the "
                    f"models its admin configured. {MANAGED_ELSEWHERE}", code="not_implemented", status=501)


for _path in ("/api/pull", "/api/push", "/api/create", "/api/copy"):
    routes.post(_path)(_managed_elsewhere)
routes.delete("/api/delete")(_managed_elsewhere)
