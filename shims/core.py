"""The OpenAI-compatible server every shim shares; an engine only generates text pieces.

It serves `/v1/chat/completions` and `/v1/completions` (JSON or SSE, one event per piece, usage in
the last), `/v1/models`, `/health` and `/metrics`. A client that disconnects cancels its handler,
which closes the engine's generator, so the engine stops working for nobody.

An engine with a `load()` coroutine is loaded after the server listens: `/health` answers 503 until
it can generate, so supervisord sees a running process and the proxy a replica still loading. On
SIGTERM the server stops listening, refuses new requests with 503, lets running ones finish within
the shutdown timeout (the launcher sets it inside supervisord's `stopwaitsecs`) and exits.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from aiohttp import web

log = logging.getLogger("shim")


class EngineFault(Exception):
    """The engine failed this request (a simulated fault, or a real engine's error)."""


class RequestRejected(Exception):
    """The engine cannot take this request as asked: a 4xx with an OpenAI error `code`."""

    def __init__(self, message: str, code: str = "invalid_request", status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


@dataclass
class GenerationRequest:
    prompt: str
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    request_id: str = ""
    fields: tuple[str, ...] = ()      # the request body's top-level field names, as received
    top_k: int | None = None
    repetition_penalty: float | None = None
    beam_size: int = 1
    ignore_eos: bool = False
    prompt_tokens: int | None = None  # set by an engine that tokenized the prompt, for usage


class Engine(Protocol):
    model_name: str

    def count_tokens(self, text: str) -> int: ...

    # One token's text per item, or a list of them (the tokens made since the last item).
    def generate(self, request: GenerationRequest) -> AsyncIterator[str | list[str]]: ...

    def metrics_text(self) -> str: ...


@dataclass
class ServerState:
    """Where the shim is in its life: loading, ready, failed to load, draining for exit."""

    ready: bool = False
    failed: str | None = None
    draining: bool = False


STATE = web.AppKey("shim_state", ServerState)


class StopMatcher:
    """Cuts generated text at the first stop string, holding back what might be the start of one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached)."""
        if not self.stops:
            return piece, False
        text = self.pending + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = ""
            return text[:cut], True
        keep = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:k]):
                    keep = k
                    break
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def prometheus(model_name: str, gauges: dict[str, float], counters: dict[str, float]) -> str:
    """Prometheus text with `vllm:`-named gauges and counters (the names replica routing reads)."""
    label = f'{{model_name="{model_name}"}}'
    lines = []
    for name, value in gauges.items():
        lines += [f"# TYPE {name} gauge", f"{name}{label} {value:g}"]
    for name, value in counters.items():
        lines += [f"# TYPE {name} counter", f"{name}_total{label} {value:g}"]
    return "\n".join(lines) + "\n"


def engine_tallies() -> dict[str, float]:
    """An engine shim's own tallies, all zero: what `engine_counters` exports."""
    return {"prompt_tokens": 0, "generation_tokens": 0, "request_success": 0, "requests_cancelled": 0}


def engine_counters(counters: dict[str, float]) -> dict[str, float]:
    """The counters every engine shim exports for `prometheus`, from its own tallies."""
    return {"vllm:prompt_tokens": counters["prompt_tokens"],
            "vllm:generation_tokens": counters["generation_tokens"],
            "vllm:request_success": counters["request_success"],
            "llm_pool_shim:requests_cancelled": counters["requests_cancelled"]}


def flag(text: str) -> bool:
    """A boolean command-line value, as launchers write them (`true`/`false`)."""
    return text.lower() in ("1", "true", "yes", "on")


def _error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                        else "server_error", "code": code, "param": None}}, status=status,
                             headers=headers)


def _error_event(message: str, code: str) -> bytes:
    err = {"error": {"message": message, "type": "server_error", "code": code, "param": None}}
    return b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n"


def _prompt_from_messages(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise ValueError("`messages` must be a non-empty list")
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"{message.get('role', 'user')}: {content or ''}")
    return "\n".join(parts)


