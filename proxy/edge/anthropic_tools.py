"""Anthropic's tool use beside chat completions' function calling: the checks of `tools`,
`tool_choice`, `tool_use` and `tool_result`, and their translation both ways (proxy/edge/
anthropic.py holds the rest of the Messages API). An engine that speaks Messages itself gets them
as they are; for every other backend a tool is a chat `function`, a `tool_use` block an assistant's
`tool_calls` entry and a `tool_result` block a `tool` message. Pure: no I/O. What a replica sends
is untrusted: a tool call that cannot be read is a `tool_use` block with what could be read.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Mapping

from proxy.errors import BadRequest

# Anthropic's rule for a custom tool's name.
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
CHOICES = ("auto", "any", "tool", "none")
# Chat's tool_choice for Anthropic's; "tool" names one function.
CHAT_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
# What a tool_result's content may hold (Anthropic's: text and image blocks).
RESULT_BLOCKS = ("text", "image")


def _bad(message: str, param: str) -> BadRequest:
    return BadRequest(message, code="invalid_request", param=param)


def check_tools(body: Mapping[str, Any]) -> None:
    """`tools` and `tool_choice` as Anthropic's API takes them: custom tools only (a server tool,
    `web_search_...` and the like, runs at Anthropic, not on an engine of the pool)."""
    tools = body.get("tools")
    names: set[str] = set()
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("`tools` must be an array of tools", "tools")
        for i, tool in enumerate(tools):
            where = f"tools.{i}"
            if not isinstance(tool, dict):
                raise _bad(f"`{where}` must be an object", where)
            kind = tool.get("type")
            if kind not in (None, "custom"):
                named = f" {kind[:60]!r}" if isinstance(kind, str) else ""
                raise _bad(f"`{where}.type`{named}: llm-pool serves custom tools (name, description, input_schema); "
                           "Anthropic's server tools run at Anthropic", f"{where}.type")
            name = tool.get("name")
            if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
                raise _bad(f"`{where}.name` must be 1 to 128 letters, digits, '_' or '-'", f"{where}.name")
            if name in names:
                raise _bad(f"`{where}.name`: two tools are named {name!r}", f"{where}.name")
            names.add(name)
            if tool.get("description") is not None and not isinstance(tool.get("description"), str):
                raise _bad(f"`{where}.description` must be a string", f"{where}.description")
            schema = tool.get("input_schema")
            if not isinstance(schema, dict) or schema.get("type") != "object":
                raise _bad(f"`{where}.input_schema` must be a JSON schema of type object", f"{where}.input_schema")
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in CHOICES:
        raise _bad(f"`tool_choice` must be an object whose type is one of {', '.join(CHOICES)}", "tool_choice")
    if choice["type"] == "tool" and choice.get("name") not in names:
        raise _bad("`tool_choice.name` must name one of `tools`", "tool_choice.name")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("`tool_choice.disable_parallel_tool_use` must be a boolean", "tool_choice.disable_parallel_tool_use")


def check_tool_use(block: Mapping[str, Any], at: str) -> None:
    if not isinstance(block.get("id"), str) or not block["id"]:
        raise _bad(f"`{at}.id` must be a non-empty string", f"{at}.id")
    if not isinstance(block.get("name"), str) or not block["name"]:
        raise _bad(f"`{at}.name` must be a non-empty string", f"{at}.name")
    if not isinstance(block.get("input"), dict):
        raise _bad(f"`{at}.input` must be an object", f"{at}.input")


def check_tool_result(block: Mapping[str, Any], at: str, check_image: Callable[[Any, str], None]) -> None:
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise _bad(f"`{at}.tool_use_id` must be a non-empty string", f"{at}.tool_use_id")
    if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
        raise _bad(f"`{at}.is_error` must be a boolean", f"{at}.is_error")
    content = block.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _bad(f"`{at}.content` must be a string or an array of text and image blocks", f"{at}.content")
    for k, part in enumerate(content):
        where = f"{at}.content.{k}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind == "image":
            check_image(part.get("source"), f"{where}.source")
            continue
        raise _bad(f"`{where}` must be a text or an image block", where)


def tools_to_chat(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    """A checked request's tools and tool_choice as chat's, into `chat`."""
    tools = body.get("tools")
    if tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t["name"], "parameters": t["input_schema"],
            **({"description": t["description"]} if t.get("description") else {})}} for t in tools]
    choice = body.get("tool_choice")
    if not tools or choice is None:
        return   # a tool_choice without tools means nothing to chat, which would refuse it
    kind = choice["type"]
    chat["tool_choice"] = ({"type": "function", "function": {"name": choice["name"]}} if kind == "tool"
                           else CHAT_CHOICE[kind])
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def assistant_turn(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """An assistant turn of blocks as chat's assistant message: its text, and a tool call per tool_use."""
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
             for b in blocks if b["type"] == "tool_use"]
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        turn["tool_calls"] = calls
    return turn


def tool_messages(blocks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A user turn's tool_result blocks as chat's tool messages (which must follow the assistant's
    tool calls at once), and the blocks left for the user message after them: the turn's other
    blocks, and a result's images (a tool message is text only)."""
    tools: list[dict[str, Any]] = []
    rest: list[dict[str, Any]] = []
    for block in blocks:
        if block["type"] != "tool_result":
            rest.append(block)
            continue
        content = block.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        text = "".join(p["text"] for p in parts if p["type"] == "text")
        rest += [p for p in parts if p["type"] == "image"]
        if block.get("is_error"):
            text = f"Error: {text}"   # chat has no flag for it; the model reads it as Anthropic's would
        tools.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
    return tools, rest


def tool_use_blocks(calls: Any) -> list[dict[str, Any]]:
    """A chat message's tool_calls (untrusted) as tool_use blocks."""
    blocks = []
    for call in calls if isinstance(calls, list) else []:
        if not isinstance(call, dict):
            continue
        function = an_object(call.get("function"))
        blocks.append({"type": "tool_use", "id": call_id(call.get("id")), "name": _name(function.get("name")),
                       "input": arguments_object(function.get("arguments"))})
    return blocks


def an_object(value: Any) -> dict[str, Any]:
    """An untrusted value where an object is expected: itself, or an empty one."""
    return value if isinstance(value, dict) else {}


def call_id(value: Any) -> str:
    """The engine's id of a tool call, or one of ours where it gave none (the client answers by it)."""
    return value if isinstance(value, str) and value else f"toolu_{os.urandom(12).hex()}"


def _name(value: Any) -> str:
    return value if isinstance(value, str) else ""


def arguments_object(arguments: Any) -> dict[str, Any]:
    """A call's arguments as the object a tool_use block's input is: JSON text (chat's form), or an
    object (some engines'); anything else (a model's malformed JSON) is an empty input."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            return {}
        return value if isinstance(value, dict) else {}
    return {}
