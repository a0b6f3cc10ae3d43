"""A stream that ends early is charged for what it relayed (issue 39, item 2): the client left, its
handler was cancelled, or the backend broke off. The events that went out are counted, the prompt
is the engine's figure or an estimate (USAGE_ESTIMATED). Against the FAKE provider (tests/fakes.py),
which never sends usage unless asked, with the tenants' real ledger."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from metered import Metered, content_of, metered_pool

PROMPT = "tell me a long story, please. " * 20   # 600 characters: the provider counts 151 tokens
PROVIDER_PROMPT = len(PROMPT) // 4 + 1
WORDS = 40


async def read_words(metered: Metered, path: str, body: dict[str, Any], stop_after: int | None) -> int:
    """Stream `body` to `path` and read its words; hang up once `stop_after` came. The words read."""
    got = 0
    async with metered.client.post(metered.url + path, json=body, headers=metered.headers()) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if path == "/v1/chat/completions":
                got += bool(content_of(data))
            elif chunk.get("type") in ("content_block_delta", "response.output_text.delta"):
                got += 1
            if got == stop_after:
                resp.close()   # the client hangs up mid-answer
                break
    return got


async def test_a_hundred_streams_thirty_cut_short_are_charged_within_five_percent(tmp_path: Path) -> None:
    # The acceptance test of issue 39: the ledger's tokens against what the clients received.
    async with metered_pool(tmp_path) as metered:
        metered.provider.words = [f" w{i}" for i in range(WORDS)]
        cut = {i: 3 + (i * 7) % 30 for i in range(100) if i % 10 in (1, 4, 7)}   # 30 streams, 3 to 32 words
        received = 0
        for i in range(100):
            metered.provider.script("gpt-fake", f"hold:{cut[i]}" if i in cut else "ok")
            got = await read_words(metered, "/v1/chat/completions", metered.chat(PROMPT), cut.get(i))
            assert got == cut.get(i, WORDS)
            received += got
        await metered.until_finished(100)
        row = metered.ledger()
        assert row["requests"] == 100
        assert abs(row["output_tokens"] - received) <= 0.05 * received, (row["output_tokens"], received)
        assert abs(row["prompt_tokens"] - 100 * PROVIDER_PROMPT) <= 0.05 * 100 * PROVIDER_PROMPT
        # The cut ones' prompts are the proxy's estimate, and say so; the others are the provider's.
        assert sum(1 for _path, _usage, estimated in metered.seen if estimated) == 30


async def test_a_stream_the_backend_broke_off_is_charged_for_what_went_out(tmp_path: Path) -> None:
    async with metered_pool(tmp_path) as metered:
        metered.provider.script("gpt-fake", "broken")   # one word, then its connection drops
        async with metered.client.post(metered.url + "/v1/chat/completions", json=metered.chat(PROMPT),
                                       headers=metered.headers()) as resp:
            raw = await resp.read()
        assert b'"error"' in raw   # the client was told
        await metered.until_finished(1)
        _path, usage, estimated = metered.seen[-1]
        assert usage is not None and usage[2] == 1 and estimated is True
        assert abs(usage[0] - PROVIDER_PROMPT) <= 1
        assert metered.ledger()["output_tokens"] == 1


async def test_translated_streams_cut_short_are_charged_for_what_went_out(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    # /v1/messages and /v1/responses to a provider are chat streams translated by the proxy.
    caplog.set_level(logging.WARNING)
    async with metered_pool(tmp_path) as metered:
        metered.provider.words = [f" w{i}" for i in range(WORDS)]
        bodies = {"/v1/messages": {"model": "r", "max_tokens": 64, "stream": True,
                                   "messages": [{"role": "user", "content": PROMPT}]},
                  "/v1/responses": {"model": "r", "input": PROMPT, "stream": True}}
        for n, (path, body) in enumerate(bodies.items(), start=1):
            metered.provider.script("gpt-fake", "hold:7")
            assert await read_words(metered, path, body, 7) == 7
            await metered.until_finished(n)
            seen_path, usage, estimated = metered.seen[-1]
            assert seen_path == path and usage is not None and usage[2] == 7 and estimated is True
            assert abs(usage[0] - PROVIDER_PROMPT) <= 0.05 * PROVIDER_PROMPT
        assert metered.ledger()["output_tokens"] == 14
    # A client that leaves is no error of the pool's: nothing in its log (issue 43).
    assert [r.getMessage() for r in caplog.records if r.name.startswith(("proxy", "aiohttp"))] == []


async def test_a_translated_stream_the_backend_refused_is_charged_nothing(tmp_path: Path) -> None:
    async with metered_pool(tmp_path) as metered:
        metered.provider.script("gpt-fake", "400")   # refused before any answer: nothing ran
        body = {"model": "r", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
        async with metered.client.post(metered.url + "/v1/messages", json=body, headers=metered.headers()) as resp:
            assert b"error" in await resp.read()
        await metered.until_finished(1)
        row = metered.ledger()
        assert (row["prompt_tokens"], row["output_tokens"]) == (0, 0)
