"""What a tenant may still spend: its per-minute limits and its budget for the period, decided from
what the ledger says it spent (so both hold across a restart), and what a request costs.

Pure: the caller passes the time and the sums; nothing here reads a clock or the ledger.
"""
from __future__ import annotations

import calendar
import time
from dataclasses import dataclass
from typing import Any, Mapping

from proxy.config.settings import TenantSettings
from proxy.errors import TooManyRequests

MINUTE_S = 60.0


@dataclass(frozen=True)
class Spending:
    """What a tenant's finished requests used in a window (the ledger's sums)."""

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
