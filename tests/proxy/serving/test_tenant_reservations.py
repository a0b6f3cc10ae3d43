"""Reservations (issue 39, item 7): an admitted request holds what it may use of its tenant's budget
and token limit (its max_tokens and its prompt's estimate) until it ends, so requests in flight
together pass a budget by one request's reservation at most; whatever way a request ends (answered,
failed, its client gone), what it held is released and replaced by what it used.

Real HTTP on both sides: the proxy's routes with tenants and a real SQLite ledger (tests/in_process.py)
in front of FakeProvider (tests/fakes.py), held until every request was admitted or refused."""
from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fakes import FakeProvider
from in_process import tenant_proxy
from metered import PROVIDER_KEY
from proxy.tenants.limits import output_limit, prompt_estimate

KEY = "sk-tenant-SECRET-71"
GUARD = aiohttp.ClientTimeout(total=30)
BODY = {"model": "r", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 50}
RESERVATION = prompt_estimate(BODY) + output_limit(BODY, None)
# Each answer uses all it reserved: the worst case for a budget.
USED = {"prompt_tokens": RESERVATION - 50, "completion_tokens": 50}
BUDGET = RESERVATION + RESERVATION // 2     # room for one request, not two


@pytest.fixture
def provider(provider: FakeProvider) -> FakeProvider:
    provider.usage = USED   # the conftest's stand-in, answering every request with this usage
    return provider


async def post(client: aiohttp.ClientSession, url: str, **fields: Any) -> tuple[int, Any]:
    async with client.post(url + "/v1/chat/completions", json={**BODY, **fields},
                           headers={"Authorization": f"Bearer {KEY}", "X-Allow-Remote": "true"}) as resp:
        return resp.status, await resp.json()


async def until(condition: Any) -> None:
    async with asyncio.timeout(GUARD.total):   # a hang guard only
        while not condition():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("budget", [{"tokens": BUDGET}, {"cost": BUDGET * 1.0 / 1e6}], ids=["tokens", "cost"])
async def test_8_concurrent_requests_on_a_budget_with_room_for_one_pass_it_by_one_reservation_at_most(
        tmp_path: Path, provider: FakeProvider, stack: contextlib.AsyncExitStack, budget: dict[str, Any]) -> None:
    # price: 1 per token per million, so that the cost budget is the token budget in millionths.
    url, tenancy, _ = await tenant_proxy(stack, tmp_path, provider.url, PROVIDER_KEY,
                                         {"t": {"key": KEY, "budget": budget}},
                                         {"price_per_mtok": {"input": 1.0, "output": 1.0}})
    provider.hold()
    async with aiohttp.ClientSession(timeout=GUARD) as client:
        sent = [asyncio.create_task(post(client, url)) for _ in range(8)]
        # Every request is either at the provider (admitted) or answered (refused) before any ends.
        await until(lambda: provider.held + sum(t.done() for t in sent) == 8)
        provider.release()
        answers = await asyncio.gather(*sent)
    statuses = sorted(status for status, _ in answers)
    assert statuses.count(200) >= 1
    assert all(body["error"]["code"] == "budget_exceeded" for status, body in answers if status == 429)
    assert set(statuses) <= {200, 429}
    await asyncio.to_thread(tenancy.ledger.flush)
    (row,) = tenancy.ledger.usage(None, None, ["tenant"])
    spent = row["prompt_tokens"] + row["output_tokens"]
    assert spent == statuses.count(200) * RESERVATION
    assert spent <= BUDGET + RESERVATION
    # Nothing is left reserved: the tenant's sums are what the ledger holds.
    assert tenancy.spend.period("t", time.time()).tokens == spent


async def test_a_token_limit_counts_the_reservations_of_requests_in_flight(
        tmp_path: Path, provider: FakeProvider, stack: contextlib.AsyncExitStack) -> None:
    url, _, _ = await tenant_proxy(stack, tmp_path, provider.url, PROVIDER_KEY,
                                   {"t": {"key": KEY, "limits": {"tokens_per_minute": BUDGET}}})
    provider.hold()
    async with aiohttp.ClientSession(timeout=GUARD) as client:
        sent = [asyncio.create_task(post(client, url)) for _ in range(8)]
        await until(lambda: provider.held + sum(t.done() for t in sent) == 8)
        provider.release()
        statuses = sorted(status for status, _ in await asyncio.gather(*sent))
    assert statuses == [200] * 2 + [429] * 6   # the second passed the limit by less than its reservation


def test_a_reservation_is_the_bodys_output_limit_or_the_default_and_the_prompts_estimate() -> None:
    assert output_limit({}, None) > 1000 and output_limit({}, 64) == 64
    assert output_limit({"max_completion_tokens": 9, "n": 2}, 64) == 18
    assert output_limit({"max_output_tokens": 7}, 64) == output_limit({"decoding": {"max_tokens": 7}}, 64) == 7
    assert output_limit({"max_tokens": 10 ** 40}, 64) == 2 ** 31
    assert output_limit({"max_tokens": -1}, 64) == output_limit({"max_tokens": "9"}, 64) == 64
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 9000}}
    # The text's characters / 3 (and its parts' type names); an image's base64 is not text.
    assert 100 < prompt_estimate({"messages": [{"content": [image, {"type": "text", "text": "x" * 300}]}]}) < 110
    assert prompt_estimate({"prompt": [[1, 2, 3], [4]]}) == 5


@pytest.mark.parametrize("ending", ["provider_error", "client_gone"])
async def test_a_reservation_is_released_whatever_way_the_request_ends(
        tmp_path: Path, provider: FakeProvider, stack: contextlib.AsyncExitStack, ending: str) -> None:
    url, tenancy, _ = await tenant_proxy(stack, tmp_path, provider.url, PROVIDER_KEY,
                                         {"t": {"key": KEY, "budget": {"tokens": BUDGET}}},
                                         {"remote_max_retries": 0}, handler_cancellation=True)
    async with aiohttp.ClientSession(timeout=GUARD) as client:
        if ending == "provider_error":
            provider.script("theirs", "500")
            status, _ = await post(client, url)
            assert status >= 500
        else:
            provider.hold()
            leaving = asyncio.create_task(post(client, url))
            await until(lambda: provider.held == 1)
            leaving.cancel()   # the client hangs up while the provider works
            await asyncio.gather(leaving, return_exceptions=True)
            await until(lambda: tenancy.ledger.usage(None, None, ["tenant"]))
            provider.release()
        # Nothing used, nothing held: the whole budget is there for the next requests, one by one.
        assert tenancy.spend.period("t", time.time()).tokens == 0
        provider.usage = {"prompt_tokens": 1, "completion_tokens": 1}
        assert [(await post(client, url))[0] for _ in range(3)] == [200] * 3
