"""The `metrics` of a /v1/responses answer: each timer measured where its name says.

A value nobody measured is None (JSON null), never invented.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

METRIC_KEYS = (
    "backend_inference_wall_ms", "engine_total_wall_ms", "engine_outside_backend_wall_ms", "pool_total_wall_ms",
    "engine_queue_wait_ms", "engine_tokenize_ms", "gpu_time_to_first_token_ms", "gpu_generate_total_ms",
    "gpu_decode_after_first_token_ms", "engine_prompt_tokens", "engine_cached_prompt_tokens",
    "engine_output_tokens", "engine_tokens_per_second", "backend_time_to_first_token_ms",
)


def _ms(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round((end - start) * 1000, 1)


@dataclass
class Timer:
    """Marks on one request's way through the pool (time.perf_counter seconds).

    handler: the HTTP handler began; enqueued: joined the model's queue; admitted: got a slot;
    sent: the backend call began; received: the backend's last byte arrived; finished: the engine
    work (translation, parsing) is done; first_token: a stream's first text arrived from the backend.
    """

    handler: float = field(default_factory=time.perf_counter)
    enqueued: float | None = None
    admitted: float | None = None
    sent: float | None = None
    received: float | None = None
    finished: float | None = None
    first_token: float | None = None

    def mark(self, name: str) -> None:
        setattr(self, name, time.perf_counter())


# The most tokens one answer's usage may claim: an engine's or a provider's figure is untrusted input
# (10**30, NaN, a string), and what is not an integer in 0..MAX_USAGE_COUNT counts as not given.
MAX_USAGE_COUNT = 2 ** 31


def _count(value: object, name: str, bad: list[str]) -> int | None:
    if value is None:
        return None
    if type(value) is int and 0 <= value <= MAX_USAGE_COUNT:
        return value
    bad.append(f"{name}={value!r:.40}")
    return None


def checked_usage(usage: Mapping[str, Any] | None) -> tuple[tuple[int | None, int | None, int | None], list[str]]:
    """An answer's `usage` (OpenAI's, Moonshot's or Anthropic's shape) as prompt, cached and output
    tokens, each an int in 0..MAX_USAGE_COUNT or None (not given, or not a count), and what was not
    a count ("prompt_tokens=1e+30"), for the caller to log."""
    bad: list[str] = []
    if not usage or not isinstance(usage, Mapping):
        return (None, None, None), bad
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if cached is None:
        cached = usage.get("cached_tokens")  # Moonshot reports it at the top level
    if "prompt_tokens" not in usage and "input_tokens" in usage:
        # Anthropic's (/v1/messages): input_tokens leaves out what was read from the cache.
        read = _count(usage.get("cache_read_input_tokens"), "cache_read_input_tokens", bad) or 0
        given = _count(usage.get("input_tokens"), "input_tokens", bad)
        output = _count(usage.get("output_tokens"), "output_tokens", bad)
        return (min(given + read, MAX_USAGE_COUNT) if given is not None else None, read, output), bad
    return (_count(usage.get("prompt_tokens"), "prompt_tokens", bad), _count(cached, "cached_tokens", bad),
            _count(usage.get("completion_tokens"), "completion_tokens", bad)), bad


def usage_numbers(usage: Mapping[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    """checked_usage's counts alone."""
    return checked_usage(usage)[0]


def build(timer: Timer, usage: Mapping[str, Any] | None, timings: Mapping[str, Any] | None,
          now: float | None = None) -> dict[str, Any]:
    """All metric keys; `usage` is the backend's OpenAI usage, `timings` llama-server's own timings."""
    end = now if now is not None else time.perf_counter()
    prompt, cached, output = usage_numbers(usage)
    prefill = timings.get("prompt_ms") if timings else None
    decode = timings.get("predicted_ms") if timings else None
    generate = round(prefill + decode, 1) if prefill is not None and decode is not None else None
    backend = _ms(timer.sent, timer.received)
    engine_total = _ms(timer.enqueued, timer.finished)
    generation_s = (generate / 1000) if generate else (backend / 1000 if backend else None)
    return {
        "backend_inference_wall_ms": backend,
        "engine_total_wall_ms": engine_total,
        "engine_outside_backend_wall_ms": round(engine_total - backend, 1)
        if engine_total is not None and backend is not None else None,
        "pool_total_wall_ms": _ms(timer.handler, end),
        "engine_queue_wait_ms": _ms(timer.enqueued, timer.admitted),
        "engine_tokenize_ms": None,  # the backend tokenizes inside its own call and does not say how long
        "gpu_time_to_first_token_ms": round(prefill, 1) if prefill is not None else None,
        "gpu_generate_total_ms": generate,
        "gpu_decode_after_first_token_ms": round(decode, 1) if decode is not None else None,
        "engine_prompt_tokens": prompt,
        "engine_cached_prompt_tokens": cached,
        "engine_output_tokens": output,
        "engine_tokens_per_second": round(output / generation_s, 1) if output and generation_s else None,
        # Measured here, for streams only: what any backend's first token costs, remote ones included.
        "backend_time_to_first_token_ms": _ms(timer.sent, timer.first_token),
    }


_DECODER = json.JSONDecoder()


def usage_in(raw: bytes) -> dict[str, Any] | None:
    """The last `"usage": {...}` object in a JSON answer or the tail of an SSE stream, or None.

    Only what follows the last `"usage"` is decoded, so a long answer is not parsed a second time;
    inside a JSON string the quotes would be escaped, so the match is always a key."""
    return usage_at(raw, raw.rfind(b'"usage"'))


def usage_at(raw: bytes, at: int) -> dict[str, Any] | None:
    """The object that follows the `"usage"` key found at `at` in `raw` (-1: none found), or None."""
    if at < 0:
        return None
    text = raw[at + 7:].decode(errors="replace").lstrip()
    if not text.startswith(":"):
        return None
    try:
        value, _end = _DECODER.raw_decode(text[1:].lstrip())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
