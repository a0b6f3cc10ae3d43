"""What a relayed stream used, however it ended (docs/tenants.md).

A stream that ends whole carries its engine's usage near its end (OpenAI's usage chunk, Anthropic's
message_delta) and, for Anthropic's events, its prompt's count near its start (message_start). A
stream that ends early (the client left, the handler was cancelled, the backend broke off) has no
usage chunk: what it relayed is counted from its events as they went out (one per token), and its
prompt is the engine's figure where one arrived, else an estimate from the prompt's characters,
which the ledger marks as such (USAGE_ESTIMATED).

Nothing here parses a chunk as it passes: a read's events are counted (`bytes.count`) and the usage
is decoded once, from the first and last reads, when the stream is over.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from aiohttp import web

from proxy.lifecycle.state.replicas import Replica
from proxy.serving.keys import FAIRNESS_KEY, METRICS, STREAM_ENDED, USAGE, USAGE_ESTIMATED
from proxy.serving.metrics import usage_at, usage_in
from proxy.serving.response_metrics import usage_numbers

log = logging.getLogger(__name__)

# The pass-through routes whose streams are OpenAI's chunks, which a backend may send usage in
# only when asked (Traits.usage_on_request).
USAGE_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
MESSAGES_ROUTE = "/v1/messages"
ASK = b',"stream_options":{"include_usage":true}}'
# The usage chunk a client did not ask for: the one chunk with no choices (OpenAI's rule, which
# llama-server and vLLM follow), as compact JSON or as Python's json.dumps writes it.
NO_CHOICES = (b'"choices":[]', b'"choices": []')
# A prompt's characters per token, for an estimate: about what BPE vocabularies give for English.
CHARS_PER_TOKEN = 4


def ask_usage(body: dict[str, Any], raw: bytes | None) -> tuple[dict[str, Any], bytes | None] | None:
    """`body` (and its bytes, where the client's are sent as they are) asking for the stream's
    usage; None when the client asked for it itself. The bytes get the field spliced in before the
    object's closing brace, not the body encoded again: a stream request's body was checked as a
    JSON object at the edge, with more than `stream` in it."""
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return None
    asked = {**body, "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True}}
    if raw is None or "stream_options" in body:
        return asked, None
    end = raw.rstrip()
    if not end.endswith(b"}"):
        return asked, None
    return asked, end[:-1] + ASK


def without_usage_chunk(chunk: bytes) -> bytes:
    """A read of the stream less the usage chunk in it, if the whole chunk is in it."""
    for needle in NO_CHOICES:
        at = chunk.find(needle)
        if at >= 0:
            start = chunk.rfind(b"data:", 0, at)
            end = chunk.find(b"\n\n", at)
            if start < 0 or end < 0:
                return chunk   # split over two reads: it goes out (once in a while, not a failure)
            return chunk[:start] + chunk[end + 2:]
    return chunk


def first_usage_in(raw: bytes) -> dict[str, Any] | None:
    """The first `"usage": {...}` object in `raw` (Anthropic's message_start), or None."""
    return usage_at(raw, raw.find(b'"usage"'))


def prompt_chars(body: Mapping[str, Any]) -> tuple[int, int]:
    """The characters of a chat or completions request's prompt, and the token ids it gives as
    such (a completions prompt may be token ids): the ground for an estimate of its tokens."""
    chars = tokens = 0
    stack: list[Any] = [body.get("messages"), body.get("prompt"), body.get("system")]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            tokens += 1
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(v for k, v in item.items() if k in ("content", "text", "messages"))
    return chars, tokens


def estimated_prompt(body: Mapping[str, Any]) -> int:
    chars, tokens = prompt_chars(body)
    return tokens + -(-chars // CHARS_PER_TOKEN)


def settle(request: web.Request, model: str, body: Mapping[str, Any], usage: Mapping[str, Any] | None,
           relayed: int, replica: Replica | None) -> None:
    """Set the request's USAGE (and USAGE_ESTIMATED) from what a stream gave: the engine's `usage`
    where it came, else `relayed` (the tokens that went out) and the prompt's estimate."""
    metrics = request.app[METRICS]
    prompt, cached, output = usage_numbers(usage)
    estimated = not _count(prompt)
    if estimated or not _count(output):
        usage = {"prompt_tokens": estimated_prompt(body) if estimated else prompt,
                 "prompt_tokens_details": {"cached_tokens": 0 if estimated else cached},
                 "completion_tokens": output if _count(output) else relayed}
        # An estimate says nothing of the replica's cache.
        replica = None if estimated else replica
    request[USAGE] = metrics.count_usage(model, metrics.key_label(request.get(FAIRNESS_KEY)), usage, replica)
    request[USAGE_ESTIMATED] = estimated


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Tally:
    """A pass-through stream's events as they go out, its first read, and whether its end did. The
    relay counts in its own loop (forward._relay): `needle`s in each chunk that went out, and the
    `marker` among a chunk's last 32 bytes for the end."""

    __slots__ = ("needle", "marker", "events", "head", "ended", "settled")

    def __init__(self, path: str) -> None:
        messages = path == MESSAGES_ROUTE
        # Anthropic's text events (in their JSON, not the `event:` line), else every OpenAI chunk.
        self.needle = b'"content_block_delta"' if messages else b"data:"
        self.marker = b"message_stop" if messages else b"[DONE]"
        self.events = 0
        self.head = b""
        self.ended = False      # its last event went out: the stream is whole, whatever comes next
        self.settled = False

    def relayed(self) -> int:
        """The tokens the events that went out carried (OpenAI's end, [DONE], is no token)."""
        return max(0, self.events - (self.ended and self.needle == b"data:"))

    def usage(self, tail: bytes) -> dict[str, Any] | None:
        """The engine's usage: the last in the stream's `tail`, with what its first read said of
        the prompt (Anthropic's message_start; the end's message_delta has only the output)."""
        last = usage_in(tail)
        if self.needle == b"data:":
            return last
        first = first_usage_in(self.head) if self.head else None
        if self.ended:
            usage = {**(first or {}), **(last or {})}
        else:
            # Cut short: message_start's output count (0) says nothing of what went out.
            usage = {k: v for k, v in (first or {}).items() if k != "output_tokens"}
        if "input_tokens" not in usage and "output_tokens" in usage:
            # No message_start (llama-server leaves it out now and then): the output's count alone.
            return {"completion_tokens": usage["output_tokens"]}
        return usage or None

    def settle(self, request: web.Request, replica: Replica, body: Mapping[str, Any], tail: bytes) -> None:
        self.settled = True
        try:
            settle(request, replica.model, body, self.usage(tail), self.relayed(), replica)
        except Exception:   # bookkeeping: the answer went out, and must stay what it was
            log.exception("the usage of %s %s was not counted", request.method, request.path)


def mark_ended(request: web.Request, out: web.StreamResponse) -> None:
    """The stream's end went out: a success, whatever the client does next (closing before the
    handler returns cancels it, which the metrics middleware reads as this answer)."""
    request[STREAM_ENDED] = out
