"""What a tenant may still spend: its per-minute limits and its budget for the period, decided from
what the ledger says it spent (so both hold across a restart), what a request costs, and what it
may cost at most (its reservation, read from its body).

Pure: the caller passes the time and the sums; nothing here reads a clock or the ledger.
"""
from __future__ import annotations

import calendar
import time
from typing import Any, Mapping, NamedTuple

from proxy.config.settings import TenantSettings
from proxy.errors import TooManyRequests

MINUTE_S = 60.0
# A reservation's output when the request names no limit of its own and engine.decoding names none.
DEFAULT_OUTPUT_TOKENS = 4096
# The most tokens a reservation counts (a body's `max_tokens` is the client's number).
MAX_RESERVED = 2 ** 31
# Where a request's output limit is, by route: OpenAI's chat and completions, the Responses API and
# Anthropic's Messages, and llm-pool's /v1/responses (`decoding.max_tokens`).
OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# Where its prompt is: chat's and Anthropic's messages and system, completions' prompt, embeddings' and
# the Responses API's input, its instructions, rerank's query and documents, infill's fields, tools.
PROMPT_FIELDS = ("messages", "prompt", "input", "system", "instructions", "query", "documents", "input_prefix",
                 "input_suffix", "content", "tools")
# Media are not text: an image's base64 says nothing of the tokens it takes.
MEDIA_FIELDS = frozenset(("image_url", "input_audio", "source", "file", "image", "audio"))
# Characters per token of a prompt's estimate: fewer than English's usual 4, so that a reservation errs
# on the side of more.
CHARS_PER_TOKEN = 3
# A body this small is its own prompt's estimate (see prompt_estimate).
SMALL_BODY = 4096


class Spending(NamedTuple):
    """What a tenant's requests used in a window (the ledger's sums, with what is reserved)."""

    requests: int = 0
    tokens: int = 0
    cost: float = 0.0


def period_bounds(period: str, now: float) -> tuple[float, float]:
    """The UTC day, week (from Monday) or month holding `now`: its start and end, unix seconds."""
    t = time.gmtime(now)
    day = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))
    if period == "day":
        return float(day), float(day + 86400)
    if period == "week":
        start = day - t.tm_wday * 86400
        return float(start), float(start + 7 * 86400)
    start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return float(start), float(calendar.timegm((year, month, 1, 0, 0, 0)))


def refusal(tenant: TenantSettings, minute: Spending, period: Spending, now: float,
            oldest_in_minute: float | None = None) -> TooManyRequests | None:
    """The 429 a new request of `tenant` gets, or None: a per-minute limit reached (`minute`: the
    last 60 s), or its budget spent (`period`: since the period began). Retry-After is when the
    window frees (the minute's oldest request leaves it) or the period ends."""
    limits = (("requests_per_minute", tenant.requests_per_minute, minute.requests),
              ("tokens_per_minute", tenant.tokens_per_minute, minute.tokens))
    for field, limit, used in limits:
        if limit is not None and used >= limit:
            frees = (oldest_in_minute + MINUTE_S - now) if oldest_in_minute is not None else MINUTE_S
            return TooManyRequests(f"tenant {tenant.name!r} has used its {field} ({used} of {limit})",
                                   code="rate_limited", retry_after=max(1.0, frees))
    budgets = (("tokens", tenant.budget_tokens, period.tokens), ("cost", tenant.budget_cost, period.cost))
    for what, budget, spent in budgets:
        if budget is not None and spent >= budget:
            end = period_bounds(tenant.budget_period, now)[1]
            return TooManyRequests(f"tenant {tenant.name!r} has spent its {tenant.budget_period}'s budget of "
                                   f"{budget} {what} ({spent:g} spent)", code="budget_exceeded",
                                   retry_after=max(1.0, end - now))
    return None


def cost(price: Mapping[str, Any] | None, prompt: int, cached: int, output: int) -> float:
    """What a request's tokens cost at the model's price_per_mtok (cached input at its own price,
    else at the input price); 0 without a price."""
    if not price:
        return 0.0
    fresh = max(0, prompt - cached)
    per_input = float(price.get("input", 0.0))
    per_cached = float(price.get("cached_input", per_input))
    return (fresh * per_input + cached * per_cached + output * float(price.get("output", 0.0))) / 1e6


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def output_limit(body: Mapping[str, Any], default: int | None) -> int:
    """The most output tokens the request may get: its own limit (times `n` choices), else `default`
    (engine.decoding.max_tokens), else DEFAULT_OUTPUT_TOKENS."""
    limit = None
    for name in OUTPUT_FIELDS:   # read on every admission: no call per field
        value = body.get(name)
        if type(value) is int and value >= 0:
            limit = value
            break
    if limit is None:
        decoding = body.get("decoding")
        limit = _count(decoding.get("max_tokens")) if isinstance(decoding, Mapping) else None
    if limit is None:
        limit = default if default is not None and default >= 0 else DEFAULT_OUTPUT_TOKENS
    choices = body.get("n")
    if type(choices) is int and choices > 1:
        limit *= min(choices, 128)
    return min(MAX_RESERVED, limit)


def prompt_estimate(body: Mapping[str, Any], size: int | None = None) -> int:
    """The prompt's tokens, estimated cheaply from the body: its text's characters / CHARS_PER_TOKEN,
    and one per token id (a prompt given as ids). No tokenizer: it is read on every admission.
    `size`: the body's length in bytes, when known; a small body's estimate is that / CHARS_PER_TOKEN,
    more than its prompt by a few tokens of JSON, with no walk through it."""
    if size is not None and 0 <= size <= SMALL_BODY:
        return size // CHARS_PER_TOKEN + 1
    chars = ids = 0
    stack: list[Any] = [body[name] for name in PROMPT_FIELDS if name in body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(v for k, v in value.items() if k not in MEDIA_FIELDS)
        elif type(value) is int:
            ids += 1
    return min(MAX_RESERVED, chars // CHARS_PER_TOKEN + ids + 1)
