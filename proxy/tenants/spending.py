"""What each tenant spent in the windows its limits and budget look at, kept in memory as requests
start and end, so that a request's check costs no database query.

At start each tenant's sums are read once from the ledger (its current budget period, and the last
minute as one lump that leaves the window a minute later), so limits and budgets hold across a
restart. A request counts toward requests_per_minute when it is admitted (a burst cannot all pass
before the first ends) and toward the token limit and the budget when it ends, with what it used.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from proxy.config.settings import TenantSettings
from proxy.tenants.ledger import Ledger
from proxy.tenants.limits import MINUTE_S, Spending, period_bounds


@dataclass
class _Window:
    period: str
    start: float = 0.0
    end: float = 0.0
    requests: int = 0
    tokens: int = 0
    cost: float = 0.0
    # (time, requests, tokens) of the last minute, oldest first, and their running sums: a check
    # costs the same however many requests the minute holds.
    minute: deque[tuple[float, int, int]] = field(default_factory=deque)
    minute_requests: int = 0
    minute_tokens: int = 0

    def add(self, at: float, requests: int, tokens: int) -> None:
        self.minute.append((at, requests, tokens))
        self.minute_requests += requests
        self.minute_tokens += tokens

    def expire(self, before: float) -> None:
        while self.minute and self.minute[0][0] <= before:
            _, requests, tokens = self.minute.popleft()
            self.minute_requests -= requests
            self.minute_tokens -= tokens


class Spend:
    """Each tenant's spending in its current minute and budget period."""

    def __init__(self, tenants: Mapping[str, TenantSettings], ledger: Ledger, now: float) -> None:
        self.ledger = ledger
        self._windows = {name: _Window(t.budget_period) for name, t in tenants.items()}
        for name, window in self._windows.items():
            self._roll(name, window, now)
            recent = ledger.spent(name, now - MINUTE_S)
            if recent.requests or recent.tokens:
                window.add(now, recent.requests, recent.tokens)

    def _roll(self, name: str, window: _Window, now: float) -> None:
        """Into the period holding `now`: its sums from the ledger (0 for one just begun)."""
        window.start, window.end = period_bounds(window.period, now)
        spent = self.ledger.spent(name, window.start)
        window.requests, window.tokens, window.cost = spent.requests, spent.tokens, spent.cost

    def _window(self, name: str, now: float) -> _Window:
        window = self._windows[name]
        if now >= window.end:
            self._roll(name, window, now)
        window.expire(now - MINUTE_S)
        return window

    def minute(self, name: str, now: float) -> tuple[Spending, float | None]:
        """The last minute's requests and tokens, and when its oldest entry came (None: empty)."""
        window = self._window(name, now)
        return Spending(window.minute_requests, window.minute_tokens), (window.minute[0][0] if window.minute else None)

    def period(self, name: str, now: float) -> Spending:
        window = self._window(name, now)
        return Spending(window.requests, window.tokens, window.cost)

    def started(self, name: str, now: float) -> None:
        """A request of the tenant was admitted: it counts toward requests_per_minute."""
        self._window(name, now).add(now, 1, 0)

    def ended(self, name: str, now: float, tokens: int, cost: float) -> None:
        """A request of the tenant ended, having used `tokens` (prompt and output) and `cost`."""
        window = self._window(name, now)
        window.requests += 1
        window.tokens += tokens
        window.cost += cost
        if tokens:
            window.add(now, 0, tokens)
