"""Anthropic's Messages API beside OpenAI's chat completions: the check of a request, the translation
both ways, and Anthropic's error shape.

llama-server and vLLM speak Messages themselves and get a request as it is; the shims and remote chat
providers do not, so for them a request becomes a chat completion and the answer (JSON, or a chat
stream chunk by chunk) becomes Anthropic's. Pure: no I/O. Whatever a replica sends is untrusted:
a field missing or of the wrong type reads as empty, never as an exception.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from proxy.edge.anthropic_tools import (an_object, assistant_turn, call_id, check_tool_result, check_tool_use,
                                        check_tools, tool_messages, tool_use_blocks, tools_to_chat)
from proxy.errors import BadRequest, PoolError, sse_error_event

ROLES = ("user", "assistant")
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
# Anthropic's error type for each status its SDK maps to an exception (RateLimitError, ...).
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 529: "overloaded_error"}
# Chat's finish reasons as Anthropic's stop reasons; anything else ended the turn.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}
NUMBERS = (("temperature", (int, float), "a number"), ("top_p", (int, float), "a number"),
           ("top_k", (int,), "an integer"))


def _bad(message: str, param: str) -> BadRequest:
    return BadRequest(message, code="invalid_request", param=param)


def check_request(body: Mapping[str, Any]) -> None:
    """Refuse what Anthropic's API would refuse, naming where; nothing is sent to a replica then."""
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _bad("`max_tokens` is required: an integer of at least 1", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("`messages` is required: a non-empty array of user and assistant turns", "messages")
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise _bad(f"`{where}` must be an object", where)
        if message.get("role") not in ROLES:
            raise _bad(f"`{where}.role` must be one of {', '.join(ROLES)}", f"{where}.role")
        _check_content(message.get("content"), f"{where}.content", message["role"])
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        if not isinstance(system, list) or not all(isinstance(b, dict) and b.get("type") == "text"
                                                   and isinstance(b.get("text"), str) for b in system):
            raise _bad("`system` must be a string or an array of text blocks", "system")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise _bad("`stop_sequences` must be an array of strings", "stop_sequences")
    for name, types, what in NUMBERS:
        value = body.get(name)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise _bad(f"`{name}` must be {what}", name)
    if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
        raise _bad("`stream` must be a boolean", "stream")
    check_tools(body)


def _check_content(content: Any, where: str, role: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not content:
        raise _bad(f"`{where}` must be a string or a non-empty array of content blocks", where)
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _bad(f"`{at}.text` must be a string", f"{at}.text")
        elif kind == "image":
            _check_image(block.get("source"), f"{at}.source")
        elif kind == "tool_use" and role == "assistant":
            check_tool_use(block, at)
        elif kind == "tool_result" and role == "user":
            check_tool_result(block, at, _check_image)
        else:
            # Named, so that a document or thinking block (or a tool block in the other's turn) is
            # told apart from a typo.
            named = f" ({kind[:40]!r})" if isinstance(kind, str) else ""
            raise _bad(f"`{at}`{named}: the block types supported are text, image, tool_use (in an assistant's "
                       "turn) and tool_result (in a user's)", at)


def _check_image(source: Any, where: str) -> None:
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        if source.get("media_type") not in IMAGE_TYPES:
            raise _bad(f"`{where}.media_type` must be one of {', '.join(IMAGE_TYPES)}", f"{where}.media_type")
        if not isinstance(source.get("data"), str):
            raise _bad(f"`{where}.data` must be a base64 string", f"{where}.data")
    elif kind == "url":
        if not isinstance(source.get("url"), str):
            raise _bad(f"`{where}.url` must be a string", f"{where}.url")
    else:
        raise _bad(f"`{where}` must be an image source of type base64 or url", where)


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A checked Messages request as a chat completions request (the proxy's own fields kept)."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, list):
        system = "\n".join(block["text"] for block in system)
    if system:
        messages.append({"role": "system", "content": system})
    for m in body["messages"]:
        messages += _chat_turns(m["role"], m["content"])
    chat: dict[str, Any] = {"model": body["model"], "messages": messages, "max_tokens": body["max_tokens"]}
    tools_to_chat(body, chat)
    for name in ("temperature", "top_p", "top_k", "fairness_key", "allow_remote", "prompt_cache_key"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences"):
        chat["stop"] = list(body["stop_sequences"])
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _chat_turns(role: str, content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One Messages turn as chat's: an assistant's with its tool calls; a user's tool results as
    tool messages first, then what else it says (none where it held only results)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "assistant" and any(block["type"] == "tool_use" for block in content):
        return [assistant_turn(content)]
    tools, rest = tool_messages(content)
    return tools + ([{"role": role, "content": _chat_content(rest)}] if rest else [])


def _chat_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Blocks as chat's content parts; text alone as one string, which every text-only engine takes."""
    if isinstance(content, str):
        return content
    if all(block["type"] == "text" for block in content):
        return "".join(block["text"] for block in content)
    parts: list[dict[str, Any]] = []
    for block in content:
        if block["type"] == "text":
            parts.append({"type": "text", "text": block["text"]})
            continue
        source = block["source"]
        url = source["url"] if source["type"] == "url" else f"data:{source['media_type']};base64,{source['data']}"
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _usage(usage: Any) -> dict[str, int]:
    usage = usage if isinstance(usage, dict) else {}
    return {"input_tokens": _count(usage.get("prompt_tokens")), "output_tokens": _count(usage.get("completion_tokens"))}


def stop_reason(finish_reason: Any) -> str:
    return STOP_REASONS.get(finish_reason, "end_turn") if isinstance(finish_reason, str) else "end_turn"


def to_message(chat: Mapping[str, Any], model: str, message_id: str) -> dict[str, Any]:
    """A chat completion (untrusted) as an Anthropic message."""
    chat = chat if isinstance(chat, Mapping) else {}
    choices = chat.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = an_object(choice.get("message"))
    text = message.get("content")
    calls = tool_use_blocks(message.get("tool_calls"))
    content = [{"type": "text", "text": text}] if isinstance(text, str) and text else []
    if not calls and not content:
        content = [{"type": "text", "text": ""}]   # as Anthropic's: an empty answer is one empty text block
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content + calls,
            "stop_reason": stop_reason(choice.get("finish_reason")), "stop_sequence": None,
            "usage": _usage(chat.get("usage"))}


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps({"type": name, **data}).encode() + b"\n\n"


def message_start(model: str, message_id: str) -> bytes:
    """The event that opens a message stream, before its prompt's count is known (0 until then)."""
    message: dict[str, Any] = {"id": message_id, "type": "message", "role": "assistant", "model": model,
                               "content": [], "stop_reason": None, "stop_sequence": None,
                               "usage": {"input_tokens": 0, "output_tokens": 0}}
    return _event("message_start", {"message": message})


class MessageStream:
    """A chat stream, chunk by chunk (untrusted), as Anthropic's events: message_start at once; a
    text block opened at the first text, a content_block_delta per piece of it; a tool_use block
    per tool call, an input_json_delta per piece of its arguments; each block stopped as the next
    begins; then message_delta (stop reason, output tokens) and message_stop."""

    def __init__(self, model: str, message_id: str) -> None:
        self.model, self.message_id = model, message_id
        self.input_tokens = self.output_tokens = 0
        self.finish_reason: str | None = None
        self.block = -1                  # the index of the last block opened (-1: none yet)
        self.open: str | None = None     # its type while it is open
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its block's

    def start(self) -> bytes:
        return message_start(self.model, self.message_id)

    def feed(self, chunk: Mapping[str, Any]) -> bytes:
        """The events for one chat chunk: b"" for one without text or a tool call (its finish reason
        and usage are kept)."""
        if not isinstance(chunk, Mapping):
            return b""
        if isinstance(chunk.get("usage"), dict):
            usage = _usage(chunk["usage"])
            self.input_tokens, self.output_tokens = usage["input_tokens"], usage["output_tokens"]
        choices = chunk.get("choices")
        events: list[bytes] = []
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            if isinstance(choice.get("finish_reason"), str):
                self.finish_reason = choice["finish_reason"]
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            content = delta.get("content")
            if isinstance(content, str) and content:
                if self.open != "text":
                    events.append(self._open({"type": "text", "text": ""}))
                # Only this piece is held: an answer's text goes out, it is never gathered (a long
                # one would be in memory whole, and copied at each piece).
                events.append(_event("content_block_delta", {"index": self.block,
                                                             "delta": {"type": "text_delta", "text": content}}))
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                if isinstance(call, dict):
                    events.append(self._call(call))
        return b"".join(events)

    def _call(self, call: Mapping[str, Any]) -> bytes:
        """One tool call's piece: its block's start where it is the call's first, and its arguments'
        piece. Engines stream calls one after another; a piece of a call whose block was stopped
        already (another began) has nowhere to go in Anthropic's order and is dropped."""
        function = an_object(call.get("function"))
        index = call.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            # No index: a call of its own where it names itself, else more of the last one.
            index = len(self.calls) if call.get("id") or function.get("name") or not self.calls else max(self.calls)
        out = b""
        if index not in self.calls:
            name = function.get("name")
            out = self._open({"type": "tool_use", "id": call_id(call.get("id")),
                              "name": name if isinstance(name, str) else "", "input": {}})
            self.calls[index] = self.block
        arguments = function.get("arguments")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments)   # an engine that sends the object whole
        if isinstance(arguments, str) and arguments and self.calls[index] == self.block and self.open == "tool_use":
            out += _event("content_block_delta", {"index": self.block,
                                                  "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return out

    def _open(self, block: dict[str, Any]) -> bytes:
        stopped = self._stop()
        self.block += 1
        self.open = block["type"]
        return stopped + _event("content_block_start", {"index": self.block, "content_block": block})

    def _stop(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return _event("content_block_stop", {"index": self.block})

    def end(self) -> bytes:
        # An answer with nothing in it is one empty text block, as Anthropic's is.
        blocks = self._stop() if self.block >= 0 else self._open({"type": "text", "text": ""}) + self._stop()
        return (blocks
                + _event("message_delta", {"delta": {"stop_reason": stop_reason(self.finish_reason),
                                                     "stop_sequence": None},
                                           # Totals, as Anthropic's are: the prompt's count is known only
                                           # now (chat sends usage last), and the SDK takes it from here.
                                           "usage": {"input_tokens": self.input_tokens,
                                                     "output_tokens": self.output_tokens}})
                + _event("message_stop", {}))


def error_body(err: PoolError) -> dict[str, Any]:
    """Anthropic's error shape for one of the pool's errors, its type read from the status."""
    kind = ANTHROPIC_ERROR_TYPES.get(err.status) or ("api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_event(err: PoolError) -> bytes:
    """The `error` event that ends a stream broken off after it began."""
    return _event("error", {"error": error_body(err)["error"]})


MESSAGES_PATH = "/v1/messages"


def route(path: str) -> bool:
    """Whether a request's errors take Anthropic's shape: /v1/messages and its count_tokens."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def stream_error(err: PoolError, path: str) -> bytes:
    """The SSE event that ends a stream broken off after it began, in the route's shape."""
    return error_event(err) if route(path) else sse_error_event(err)
