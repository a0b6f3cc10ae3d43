"""The Ollama API (docs/api.md: The Ollama API) as the pool's own requests and answers: an
/api/chat or /api/generate body checked and turned into a chat completions (or, `raw`, a
completions) body, `options` into the engine's sampling fields, and the answer written back as
Ollama writes it: one JSON object, or NDJSON lines ending with `done: true` and the counts and
durations in nanoseconds. Pure functions and one stream writer; proxy/serving/routes_ollama.py
sends the requests. Every field is untrusted: a wrong one is a 400 naming it, in Ollama's error
shape (`{"error": "..."}`).
"""
from __future__ import annotations

import base64
import binascii
import json
import re
import time
from typing import Any, Mapping

import jsonschema

from proxy.capabilities import Capabilities, Traits
from proxy.errors import BadRequest, PoolError
from proxy.edge.anthropic_tools import an_object, arguments_object

PREFIX = "/api/"
# The Ollama release whose API this follows: clients read it to decide what they may send.
VERSION = "0.13.0"
NDJSON = "application/x-ndjson"
LATEST = ":latest"
# Sampling options and the chat completions field each becomes (`repeat_penalty`: the engine's own
# repetition field; `num_predict`: max_tokens, where a negative one is no limit).
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "num_predict": "max_tokens",
            "seed": "seed", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "repeat_penalty": "repeat_penalty"}
NONNEGATIVE_OPTIONS = {"temperature", "top_p", "repeat_penalty"}
NUMBER_OPTIONS = NONNEGATIVE_OPTIONS | {"presence_penalty", "frequency_penalty"}
INTEGER_OPTIONS = {"top_k", "num_predict", "seed", "num_ctx"}
# The fields of each route a request may carry and the pool reads; any other is ignored and named
# back in X-Ignored-Fields (Ollama ignores what it does not know, too).
CHAT_FIELDS = {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "fairness_key",
               "allow_remote"}
GENERATE_FIELDS = {"model", "prompt", "suffix", "system", "template", "context", "raw", "images", "format",
                   "options", "stream", "keep_alive", "fairness_key", "allow_remote"}
ROLES = ("system", "user", "assistant", "tool")
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "content_filter": "stop"}
_DURATION = re.compile(r"^(-?)(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?(?:(\d+)ms)?$")


# The shape of each route's body, checked before anything else (a malformed request loads nothing)
# and published in /openapi.json. Unknown fields pass (and are named back, where ignored).
_NULLABLE_STRING = {"type": ["string", "null"]}
_FORMAT = {"anyOf": [{"enum": ["", "json"]}, {"type": "object"}, {"type": "null"}],
           "description": "\"json\", or a JSON schema the answer follows"}
_OPTIONS = {"type": ["object", "null"], "description": "sampling options (the rest are named in X-Ignored-Fields)",
            "properties": {**{k: {"type": "number", "minimum": 0} for k in sorted(NONNEGATIVE_OPTIONS)},
                           **{k: {"type": "number"} for k in ("presence_penalty", "frequency_penalty")},
                           **{k: {"type": "integer"} for k in ("top_k", "num_predict", "seed")},
                           "num_ctx": {"type": "integer", "minimum": 1,
                                       "description": "checked against the model's context, never resized"},
                           "stop": {"anyOf": [{"type": "string", "minLength": 1},
                                              {"type": "array", "maxItems": 16,
                                               "items": {"type": "string", "minLength": 1}}]}}}
_KEEP_ALIVE = {"type": ["number", "string"], "description": "checked; the pool's lifecycle decides unloading"}
_IMAGES = {"type": ["array", "null"], "items": {"type": "string"}, "description": "base64 images"}
_MODEL = {"type": "string", "minLength": 1, "description": "a model id (`:latest` accepted)"}
_FUNCTION: dict[str, Any] = {"type": "object", "required": ["name"],
                             "properties": {"name": {"type": "string", "minLength": 1}}}
