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
from proxy.edge.response_metrics import usage_numbers
from proxy.edge.stream_count import Tally
from proxy.serving.slot_reuse import note_reuse

log = logging.getLogger(__name__)

# The pass-through routes whose streams are OpenAI's chunks, which a backend may send usage in
# only when asked (Traits.usage_on_request).
USAGE_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
ASK = b',"stream_options":{"include_usage":true}}'
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
    note_reuse(request, replica, usage)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def settle_tally(tally: Tally, request: web.Request, replica: Replica, body: Mapping[str, Any], tail: bytes) -> None:
    """The request's usage from a pass-through stream's `tally` and the `tail` of what went out."""
    tally.settled = True
    try:
        settle(request, replica.model, body, tally.usage(tail), tally.relayed(), replica)
    except Exception:   # bookkeeping: the answer went out, and must stay what it was
        log.exception("the usage of %s %s was not counted", request.method, request.path)


def mark_ended(request: web.Request, out: web.StreamResponse) -> None:
    """The stream's end went out: a success, whatever the client does next (closing before the
    handler returns cancels it, which the metrics middleware reads as this answer)."""
    request[STREAM_ENDED] = out
