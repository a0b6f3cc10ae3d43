"""A request's affinity key (docs/routing.md: Replica routing and affinity): what sends a conversation back
to the replica that has its prefix cached. The first that applies:

1. the body's `prompt_cache_key` (OpenAI's field, on chat completions, completions and responses);
2. the `X-Session-Id` header;
3. a hash of the start of the prompt as the backend will see it: of `messages`, the leading
   messages up to and including the first user message (the system prompt and the question a
   conversation starts with, which every later turn repeats), at most `affinity_prefix_chars` of
   each; of `prompt` or `input`, its first `affinity_prefix_chars`.

The fairness key is never the affinity key: one client's many conversations spread over replicas.
The key is a short digest whichever its source, so what a client sends is never kept or logged.
Only a model with `routing: affinity` gets a key at all: for least_loaded nothing here reads the
body beyond one field, so that routing costs nothing.

With tenants the data path makes a key its tenant's (proxy/serving/forward.py `upstream`, and
proxy/lifecycle/state/slots.py): one tenant's `X-Session-Id`, `prompt_cache_key` or prompt never
routes to, or reuses, another tenant's slot.
"""
from __future__ import annotations

import hashlib
from typing import Any, Mapping

from proxy.errors import BadRequest
from proxy.lifecycle.state.runtime import ModelRuntime

SESSION_HEADER = "X-Session-Id"
# Embeddings hold no KV cache between requests: affinity would only cost balance.
NO_AFFINITY_PATHS = frozenset({"/v1/embeddings"})
# What runs in a llama-server slot and reuses its cache: where a request gets a slot of its own
# scope (with tenants, every such request does). /v1/responses and translated /v1/messages go as chat.
SLOT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/infill"})
# Leading messages read at most while looking for the first user message (few-shot examples,
# several system messages): the key stays cheap whatever a client sends.
MAX_LEADING_MESSAGES = 16


def digest(source: str, text: str) -> str:
    """The key for `text` from `source` (c: prompt_cache_key, s: session header, p: prompt)."""
    return source + ":" + hashlib.blake2b(text.encode(errors="surrogatepass"), digest_size=12).hexdigest()


def cache_key_of(body: Mapping[str, Any]) -> str | None:
    """The body's prompt_cache_key, checked: a string, or absent (null)."""
    value = body.get("prompt_cache_key")
    if value is not None and not isinstance(value, str):
        raise BadRequest("`prompt_cache_key` must be a string", code="invalid_type", param="prompt_cache_key")
    return value or None


def affinity_key(runtime: ModelRuntime, path: str, headers: Mapping[str, str], body: Mapping[str, Any],
                 prompt: Mapping[str, Any] | None = None) -> str | None:
    """The request's affinity key, or None (routing: least_loaded, or an endpoint without a cache).
    `prompt`: the body as the backend will get it, when that is not `body` (/v1/responses builds
    its chat messages from `input` and `instructions`)."""
    cache_key = cache_key_of(body)
    if not runtime.affinity_routing or path in NO_AFFINITY_PATHS:
        return None
    if cache_key:
        return digest("c", cache_key)
    session = headers.get(SESSION_HEADER)
    if session:
        return digest("s", session)
    text = prompt_prefix(prompt if prompt is not None else body, int(runtime.model.get("affinity_prefix_chars")))
    return digest("p", text) if text else None


def prompt_prefix(body: Mapping[str, Any], limit: int) -> str:
    """The start of the prompt that every turn of one conversation repeats; "" when there is none.
    Reads only the leading messages (or the first `limit` characters), never the whole body."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages[:MAX_LEADING_MESSAGES]:
            if not isinstance(message, dict):
                break
            role = message.get("role")
            parts.append(f"{role}\x1f{_text(message.get('content'), limit)}")
            if role == "user":
                break
        return "\x1e".join(parts)
    for field in ("prompt", "input"):
        value = body.get(field)
        if isinstance(value, list) and value and not isinstance(value[0], int):
            value = value[0]   # a batch: its first prompt (a string, or token ids)
        if isinstance(value, list) and value:
            # A prompt of token ids: its first `limit` tokens (anything else in it is no token).
            value = " ".join(str(t) for t in value[:limit] if isinstance(t, int))
        if isinstance(value, str):
            return f"{field}\x1f{value[:limit]}"
    return ""


def _text(content: Any, limit: int) -> str:
    """At most `limit` characters of a message's content: a string, or its parts' text (an image
    part by the start of its URL)."""
    if isinstance(content, str):
        return content[:limit]
    if not isinstance(content, list):
        return ""
    out: list[str] = []
    size = 0
    for part in content:
        if size >= limit:
            break
        if not isinstance(part, dict):
            continue
        piece = part.get("text")
        if not isinstance(piece, str):
            image = part.get("image_url")
            piece = image.get("url") if isinstance(image, dict) else image
        if isinstance(piece, str):
            piece = piece[:limit - size]
            out.append(piece)
            size += len(piece)
    return "\x1d".join(out)