CHAT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["model"],
    "properties": {
        "model": _MODEL,
        "messages": {"type": ["array", "null"], "maxItems": 512, "items": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"enum": list(ROLES)}, "content": _NULLABLE_STRING, "images": _IMAGES,
                           "tool_calls": {"type": ["array", "null"], "items": {
                               "type": "object", "required": ["function"],
                               "properties": {"function": {**_FUNCTION, "properties": {
                                   **_FUNCTION["properties"], "arguments": {"type": "object"}}}}}},
                           "tool_name": _NULLABLE_STRING}}},
        "tools": {"type": ["array", "null"], "items": {"type": "object", "required": ["function"],
                                                       "properties": {"function": _FUNCTION}}},
        "format": _FORMAT, "options": _OPTIONS, "stream": {"type": "boolean", "description": "default true"},
        "keep_alive": _KEEP_ALIVE, "fairness_key": _NULLABLE_STRING},
}
GENERATE_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["model"],
    "properties": {
        "model": _MODEL, "prompt": _NULLABLE_STRING, "system": _NULLABLE_STRING, "images": _IMAGES,
        "raw": {"type": "boolean", "description": "the prompt as it is, to /v1/completions"},
        "suffix": {**_NULLABLE_STRING, "description": "refused: llama-server's /infill does that"},
        "template": {**_NULLABLE_STRING, "description": "refused: the engine applies the model's own"},
        "context": {"type": ["array", "null"], "items": {"type": "integer"}, "description": "refused unless empty"},
        "format": _FORMAT, "options": _OPTIONS, "stream": {"type": "boolean", "description": "default true"},
        "keep_alive": _KEEP_ALIVE, "fairness_key": _NULLABLE_STRING},
}
EMBED_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["model", "input"],
    "properties": {"model": _MODEL, "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                                              "items": {"type": "string"}}]},
                   "dimensions": {"type": "integer", "minimum": 1}, "truncate": {"type": "boolean"},
                   "options": _OPTIONS, "keep_alive": _KEEP_ALIVE, "fairness_key": _NULLABLE_STRING},
}
EMBEDDINGS_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["model", "prompt"],
    "properties": {"model": _MODEL, "prompt": {"type": "string"}, "options": _OPTIONS, "keep_alive": _KEEP_ALIVE,
                   "fairness_key": _NULLABLE_STRING},
}
SHOW_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["model"],
    "properties": {"model": _MODEL, "verbose": {"type": "boolean"}},
}
SCHEMAS = {"/api/chat": CHAT_SCHEMA, "/api/generate": GENERATE_SCHEMA, "/api/embed": EMBED_SCHEMA,
           "/api/embeddings": EMBEDDINGS_SCHEMA, "/api/show": SHOW_SCHEMA}
_VALIDATORS = {path: jsonschema.Draft202012Validator(schema) for path, schema in SCHEMAS.items()}


def check(path: str, body: Mapping[str, Any]) -> None:
    """The body against its route's schema: the first problem is a 400 naming the field."""
    error = jsonschema.exceptions.best_match(_VALIDATORS[path].iter_errors(body))
    if error is None:
        return
    param = ".".join(str(p) for p in error.absolute_path) or "(body)"
    if error.validator == "required":
        missing = error.message.split("'")[1]
        param = missing if param == "(body)" else f"{param}.{missing}"
    raise BadRequest(f"{param}: {error.message:.300}", code="missing_model" if param == "model" else
                     "invalid_request", param=param)


def route(path: str) -> bool:
    """Whether a request's errors take Ollama's shape: every /api/ route."""
    return path.startswith(PREFIX)


def error_body(err: PoolError) -> dict[str, Any]:
    return {"error": err.message}


def error_line(err: PoolError) -> bytes:
    """The line that ends a stream broken off after it began: the client raises it as its error."""
    return json.dumps(error_body(err)).encode() + b"\n"


def _bad(message: str, param: str, code: str = "invalid_request") -> BadRequest:
    return BadRequest(f"{param}: {message}", code=code, param=param)


