"""The OpenAI-compatible server every shim shares; an engine only generates text pieces.

It serves `/v1/chat/completions` and `/v1/completions` (JSON or SSE, one event per piece, usage in
the last), `/v1/models`, `/health` and `/metrics`. A client that disconnects cancels its handler,
which closes the engine's generator, so the engine stops working for nobody.
"""
from __future__ import annotations

import argparse
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from aiohttp import web


class EngineFault(Exception):
    """The engine failed this request (a simulated fault, or a real engine's error)."""


@dataclass
class GenerationRequest:
    prompt: str
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    request_id: str = ""
    fields: tuple[str, ...] = ()      # the request body's top-level field names, as received


class Engine(Protocol):
    model_name: str

    def count_tokens(self, text: str) -> int: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[str]: ...

    def metrics_text(self) -> str: ...


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                        else "server_error", "code": code, "param": None}}, status=status)


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


def _generation_request(body: dict[str, Any], chat: bool, default_max_tokens: int,
                        request_id: str) -> GenerationRequest:
    prompt = _prompt_from_messages(body.get("messages")) if chat else body.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError("`prompt` must be a string")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", default_max_tokens))
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError("`max_tokens` must be a positive integer")
    stop = body.get("stop") or []
    return GenerationRequest(prompt=prompt, max_tokens=max_tokens, temperature=body.get("temperature"),
                             top_p=body.get("top_p"), stop=[stop] if isinstance(stop, str) else list(stop),
                             request_id=request_id, fields=tuple(sorted(body)))


def create_app(engine: Engine, default_max_tokens: int = 64) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                                              "owned_by": "llm-pool-shim", "created": 0}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=engine.metrics_text(), content_type="text/plain")

    async def complete(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            gen = _generation_request(body, chat, default_max_tokens, request.headers.get("X-Request-Id", ""))
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request")
        if body.get("model") not in (None, engine.model_name):
            return _error(404, f"this server serves {engine.model_name!r}", "model_not_found")
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        prompt_tokens = engine.count_tokens(gen.prompt)
        if body.get("stream"):
            return await _stream(request, engine, gen, chat, ident, created, prompt_tokens)
        pieces: list[str] = []
        try:
            async for piece in engine.generate(gen):
                pieces.append(piece)
        except EngineFault as exc:
            return _error(500, str(exc), "engine_fault")
        text = "".join(pieces)
        finish = "length" if len(pieces) >= gen.max_tokens else "stop"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces),
                 "total_tokens": prompt_tokens + len(pieces)}
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response({"id": ident, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": engine.model_name, "choices": [choice], "usage": usage})

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/v1/models", models), web.get("/metrics", metrics),
                    web.post("/v1/chat/completions", complete), web.post("/v1/completions", complete)])
    return app


async def _stream(request: web.Request, engine: Engine, gen: GenerationRequest, chat: bool, ident: str,
                  created: int, prompt_tokens: int) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
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

    count = 0
    try:
        async for piece in engine.generate(gen):
            count += 1
            await out.write(event(piece, None))
    except EngineFault as exc:
        err = {"error": {"message": str(exc), "type": "server_error", "code": "engine_fault", "param": None}}
        await out.write(b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n")
        await out.write_eof()
        return out
    finish = "length" if count >= gen.max_tokens else "stop"
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": count, "total_tokens": prompt_tokens + count}
    await out.write(event(None, finish, usage))
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="the model name this server answers to")
    return parser


def run(app: web.Application, host: str, port: int) -> None:
    # handler_cancellation: a disconnected client cancels its handler and so its generation.
    web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None, print=None)