def _number(body: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise ValueError(f"`{key}` must be a number" if kind is not int else f"`{key}` must be an integer")
    return value


def _generation_request(body: dict[str, Any], chat: bool, default_max_tokens: int, request_id: str,
                        engine: Engine) -> GenerationRequest:
    stop = body.get("stop") or []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if chat:
        # An engine that renders chat itself (prompt formats, capabilities) says how; else role-labelled lines.
        render = getattr(engine, "render_chat", None)
        if render is not None:
            prompt, format_stops = render(body.get("messages"), body)
            stops = list(dict.fromkeys([*format_stops, *stops]))
        else:
            prompt = _prompt_from_messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError("`prompt` must be a string")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", default_max_tokens))
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError("`max_tokens` must be a positive integer")
    beam_size = _number(body, "beam_size", int) or 1
    if beam_size < 1:
        raise ValueError("`beam_size` must be at least 1")
    if not all(isinstance(s, str) for s in stops):
        raise ValueError("`stop` must be a string or a list of strings")
    return GenerationRequest(prompt=prompt, max_tokens=max_tokens,
                             temperature=_number(body, "temperature", (int, float)),
                             top_p=_number(body, "top_p", (int, float)), stop=stops, request_id=request_id,
                             fields=tuple(sorted(body)), top_k=_number(body, "top_k", int),
                             repetition_penalty=_number(body, "repetition_penalty", (int, float))
                             if body.get("repetition_penalty") is not None
                             else _number(body, "repeat_penalty", (int, float)),
                             beam_size=beam_size, ignore_eos=bool(body.get("ignore_eos", False)))


class _Generation:
    """One request's run through the engine: text pieces cut at stop strings, tokens counted."""

    def __init__(self, engine: Engine, gen: GenerationRequest) -> None:
        self.engine = engine
        self.gen = gen
        self.tokens = 0
        self.stopped = False
        self.matcher = StopMatcher(gen.stop)

    async def pieces(self) -> AsyncIterator[list[str]]:
        """Lists of text pieces, one piece per token with text, as the engine delivers them."""
        # aclosing: leaving early (a stop string, a client gone) closes the engine's generator at
        # once, which is what stops the engine's work.
        async with contextlib.aclosing(self.engine.generate(self.gen)) as tokens:
            async for item in tokens:
                texts = []
                for piece in (item if isinstance(item, list) else [item]):
                    self.tokens += 1
                    text, hit = self.matcher.feed(piece)
                    if text:
                        texts.append(text)
                    if hit:
                        self.stopped = True
                        break
                if texts:
                    yield texts
                if self.stopped:
                    return
        rest = self.matcher.flush()
        if rest:
            yield [rest]

    @property
    def finish_reason(self) -> str:
        return "length" if not self.stopped and self.tokens >= self.gen.max_tokens else "stop"

    def usage(self) -> dict[str, int]:
        prompt = self.gen.prompt_tokens if self.gen.prompt_tokens is not None else \
            self.engine.count_tokens(self.gen.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens, "total_tokens": prompt + self.tokens}


def create_app(engine: Engine, default_max_tokens: int = 64, exit_on_load_failure: bool = True) -> web.Application:
    state = ServerState(ready=getattr(engine, "load", None) is None)

    async def health(_: web.Request) -> web.Response:
        if state.draining:
            return _error(503, "shutting down", "shutting_down")
        if state.failed:
            return _error(503, f"model failed to load: {state.failed}", "model_load_failed")
        if not state.ready:
            return _error(503, "loading model", "model_loading")
        return web.json_response({"status": "ok"})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                                              "owned_by": "llm-pool-shim", "created": 0}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=engine.metrics_text(), content_type="text/plain")

    async def complete(request: web.Request) -> web.StreamResponse:
        if state.draining or not state.ready:
            return _error(503, "shutting down" if state.draining else "loading model",
                          "shutting_down" if state.draining else "model_loading", headers={"Retry-After": "1"})
        chat = request.path.endswith("/chat/completions")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            gen = _generation_request(body, chat, default_max_tokens, request.headers.get("X-Request-Id", ""), engine)
        except RequestRejected as exc:
            return _error(exc.status, str(exc), exc.code)
        except ValueError as exc:
            return _error(400, str(exc), getattr(exc, "code", "invalid_request"))
        if body.get("model") not in (None, engine.model_name):
            return _error(404, f"this server serves {engine.model_name!r}", "model_not_found")
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        run = _Generation(engine, gen)
        if body.get("stream"):
            return await _stream(request, engine, run, chat, ident, created)
        try:
            text = "".join(["".join(texts) async for texts in run.pieces()])
        except RequestRejected as exc:
            return _error(exc.status, str(exc), exc.code)
        except EngineFault as exc:
            return _error(500, str(exc), "engine_fault")
        except Exception as exc:  # an engine's own error: a 500 in the OpenAI envelope, never a bare trace
            log.exception("generation failed")
            return _error(500, f"engine error: {exc}", "engine_error")
        choice: dict[str, Any] = {"index": 0, "finish_reason": run.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response({"id": ident, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": engine.model_name, "choices": [choice],
                                  "usage": run.usage()})

    async def start_loading(app: web.Application) -> None:
        load = getattr(engine, "load", None)
        if load is not None:
            app[_LOADER] = asyncio.create_task(_load(load, state, exit_on_load_failure))

    async def begin_drain(app: web.Application) -> None:
        state.draining = True
        loader = app.get(_LOADER)
        if loader is not None and not loader.done():
            loader.cancel()

    app = web.Application()
    app[STATE] = state
    app.on_startup.append(start_loading)
    app.on_shutdown.append(begin_drain)
    app.add_routes([web.get("/health", health), web.get("/v1/models", models), web.get("/metrics", metrics),
                    web.post("/v1/chat/completions", complete), web.post("/v1/completions", complete)])
    return app


_LOADER = web.AppKey("shim_loader", asyncio.Task)


async def _load(load: Any, state: ServerState, exit_on_failure: bool) -> None:
    started = time.monotonic()
    try:
        await load()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        # Exit rather than serve 503 forever: supervisord and the proxy see the failure and its log.
        log.exception("loading the model failed")
        state.failed = f"{type(exc).__name__}: {exc}"
        if exit_on_failure:
            signal.raise_signal(signal.SIGTERM)
        return
    state.ready = True
    log.info("model loaded in %.2fs", time.monotonic() - started)


async def _stream(request: web.Request, engine: Engine, run: _Generation, chat: bool, ident: str,
                  created: int) -> web.StreamResponse:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(piece: str | None, finish: str | None, usage: dict[str, int] | None = None) -> bytes:
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": piece} if piece is not None else {},
                                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish}
        chunk: dict[str, Any] = {"id": ident, "object": kind, "created": created, "model": engine.model_name,
                                 "choices": [choice]}
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    pieces = run.pieces()
    # The first piece before the headers: a request the engine refuses still gets its status and body.
    try:
        first = await anext(pieces, None)
    except RequestRejected as exc:
        return _error(exc.status, str(exc), exc.code)
    except EngineFault as exc:
        return _error(500, str(exc), "engine_fault")
    except Exception as exc:
        log.exception("generation failed")
        return _error(500, f"engine error: {exc}", "engine_error")
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    try:
        # Still one SSE event per token, but the tokens of one batch leave in one write.
        if first is not None:
            await out.write(b"".join(event(piece, None) for piece in first))
            async for texts in pieces:
                await out.write(b"".join(event(piece, None) for piece in texts))
    except EngineFault as exc:
        await out.write(_error_event(str(exc), "engine_fault"))
        await out.write_eof()
        return out
    except ConnectionResetError:
        return out  # the client left: nothing to tell it (closing `pieces` stops the engine)
    except Exception as exc:
        log.exception("generation failed after the stream began")
        await out.write(_error_event(f"engine error: {exc}", "engine_error"))
        await out.write_eof()
        return out
    finally:
        await pieces.aclose()  # now, not when the garbage collector gets to it
    await out.write(event(None, run.finish_reason, run.usage()))
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="the model name this server answers to")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="on SIGTERM, seconds running requests get to finish before the exit")
    return parser


def run(app: web.Application, host: str, port: int, shutdown_timeout: float = 10.0) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # handler_cancellation: a disconnected client cancels its handler and so its generation.
    web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None, print=None,
                shutdown_timeout=shutdown_timeout)
    state = app[STATE]
    if state.failed:
        sys.exit(1)