def model_name(body: Mapping[str, Any]) -> str:
    """The model a request names, as llm-pool names it: `demo` and `demo:latest` are one model."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise BadRequest("model: required, a model id (GET /api/tags lists them)", code="missing_model",
                         param="model")
    return name[:-len(LATEST)] if name.endswith(LATEST) else name


def ignored(body: Mapping[str, Any], known: set[str]) -> list[str]:
    return [key for key in body if key not in known]


def keep_alive_s(value: Any) -> float | None:
    """`keep_alive` in seconds (a number, or Go's duration: "5m", "1h30m", "-1"); negative is
    forever. The pool's lifecycle decides unloading (docs/api.md): it is checked, never obeyed."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?\d+(\.\d+)?", text):
            return float(text)
        match = _DURATION.match(text)
        if text and match and any(match.groups()[1:]):
            sign, h, m, s, ms = match.groups()
            seconds = float(h or 0) * 3600 + float(m or 0) * 60 + float(s or 0) + int(ms or 0) / 1000
            return -seconds if sign else seconds
    raise _bad(f"{value!r:.40} is no duration (seconds, or like \"5m\", \"1h30m\", \"-1\")", "keep_alive")


def sampling(options: Any, traits: Traits, context: tuple[int, str] | None) -> tuple[dict[str, Any], list[str]]:
    """`options` as chat completions fields for this backend, and the options it ignores (named
    back): load-time ones (num_gpu, num_thread, ...), engine knobs the pool does not pass, unknown
    ones. `num_ctx` is a check: more than the model's `context` (its tokens, the field that set it) is 400."""
    if options is None:
        return {}, []
    if not isinstance(options, dict):
        raise _bad("must be an object", "options")
    out: dict[str, Any] = {}
    skipped: list[str] = []
    only = traits.decoding_only
    for key, value in options.items():
        where = f"options.{key}"
        if key in INTEGER_OPTIONS and (not isinstance(value, int) or isinstance(value, bool)):
            raise _bad(f"{value!r:.40} is not an integer", where)
        if key in NUMBER_OPTIONS and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise _bad(f"{value!r:.40} is not a number", where)
        if key in NONNEGATIVE_OPTIONS and value < 0:
            raise _bad(f"{value!r:.40} is not a number of 0 or more", where)
        if key == "stop":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value) or len(value) > 16:
                raise _bad("must be a list of up to 16 non-empty strings", where)
            out["stop"] = value
        elif key == "num_ctx":
            if value < 1:
                raise _bad(f"{value} is not a context size", where)
            if context is not None and value > context[0]:
                raise _bad(f"{value} is more than this model's context ({context[0]} tokens, {context[1]}); the pool "
                           "does not resize a model per request: ask its admin, or send a shorter prompt", where,
                           code="context_length_exceeded")
        elif key == "num_predict":
            if value == 0:
                raise _bad("0 generates nothing: a positive count, or -1 for no limit", where)
            if value > 0 and (only is None or "max_tokens" in only):
                out["max_tokens"] = value
        elif key == "repeat_penalty":
            if only is None:
                out[traits.repetition_field] = value
            else:
                skipped.append(where)
        elif key in SAMPLING and (only is None or SAMPLING[key] in only):
            out[SAMPLING[key]] = value
        else:
            skipped.append(where)
    return out, skipped


def response_format(value: Any) -> dict[str, Any] | None:
    """`format`: "json" (any JSON object) or a JSON schema, as chat completions' response_format."""
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value, "strict": True}}
    raise _bad(f"{value!r:.40} is neither \"json\" nor a JSON schema object", "format")


def _image_part(value: Any, where: str) -> dict[str, Any]:
    """A base64 image (Ollama's form) as a chat image part with its data URL."""
    if not isinstance(value, str) or not value:
        raise _bad("must be a base64 string", where)
    try:
        head = base64.b64decode(value, validate=True)[:12]
    except (binascii.Error, ValueError):
        raise _bad("is not base64 (send the image's bytes, base64-encoded)", where) from None
    mime = ("image/png" if head.startswith(b"\x89PNG") else "image/gif" if head.startswith(b"GIF8")
            else "image/webp" if head[8:12] == b"WEBP" else "image/jpeg")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{value}"}}


