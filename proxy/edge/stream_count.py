"""A pass-through stream's events as they go out, counted without parsing a chunk: what the relay
needs in any process (a worker's too: nothing here knows the pool). What the counts are charged as
is proxy/serving/stream_usage.py's.
"""
from __future__ import annotations

from typing import Any

from proxy.edge.anthropic import MESSAGES_PATH
from proxy.edge.response_metrics import usage_at, usage_in

# The usage chunk a client did not ask for: the one chunk with no choices (OpenAI's rule, which
# llama-server and vLLM follow), as compact JSON or as Python's json.dumps writes it.
NO_CHOICES = (b'"choices":[]', b'"choices": []')


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


class Tally:
    """A pass-through stream's events as they go out, its first read, and whether its end did. The
    relay counts in its own loop (stream_relay.relay_stream): `needle`s in each chunk that went out, and the
    `marker` among a chunk's last 32 bytes for the end."""

    __slots__ = ("needle", "marker", "events", "head", "ended", "settled")

    def __init__(self, path: str) -> None:
        messages = path == MESSAGES_PATH
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
