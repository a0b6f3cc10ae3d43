"""The shim core's own rules, on a real loopback server with a scripted FAKE engine (tests/fakes.py)."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from fakes import GatedEngine
from helpers import until_healthy as until_ready
from shims.core import StopMatcher


@pytest.fixture
def serve(shim_server: Any) -> Any:
    async def start(engine: GatedEngine) -> str:
        return await shim_server(engine, healthy=False)
    return start


def body(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 50, "stream": stream, **extra}


async def test_health_is_503_while_loading_and_200_once_loaded(serve: Any) -> None:
    engine = GatedEngine(["a"])
    url = await serve(engine)
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health") as resp:
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "model_loading"
        async with s.post(url + "/v1/completions", json=body()) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        engine.release.set()
        await until_ready(s, url)
        async with s.post(url + "/v1/completions", json=body()) as resp:
            assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "a"


async def test_a_failed_load_is_reported_by_health(serve: Any) -> None:
    engine = GatedEngine(["a"], load_error="no such weights")
    engine.release.set()
    url = await serve(engine)
    async with aiohttp.ClientSession() as s:
        for _ in range(500):
            async with s.get(url + "/health") as resp:
                payload = await resp.json()
            if payload["error"]["code"] != "model_loading":
                break
            await asyncio.sleep(0.01)
    assert resp.status == 503 and payload["error"]["code"] == "model_load_failed"
    assert "no such weights" in payload["error"]["message"]


async def test_a_stop_string_split_across_pieces_ends_the_text_and_the_generation(serve: Any) -> None:
    engine = GatedEngine(["Hel", "lo <", "|im_", "end|> more", " never"])
    engine.release.set()
    url = await serve(engine)
    async with aiohttp.ClientSession() as s:
        await until_ready(s, url)
        async with s.post(url + "/v1/completions", json=body(stop=["<|im_end|>"])) as resp:
            out = await resp.json()
    assert out["choices"][0]["text"] == "Hello " and out["choices"][0]["finish_reason"] == "stop"
    assert engine.generated == 4 and engine.closed == 1   # the engine was stopped, not drained


def test_stop_matcher_holds_back_only_a_possible_stop_prefix() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.feed("ab<") == ("ab", False)
    assert matcher.feed("x") == ("<x", False)
    assert matcher.feed("</") == ("", False)
    assert matcher.feed("s>tail") == ("", True)
    assert StopMatcher([]).feed("</s>") == ("</s>", False)


async def test_engine_errors_are_openai_errors_before_and_an_sse_event_after_the_stream_began(serve: Any) -> None:
    engine = GatedEngine(["a", "b", "c"], fail_after=0)
    engine.release.set()
    url = await serve(engine)
    async with aiohttp.ClientSession() as s:
        await until_ready(s, url)
        async with s.post(url + "/v1/completions", json=body(stream=True)) as resp:
            assert resp.status == 500
            assert set((await resp.json())["error"]) == {"message", "type", "code", "param"}
        engine.fail_after = 2
        async with s.post(url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as resp:
            assert resp.status == 200
            text = await resp.text()
    events = [e for e in text.split("\n\n") if e]
    assert [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:2]] == ["a", "b"]
    assert events[2].startswith("event: error\ndata: ")
    assert json.loads(events[2].split("data: ", 1)[1])["error"]["code"] == "engine_fault"
    assert "[DONE]" not in text
