"""The llm-pool `/v1/responses` request: validation with the seed's rules, and translation to the
backend's OpenAI chat request.

Shape is checked by a JSON schema at the edge; the rules that depend on the model (capabilities,
prompt format) are checked after. Each failure is a 400 with a stable `code` and the `param` at fault.

Unknown fields, at the top level and in `decoding` alike, are ignored and named back to the client in
the `X-Ignored-Fields` response header: a client written for another llm-pool version keeps working
(the seed's service ignored them too), and a misspelt field does not go unnoticed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jsonschema

from proxy.capabilities import Capabilities, Traits
from proxy.config.model import ModelConfig
from proxy.errors import BadRequest
from shims.prompts import TURN_STOPS

MAX_MESSAGES = 512
MAX_CONTENT_ITEMS = 64
MAX_STOP = 16
# jsonschema checks every item of a list before the list's maxItems, at ~0.15 ms a content item
# (measured: 100,000 input items held the event loop 21 s). So lists are measured before the
# schema runs (_lengths), and all contents together hold this many items at most (512 messages of
# 4 parts each): the largest valid request is then checked in a fraction of a second.
MAX_CONTENT_ITEMS_TOTAL = 2048

_TEXT_ITEM = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_IMAGE_ITEM = {"type": "object", "required": ["type", "image_url"],
               "properties": {"type": {"const": "image_url"},
                              "image_url": {"type": "object", "required": ["url"],
                                            "properties": {"url": {"type": "string", "minLength": 1},
                                                           "detail": {"enum": ["auto", "low", "high"]}}}}}
_FILE_ITEM = {"type": "object", "required": ["type", "file"],
              "properties": {"type": {"const": "file"},
                             "file": {"type": "object", "required": ["file_data"],
                                      "properties": {"filename": {"type": "string"},
                                                     "file_data": {"type": "string",
                                                                   "pattern": "^data:[^;,]+;base64,"}}}}}
_CONTENT = {"anyOf": [{"type": "string"},
                      {"type": "array", "minItems": 1, "maxItems": MAX_CONTENT_ITEMS,
                       "items": {"type": "object", "required": ["type"],
                                 "properties": {"type": {"enum": ["text", "image_url", "file"]}},
                                 "allOf": [{"if": {"properties": {"type": {"const": t}}}, "then": item}
                                           for t, item in (("text", _TEXT_ITEM), ("image_url", _IMAGE_ITEM),
                                                           ("file", _FILE_ITEM))]}}]}
_NULLABLE_STRING = {"type": ["string", "null"]}

REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "input": _CONTENT,
        "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                     "items": {"type": "object", "required": ["role", "content"],
                               "properties": {"role": {"type": "string"}, "content": _CONTENT}}},
        "instructions": _NULLABLE_STRING,
        "source_lang_code": _NULLABLE_STRING,
        "target_lang_code": _NULLABLE_STRING,
        "allow_remote": {"type": "boolean"},
        "fairness_key": _NULLABLE_STRING,
        "prompt_cache_key": _NULLABLE_STRING,
        "stream": {"type": "boolean"},
        "thinking": {"enum": ["default", "enabled", "disabled"]},
        "decoding": {
            "type": "object",
            "properties": {"beam_size": {"type": "integer", "minimum": 1},
                           "top_k": {"type": "integer", "minimum": 0},
                           "top_p": {"type": "number", "minimum": 0, "maximum": 1},
                           "temperature": {"type": "number", "minimum": 0},
                           "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
                           "max_tokens": {"type": "integer", "minimum": 1},
                           "stop": {"type": "array", "maxItems": MAX_STOP,
                                    "items": {"type": "string", "minLength": 1, "maxLength": 256}}},
        },
    },
}
_VALIDATOR = jsonschema.Draft202012Validator(REQUEST_SCHEMA)
IGNORED_HEADER = "X-Ignored-Fields"
IGNORED_HEADER_MAX = 1024


def ignored_header(names: Sequence[str]) -> str:
    """The ignored fields' names as X-Ignored-Fields says them. A client's key may hold any character
    and a header value only visible ASCII (aiohttp drops the connection otherwise): the others are
    written as JSON escapes (`\\u001f`), and the whole is capped."""
    return ", ".join(n if n.isascii() and n.isprintable() else json.dumps(n)[1:-1] for n in names)[:IGNORED_HEADER_MAX]

# Stop strings each prompt format's chat template ends a turn with: the shims' own, one truth.
FORMAT_STOPS: Mapping[str, tuple[str, ...]] = TURN_STOPS
MIXED_SOURCE = {None, "", "auto", "mixed"}
MIXED_SOURCE_NOTE = ("The text below may mix several source languages. Detect the source language of "
                     "each segment and translate every segment.\n\n")


@dataclass(frozen=True)
class ResponsesRequest:
    model: str
    body: Mapping[str, Any]
    ignored: tuple[str, ...] = ()   # unknown fields, as paths (`decoding.min_p`), ignored

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream", False))


def ignored_fields(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The unknown fields of a request at both levels, in the order given."""
    known = REQUEST_SCHEMA["properties"]
    ignored = [k for k in body if k not in known]
    decoding = body.get("decoding")
    if isinstance(decoding, Mapping):
        ignored += [f"decoding.{k}" for k in decoding if k not in known["decoding"]["properties"]]
    return tuple(ignored)


