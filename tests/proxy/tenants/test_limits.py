"""What a tenant may still spend: per-minute limits, the budget's period and what a request costs,
decided from sums (pure), and the sums kept in memory against a real ledger file."""
from __future__ import annotations

import calendar
from pathlib import Path

import pytest

from proxy.config.settings import TenantSettings
from proxy.tenants.ledger import SqliteLedger, UsageRow
from proxy.tenants.limits import Spending, cost, period_bounds, refusal
from proxy.tenants.spending import Spend

# Wednesday 2026-12-02 10:30 UTC.
NOW = calendar.timegm((2026, 12, 2, 10, 30, 0))


def tenant(**fields: object) -> TenantSettings:
    return TenantSettings(name="t", fairness_key="t", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("period, start, end", [
    ("day", (2026, 12, 2), (2026, 12, 3)), ("week", (2026, 11, 30), (2026, 12, 7)),
    ("month", (2026, 12, 1), (2027, 1, 1)),
])
def test_a_period_is_the_utc_day_week_from_monday_or_month(period: str, start: tuple[int, int, int],
                                                           end: tuple[int, int, int]) -> None:
    assert period_bounds(period, NOW) == (calendar.timegm((*start, 0, 0, 0)), calendar.timegm((*end, 0, 0, 0)))


def test_a_limit_reached_refuses_until_the_minutes_oldest_request_leaves() -> None:
    limited = tenant(requests_per_minute=3, tokens_per_minute=100)
    assert refusal(limited, Spending(2, 99), Spending(), NOW) is None
    refused = refusal(limited, Spending(3, 0), Spending(), NOW, oldest_in_minute=NOW - 45)
    assert refused is not None and (refused.status, refused.code) == (429, "rate_limited")
    assert refused.headers() == {"Retry-After": "15"}
    assert refusal(limited, Spending(0, 100), Spending(), NOW).code == "rate_limited"  # type: ignore[union-attr]


def test_a_spent_budget_refuses_until_the_period_ends() -> None:
    daily = tenant(budget_period="day", budget_tokens=1000, budget_cost=5.0)
    assert refusal(daily, Spending(), Spending(10, 999, 4.99), NOW) is None
    for spent in (Spending(10, 1000, 0.0), Spending(10, 0, 5.0)):
        refused = refusal(daily, Spending(), spent, NOW)
        assert refused is not None and refused.code == "budget_exceeded"
        assert refused.headers() == {"Retry-After": str(13 * 3600 + 30 * 60)}


def test_a_requests_cost_prices_cached_input_apart() -> None:
    price = {"input": 3.0, "cached_input": 0.3, "output": 15.0}
    assert cost(price, prompt=1_000_000, cached=500_000, output=100_000) == pytest.approx(1.5 + 0.15 + 1.5)
    assert cost({"input": 2.0}, 10, 5, 7) == pytest.approx(20 / 1e6)   # cached at the input price
    assert cost(None, 10, 0, 10) == 0.0


def test_spending_is_kept_in_memory_and_read_back_from_the_ledger_after_a_restart(tmp_path: Path) -> None:
    tenants = {"t": tenant(requests_per_minute=2, budget_period="day")}
    ledger = SqliteLedger(tmp_path / "usage.sqlite3")
    spend = Spend(tenants, ledger, NOW)
    spend.started("t", NOW)
    spend.started("t", NOW + 1)
    assert spend.minute("t", NOW + 2) == (Spending(2, 0), NOW)
    assert spend.minute("t", NOW + 60.5) == (Spending(1, 0), NOW + 1)   # the first left the window
    spend.ended("t", NOW + 61, tokens=30, cost=0.5)
    assert spend.period("t", NOW + 61) == Spending(1, 30, 0.5)
    for at in (NOW - 86400, NOW - 30):   # yesterday's row is not today's budget; the other is
        ledger.record(UsageRow(time=at, tenant="t", key_id="k", model="m", backend="sim", host="local",
                               status=200, prompt_tokens=10, cached_tokens=0, output_tokens=20, cost=0.25,
                               queue_wait_ms=0.0, duration_ms=1.0))
    ledger.close()
    reopened = SqliteLedger(tmp_path / "usage.sqlite3")
    try:
        again = Spend(tenants, reopened, NOW)
        assert again.period("t", NOW) == Spending(1, 30, 0.25)
        assert again.minute("t", NOW)[0] == Spending(1, 30)      # the last minute, as one lump
        assert again.period("t", NOW + 86400) == Spending()      # a new day: nothing spent yet
    finally:
        reopened.close()