def _content(text: Any, images: Any, where: str, caps: Capabilities, model: str) -> Any:
    if text is not None and not isinstance(text, str):
        raise _bad("must be a string", f"{where}.content")
    if images is None or images == []:
        return text or ""
    if not isinstance(images, list):
        raise _bad("must be a list of base64 strings", f"{where}.images")
    if "image" not in caps.modalities:
        raise BadRequest(f"model {model!r} does not accept images (capabilities.modalities is "
                         f"{list(caps.modalities)})", code="modality_unsupported", param=f"{where}.images")
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    return parts + [_image_part(image, f"{where}.images.{i}") for i, image in enumerate(images)]


def _tool_calls(calls: Any, where: str, first: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls (Ollama's: arguments as an object) in chat's form, with ids
    call_<n> that the tool messages after it answer in order."""
    if not isinstance(calls, list):
        raise _bad("must be a list", where)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise _bad("each needs function.name", f"{where}.{i}")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, dict):
            raise _bad("must be an object", f"{where}.{i}.function.arguments")
        out.append({"id": f"call_{first + i}", "type": "function",
                    "function": {"name": function["name"], "arguments": json.dumps(arguments)}})
    return out


def chat_messages(messages: Any, caps: Capabilities, model: str) -> list[dict[str, Any]]:
    """/api/chat's messages as chat completions' (images as image parts, tool calls and results)."""
    if not isinstance(messages, list):
        raise _bad("must be a list of messages", "messages")
    out: list[dict[str, Any]] = []
    unanswered: list[dict[str, Any]] = []   # tool calls no tool message answered yet, in order
    calls = 0
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise _bad("must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"{role!r:.40} is not one of {', '.join(ROLES)}", f"{where}.role")
        turn: dict[str, Any] = {"role": role, "content": _content(message.get("content"), message.get("images"),
                                                                  where, caps, model)}
        if role == "assistant" and message.get("tool_calls"):
            turn["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls", calls)
            calls += len(turn["tool_calls"])
            unanswered += turn["tool_calls"]
        if role == "tool":
            name = message.get("tool_name")
            answered = next((c for c in unanswered if c["function"]["name"] == name), unanswered[0] if unanswered
                            else None)
            if answered is None:
                raise _bad("a tool message answers a tool call of an assistant message before it", where)
            unanswered.remove(answered)
            turn["tool_call_id"] = answered["id"]
        out.append(turn)
    return out


def check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("must be a list", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise _bad("each tool needs function.name", f"tools.{i}")
    return [{"type": "function", "function": tool["function"]} for tool in tools]


def check_generate(body: Mapping[str, Any], completions: bool) -> None:
    """What /api/generate asks that no engine behind the pool honours: a 400 naming it.
    `completions`: the model serves /v1/completions (what `raw` needs)."""
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise _bad("must be a string", "prompt")
    if body.get("template"):
        raise _bad("a request's Go template is not supported: the engine applies the model's own chat template "
                   "(or send raw: true with the prompt formatted)", "template", code="unsupported_field")
    if body.get("suffix"):
        raise _bad("fill-in-the-middle is llama-server's POST /infill (input_prefix, input_suffix) on this pool",
                   "suffix", code="unsupported_field")
    if body.get("context"):
        raise _bad("an earlier answer's context is not kept by the pool: send the conversation to /api/chat",
                   "context", code="unsupported_field")
    if body.get("raw") is not None and not isinstance(body.get("raw"), bool):
        raise _bad("must be true or false", "raw")
    if body.get("raw"):
        if body.get("system"):
            raise _bad("raw sends the prompt as it is, with no template to put a system prompt in", "system",
                       code="unsupported_field")
        if body.get("images"):
            raise _bad("raw sends the prompt as it is, with no place for images", "images", code="unsupported_field")
        if not completions:
            raise _bad("this model serves chat only (no /v1/completions): raw needs a completions endpoint",
                       "raw", code="endpoint_unsupported")
    if body.get("system") is not None and not isinstance(body.get("system"), str):
        raise _bad("must be a string", "system")


def generate_messages(body: Mapping[str, Any], caps: Capabilities, model: str) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": body["system"]}] if body.get("system") else []
    return messages + [{"role": "user", "content": _content(body.get("prompt") or "", body.get("images"), "(body)",
                                                             caps, model)}]


def created_at() -> str:
    now = time.time_ns()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now // 10**9)) + f".{now % 10**9:09d}Z"


def tool_calls_out(calls: list[Any]) -> list[dict[str, Any]]:
    """A chat answer's tool calls (untrusted) as Ollama's: arguments as an object."""
    out = []
    for call in calls:
        function = an_object(call.get("function") if isinstance(call, dict) else None)
        name = function.get("name")
        out.append({"function": {"name": name if isinstance(name, str) else "",
                                 "arguments": arguments_object(function.get("arguments"))}})
    return out


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53 else 0


def done_fields(finish_reason: str | None, usage: Mapping[str, Any] | None, timings: Mapping[str, Any] | None,
                spans_ns: tuple[int, int, int, int]) -> dict[str, Any]:
    """The last object's counts and durations (ns): the engine's own prompt and generation times
    where it gave them (llama-server's timings), else what the proxy measured; `spans_ns` is
    (total, load, to the first piece, after it)."""
    usage, timings = usage or {}, timings or {}
    total, load, first, rest = spans_ns
    prompt_ms, predicted_ms = timings.get("prompt_ms"), timings.get("predicted_ms")
    return {"done": True, "done_reason": DONE_REASONS.get(finish_reason or "stop", "stop"),
            "total_duration": total, "load_duration": load,
            "prompt_eval_count": _count(usage.get("prompt_tokens")) or _count(timings.get("prompt_n")),
            "prompt_eval_duration": int(prompt_ms * 1e6) if isinstance(prompt_ms, (int, float)) else first,
            "eval_count": _count(usage.get("completion_tokens")) or _count(timings.get("predicted_n")),
            "eval_duration": int(predicted_ms * 1e6) if isinstance(predicted_ms, (int, float)) else rest}


class Stream:
    """One streamed answer's NDJSON lines: a line per piece of text, the tool calls whole once the
    engine has sent all their pieces (Ollama's clients read a call's arguments as one object), then
    the `done` line."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.calls: dict[int, dict[str, Any]] = {}   # by the engine's index: name and arguments so far

    def _line(self, text: str, **more: Any) -> bytes:
        head: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self.chat:
            head["message"] = {"role": "assistant", "content": text, **more}
        else:
            head["response"] = text
        return json.dumps({**head, "done": False}).encode() + b"\n"

    def text(self, text: str) -> bytes:
        return self._line(text) if text else b""

    def call_pieces(self, pieces: list[Any]) -> None:
        for piece in pieces:
            if not isinstance(piece, dict):
                continue
            index = piece["index"] if isinstance(piece.get("index"), int) else len(self.calls)
            call = self.calls.setdefault(index, {"name": "", "arguments": ""})
            function = an_object(piece.get("function"))
            if isinstance(function.get("name"), str):
                call["name"] += function["name"]
            if isinstance(function.get("arguments"), str):
                call["arguments"] += function["arguments"]

    def end(self, done: dict[str, Any]) -> bytes:
        calls = b""
        if self.calls and self.chat:
            whole = [{"function": {"name": c["name"], "arguments": arguments_object(c["arguments"])}}
                     for _, c in sorted(self.calls.items())]
            calls = self._line("", tool_calls=whole)
        last: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        last.update({"message": {"role": "assistant", "content": ""}} if self.chat else {"response": ""})
        return calls + json.dumps({**last, **done}).encode() + b"\n"