def _param(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(body)"


def parse(body: Mapping[str, Any]) -> ResponsesRequest:
    """Check the request's shape; the first problem becomes a 400 naming the field."""
    _lengths(body)
    errors = sorted(_VALIDATOR.iter_errors(body), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        err = min(errors, key=lambda e: jsonschema.exceptions.relevance(e))
        param = _param(err)
        if err.validator == "required":
            missing = err.message.split("'")[1]
            param = missing if param == "(body)" else f"{param}.{missing}"
        code = "missing_model" if param == "model" and err.validator == "required" else "invalid_request"
        raise BadRequest(f"{param}: {err.message}", code=code, param=param)
    return ResponsesRequest(model=body["model"], body=body, ignored=ignored_fields(body))


def _lengths(body: Mapping[str, Any]) -> None:
    """The schema's maxItems, and MAX_CONTENT_ITEMS_TOTAL, checked without a walk."""
    messages = body.get("messages")
    messages = messages if isinstance(messages, list) else []
    decoding = body.get("decoding")
    lists = [("messages", messages, MAX_MESSAGES),
             ("decoding.stop", decoding.get("stop") if isinstance(decoding, Mapping) else None, MAX_STOP)]
    for param, value, bound in lists:
        if isinstance(value, list) and len(value) > bound:
            raise _too_long(param, len(value), bound)
    contents = [("input", body.get("input"))]
    contents += [(f"messages.{i}.content", m.get("content")) for i, m in enumerate(messages) if isinstance(m, dict)]
    total = 0
    for param, content in contents:
        if isinstance(content, list):
            if len(content) > MAX_CONTENT_ITEMS:
                raise _too_long(param, len(content), MAX_CONTENT_ITEMS)
            total += len(content)
    if total > MAX_CONTENT_ITEMS_TOTAL:
        raise BadRequest(f"messages: {total} content items in all messages, over the bound of "
                         f"{MAX_CONTENT_ITEMS_TOTAL}", code="invalid_request", param="messages")


def _too_long(param: str, length: int, bound: int) -> BadRequest:
    return BadRequest(f"{param}: {length} items, over the bound of {bound}", code="invalid_request", param=param)


def _items(content: Any) -> list[dict[str, Any]]:
    return content if isinstance(content, list) else []


def validate_for_model(req: ResponsesRequest, model: ModelConfig, caps: Capabilities) -> None:
    """The rules that depend on the model: input form, roles, capabilities, prompt format."""
    body = req.body
    has_input, has_messages = "input" in body and body["input"] is not None, \
        "messages" in body and body["messages"] is not None
    if has_input == has_messages:
        raise BadRequest("provide exactly one of `input` and `messages`", code="invalid_input", param="input")
    contents = [body["input"]] if has_input else [m["content"] for m in body["messages"]]
    if has_messages:
        if not caps.multi_turn:
            raise BadRequest(f"model {model.name!r} takes single-turn `input` only (capabilities.multi_turn is "
                             "false)", code="multi_turn_unsupported", param="messages")
        for i, message in enumerate(body["messages"]):
            if message["role"] not in ("user", "assistant"):
                raise BadRequest(f"messages.{i}.role: only user and assistant; put a system prompt in "
                                 "`instructions`", code="invalid_messages", param=f"messages.{i}.role")
        if body["messages"][-1]["role"] != "user":
            raise BadRequest("the last message must have role user", code="invalid_messages", param="messages")
    for content in contents:
        for item in _items(content):
            if item["type"] == "image_url" and "image" not in caps.modalities:
                raise BadRequest(f"model {model.name!r} does not accept images (capabilities.modalities is "
                                 f"{list(caps.modalities)})", code="modality_unsupported", param="input")
            if item["type"] == "file" and not caps.file_inputs:
                raise BadRequest(f"model {model.name!r} does not accept file items (no remote_file_mode)",
                                 code="modality_unsupported", param="input")
    thinking = body.get("thinking", "default")
    if thinking not in caps.thinking_modes:
        raise BadRequest(f"thinking {thinking!r} is not supported by model {model.name!r}; supported: "
                         f"{list(caps.thinking_modes)}", code="thinking_unsupported", param="thinking")
    if model.get("prompt_format") == "translategemma_template":
        if not body.get("target_lang_code"):
            raise BadRequest("translategemma_template needs `target_lang_code`", code="target_lang_required",
                             param="target_lang_code")
        if body.get("instructions"):
            raise BadRequest("omit `instructions` for translategemma_template: the template carries the task",
                             code="instructions_not_allowed", param="instructions")
        if not has_input:
            raise BadRequest("translategemma_template takes the source text in `input`", code="invalid_input",
                             param="messages")


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(item["text"] for item in content if item["type"] == "text")


def _backend_content(content: Any) -> Any:
    """Content arrays go through in OpenAI form; a text-only array becomes one prompt string."""
    if isinstance(content, list) and all(item["type"] == "text" for item in content):
        return _text_of(content)
    return content


def _translategemma_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """TranslateGemma's structured user turn: the text with its source and target language codes."""
    text = _text_of(body["input"])
    target = body["target_lang_code"]
    source = body.get("source_lang_code")
    if source in MIXED_SOURCE:
        # The template needs a valid source code; the note asks the model to detect each segment's.
        source = "en" if target != "en" else "de"
        text = MIXED_SOURCE_NOTE + text
    return [{"role": "user", "content": [{"type": "text", "source_lang_code": source,
                                          "target_lang_code": target, "text": text}]}]


def backend_request(req: ResponsesRequest, model: ModelConfig, traits: Traits,
                    engine_decoding: Mapping[str, Any]) -> dict[str, Any]:
    """The OpenAI chat request for the model's backend, shaped by what the backend can do (its
    traits), without `model`, which the router sets."""
    body = req.body
    if model.get("prompt_format") == "translategemma_template":
        messages = _translategemma_messages(body)
    else:
        messages = []
        if body.get("instructions"):
            messages.append({"role": "system", "content": body["instructions"]})
        if body.get("input") is not None:
            messages.append({"role": "user", "content": _backend_content(body["input"])})
        else:
            messages += [{"role": m["role"], "content": _backend_content(m["content"])}
                         for m in body["messages"]]
    decoding = {**engine_decoding, **(body.get("decoding") or {})}
    out: dict[str, Any] = {"messages": messages}
    only = traits.decoding_only
    for key in ("max_tokens", "temperature", "top_p", "top_k"):
        if decoding.get(key) is not None and (only is None or key in only):
            out[key] = decoding[key]
    if decoding.get("repetition_penalty") is not None and only is None:
        out[traits.repetition_field] = decoding["repetition_penalty"]
    if decoding.get("beam_size") is not None and traits.beam_search:
        out["beam_size"] = decoding["beam_size"]
    stops = list(dict.fromkeys([*FORMAT_STOPS.get(model.get("prompt_format") or "", ()),
                                *(decoding.get("stop") or [])]))
    if stops:
        out["stop"] = stops
    thinking = body.get("thinking", "default")
    enable = {"enabled": True, "disabled": False}.get(thinking, model.get("enable_thinking"))
    if enable is not None and traits.thinking == "template":
        out["chat_template_kwargs"] = {"enable_thinking": bool(enable)}
    if thinking != "default" and traits.thinking == "provider":
        out["thinking"] = {"type": thinking}   # else the model's remote_thinking applies
    if body.get("prompt_cache_key") and model.get("remote_prompt_cache_key_enabled"):
        out["prompt_cache_key"] = body["prompt_cache_key"]
    if req.stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out
