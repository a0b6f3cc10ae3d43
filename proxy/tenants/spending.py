"""What each tenant spent in the windows its limits and budget look at, kept in memory as requests
start and end, so that a request's check costs no database query.

At start each tenant's sums are read once from the ledger (its current budget period, and the last
minute as one lump that leaves the window a minute later), so limits and budgets hold across a
restart. A request counts toward requests_per_minute when it is admitted (a burst cannot all pass
before the first ends). What it may use (its reservation: the output it may ask for and its
prompt's estimate, in tokens and cost) is held from its admission to its end, and counts toward the
token limit and the budget meanwhile; at its end the reservation is replaced by what it used. So
requests in flight together can pass a budget or a token limit by one reservation at most.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from proxy.config.settings import TenantSettings
from proxy.errors import TooManyRequests
from proxy.tenants.ledger import Ledger
from proxy.tenants.limits import MINUTE_S, Spending, period_bounds, refusal

# The minute's entries are this long each: requests within one share it, so a busy tenant's minute
# is a few hundred entries, not one per request (each a tuple for the garbage collector to walk).
# An entry leaves the window up to this much later than its first request would have.
BUCKET_S = 0.25


@dataclass
class _Window:
    period: str
    start: float = 0.0
    end: float = 0.0
    requests: int = 0
    tokens: int = 0
    cost: float = 0.0
    # What the requests in flight reserved: not bound to a period, they end in whichever comes.
    reserved_tokens: int = 0
    reserved_cost: float = 0.0
    # (time, requests, tokens) of the last minute, oldest first, and their running sums: a check
    # costs the same however many requests the minute holds.
    minute: deque[tuple[float, int, int]] = field(default_factory=deque)
    minute_requests: int = 0
    minute_tokens: int = 0

    def add(self, at: float, requests: int, tokens: int) -> None:
        self.minute_requests += requests
        self.minute_tokens += tokens
        if self.minute:
            last_at, last_requests, last_tokens = self.minute[-1]
            # In time order, which expire() relies on: a row another process wrote late joins the last.
            if at - last_at < BUCKET_S:
                self.minute[-1] = (last_at, last_requests + requests, last_tokens + tokens)
                return
        self.minute.append((at, requests, tokens))

    def expire(self, before: float) -> None:
        while self.minute and self.minute[0][0] <= before:
            _, requests, tokens = self.minute.popleft()
            self.minute_requests -= requests
            self.minute_tokens -= tokens


class Spend:
    """Each tenant's spending in its current minute and budget period, and what its requests in
    flight reserved."""

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

    def now(self, name: str, now: float) -> tuple[Spending, float | None, Spending]:
        """What the tenant's limits compare: the last minute's requests and tokens (reservations
        included), when the minute's oldest entry came (None: empty), and the period's requests,
        tokens and cost (reservations included)."""
        w = self._window(name, now)
        return (Spending(w.minute_requests, w.minute_tokens + w.reserved_tokens), w.minute[0][0] if w.minute else None,
                Spending(w.requests, w.tokens + w.reserved_tokens, w.cost + w.reserved_cost))

    def minute(self, name: str, now: float) -> tuple[Spending, float | None]:
        """The last minute's requests and tokens (reservations included), and when its oldest entry came."""
        minute, oldest, _ = self.now(name, now)
        return minute, oldest

    def period(self, name: str, now: float) -> Spending:
        return self.now(name, now)[2]

    def admit(self, tenant: TenantSettings, now: float, tokens: int, cost: float,
              counted: bool = True) -> TooManyRequests | None:
        """A request of `tenant` that would reserve `tokens` and `cost`: admitted (`started`), or the
        429 it gets (limits.refusal; nothing is counted then). Per request: the sums are compared as
        they are, and only a refusal builds what refusal() reads. `counted` False: a request admitted
        before, again for another model (a fallback), which is not one more in the minute."""
        w = self._windows[tenant.name]   # _window(), inlined: this runs for every request
        if now >= w.end:
            self._roll(tenant.name, w, now)
        if w.minute and w.minute[0][0] <= now - MINUTE_S:
            w.expire(now - MINUTE_S)
        rpm, tpm, budget_tokens, budget_cost = (tenant.requests_per_minute, tenant.tokens_per_minute,
                                                tenant.budget_tokens, tenant.budget_cost)
        held = w.reserved_tokens
        if (counted and rpm is not None and w.minute_requests >= rpm) \
                or (tpm is not None and w.minute_tokens + held >= tpm) \
                or (budget_tokens is not None and w.tokens + held >= budget_tokens) \
                or (budget_cost is not None and w.cost + w.reserved_cost >= budget_cost):
            minute, oldest, period = self.now(tenant.name, now)
            refused = refusal(tenant, minute, period, now, oldest)
            if refused is not None:
                return refused
        if counted:
            w.add(now, 1, 0)
        w.reserved_tokens += tokens
        w.reserved_cost += cost
        return None

    def started(self, name: str, now: float, tokens: int = 0, cost: float = 0.0) -> None:
        """A request of the tenant was admitted: it counts toward requests_per_minute, and `tokens`
        and `cost` are reserved until it ends (`ended` with the same reservation)."""
        window = self._window(name, now)
        window.add(now, 1, 0)
        window.reserved_tokens += tokens
        window.reserved_cost += cost

    def release(self, name: str, tokens: int, cost: float) -> None:
        """What a request reserved, given back before it ends (a fallback re-reserves at its price)."""
        window = self._windows[name]
        window.reserved_tokens = max(0, window.reserved_tokens - tokens)
        window.reserved_cost = max(0.0, window.reserved_cost - cost)

    def ended(self, name: str, now: float, tokens: int, cost: float, reserved_tokens: int = 0,
              reserved_cost: float = 0.0) -> None:
        """A request of the tenant ended, having used `tokens` (prompt and output) and `cost`; what it
        reserved at its start is released."""
        window = self._windows[name]   # the minute is expired where it is read (`admit`, `now`)
        if now >= window.end:
            self._roll(name, window, now)
        window.reserved_tokens = max(0, window.reserved_tokens - reserved_tokens)
        window.reserved_cost = max(0.0, window.reserved_cost - reserved_cost)
        window.requests += 1
        window.tokens += tokens
        window.cost += cost
        if tokens:
            window.add(now, 0, tokens)

    def recorded_elsewhere(self, rows: Iterable[tuple[str, float, int, int, float]], now: float) -> None:
        """Rows another process wrote to the ledger (a reload's predecessor): (tenant, time, requests,
        tokens, cost), counted as if this process had ended those requests."""
        for name, at, requests, tokens, cost in rows:
            window = self._windows.get(name)
            if window is None:
                continue
            window = self._window(name, now)
            if window.start <= at < window.end:
                window.requests += requests
                window.tokens += tokens
                window.cost += cost
            if at > now - MINUTE_S and tokens:
                window.add(at, 0, tokens)
