"""A provider's usage is untrusted input (issue 39, item 3): a figure that is no count of tokens
(10**30, NaN, Infinity, negative, a float, a string, a bool) is taken as 0, the client gets its
answer, and the usage ledger's writer goes on writing; a ledger that cannot write makes /ready 503
and an event, and writes what it kept once it can.

Real HTTP on both sides: the proxy's routes with tenants and a real SQLite ledger (tests/in_process.py)
in front of FakeProvider (tests/fakes.py), a stand-in that sends whatever `usage` the test gives it."""
from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fakes import FakeProvider
from in_process import tenant_proxy
from metered import PROVIDER_KEY
from proxy.events import LEDGER
from proxy.serving.tenancy import LEDGER_FILE, WATCH_S
from proxy.tenants import schema

KEY = "sk-tenant-SECRET-31"
GUARD = aiohttp.ClientTimeout(total=30)
HOSTILE = [
    {"prompt_tokens": 10 ** 30, "completion_tokens": 5},
    {"prompt_tokens": float("nan"), "completion_tokens": 5},
    {"prompt_tokens": float("inf"), "completion_tokens": float("-inf")},
    {"prompt_tokens": -3, "completion_tokens": 5},
    {"prompt_tokens": 2.5, "completion_tokens": 5},
    {"prompt_tokens": "12", "completion_tokens": 5},
    {"prompt_tokens": True, "completion_tokens": 5},
    {"prompt_tokens": 7, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 10 ** 30}},
    {"prompt_tokens": [1], "completion_tokens": {"n": 5}},
]


async def chat(client: aiohttp.ClientSession, url: str, stream: bool) -> tuple[int, bytes]:
    body = {"model": "r", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": stream,
            "stream_options": {"include_usage": True}}
    async with client.post(url + "/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {KEY}", "X-Allow-Remote": "true"}) as resp:
        return resp.status, await resp.read()


def rows(path: Path) -> list[tuple[int, int, int]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT prompt_tokens, cached_tokens, output_tokens FROM usage ORDER BY id").fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_providers_usage_that_is_no_count_is_0_and_every_row_reaches_the_ledger(
        tmp_path: Path, provider: FakeProvider, stack: contextlib.AsyncExitStack, stream: bool) -> None:
    url, tenancy, _ = await tenant_proxy(stack, tmp_path, provider.url, PROVIDER_KEY,
                                         {"t": {"key": KEY, "budget": {"tokens": 10 ** 6}}})
    async with aiohttp.ClientSession(timeout=GUARD) as client:
        for usage in HOSTILE:
            provider.usage = usage
            status, body = await chat(client, url, stream)
            assert status == 200, (usage, body)
            assert (b"[DONE]" in body) if stream else json.loads(body)["choices"]
            # Written now: a row of its own (the ledger sums the requests of a second into one row).
            await asyncio.to_thread(tenancy.ledger.flush)
        provider.usage = {"prompt_tokens": 7, "completion_tokens": 5}   # a sane one after them all
        assert (await chat(client, url, stream))[0] == 200
    await asyncio.to_thread(tenancy.ledger.flush)   # raised when the writer had died
    written = rows(tmp_path / LEDGER_FILE)
    assert len(written) == len(HOSTILE) + 1
    if stream:
        # A stream's bad figure is replaced by the relay's estimate (proxy/serving/stream_usage.py):
        # "hi" is about 1 token, and the output is the events that went out.
        assert written[0] == (1, 0, 5) and written[2][0] == 1 and written[2][2] >= 5 and written[7] == (7, 0, 5)
    else:
        assert written[0] == (0, 0, 5) and written[2] == (0, 0, 0) and written[7] == (7, 0, 5)
    assert written[-1] == (7, 0, 5)
    assert all(0 <= n <= 2 ** 31 for row in written for n in row)
    assert tenancy.ledger.failing() is None
    # The tenant's budget counts what the ledger holds, not 10**30.
    assert tenancy.spend.period("t", time.time()).tokens == sum(p + o for p, _, o in written)


async def test_a_ledger_that_cannot_write_makes_ready_503_and_an_event_and_keeps_its_rows(
        tmp_path: Path, provider: FakeProvider, stack: contextlib.AsyncExitStack,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema, "BUSY_TIMEOUT_S", 0.05)   # a locked file fails its writer at once
    url, tenancy, pool = await tenant_proxy(stack, tmp_path, provider.url, PROVIDER_KEY, {"t": {"key": KEY}})
    watch = asyncio.create_task(tenancy.watch(pool.events))
    stack.push_async_callback(asyncio.gather, watch, return_exceptions=True)
    stack.callback(watch.cancel)
    # Another process holds the file's write lock (a backup, a stuck admin shell).
    locker = sqlite3.connect(tmp_path / LEDGER_FILE, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")
    async with aiohttp.ClientSession(timeout=GUARD) as client:
        assert (await chat(client, url, False))[0] == 200   # served all the same

        async def ready() -> tuple[int, Any]:
            async with client.get(url + "/ready") as resp:
                return resp.status, await resp.json()

        deadline = time.monotonic() + 30
        while tenancy.ledger.failing() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        status, body = await ready()
        assert (status, body["status"]) == (503, "ledger_failing"), body
        assert "cannot be written" in body["reason"] and "1 row(s) wait in memory" in body["reason"]
        while not pool.events.since(kinds=frozenset({LEDGER})) and time.monotonic() < deadline:
            await asyncio.sleep(WATCH_S / 10)
        (failed,) = pool.events.since(kinds=frozenset({LEDGER}))
        assert failed.reason == "failed" and "cannot be written" in failed.message
        locker.execute("COMMIT")
        await asyncio.to_thread(tenancy.ledger.flush)   # the kept row, written once the file takes it
        assert len(rows(tmp_path / LEDGER_FILE)) == 1
        assert (await ready())[0] == 200
        while len(pool.events.since(kinds=frozenset({LEDGER}))) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(WATCH_S / 10)
        assert [e.reason for e in pool.events.since(kinds=frozenset({LEDGER}))] == ["failed", "recovered"]
    locker.close()
