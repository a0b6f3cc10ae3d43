"""The simulated engine, served for real on a loopback port by the shared shim core."""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from shims.sim import SimEngine, SimParams, build_app


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    servers: list[TestServer] = []

    async def start(**params: Any) -> tuple[SimEngine, str]:
        engine = SimEngine("sim", SimParams(**params))
        # handler_cancellation as in production: a client that leaves cancels its generation.
        server = TestServer(build_app(engine), handler_cancellation=True)
        await server.start_server()
        servers.append(server)
        return engine, str(server.make_url(""))

    yield start
    for server in servers:
        await server.close()


async def until(predicate: Any, timeout: float = 30.0) -> None:
    """Wait for a condition, bounded: a broken engine fails the test instead of hanging it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def chat(max_tokens: int, stream: bool = False, content: str = "hello") -> dict[str, Any]:
    return {"model": "sim", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream}


async def test_completion_has_the_openai_shape_and_usage(serve: Any) -> None:
    _, url = await serve(decode_tokens_per_s=1000, ttft_ms=0)
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=chat(5)) as resp:
        body = await resp.json()
    assert resp.status == 200
    assert body["object"] == "chat.completion" and body["model"] == "sim"
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"


async def test_stream_sends_one_event_per_token_then_usage(serve: Any) -> None:
    _, url = await serve(decode_tokens_per_s=1000, ttft_ms=0)
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=chat(6, True)) as resp:
        lines = [line for line in (await resp.text()).split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == 6
    assert chunks[-1]["usage"]["completion_tokens"] == 6


async def test_continuous_batching_is_bounded_and_reported_under_vllm_names(serve: Any) -> None:
    engine, url = await serve(max_seqs=2, decode_tokens_per_s=20, ttft_ms=0)
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(s.post(url + "/v1/chat/completions", json=chat(1000))) for _ in range(5)]
        await until(lambda: len(engine.running) + len(engine.waiting) == 5)
        async with s.get(url + "/metrics") as resp:
            text = await resp.text()
        assert 'vllm:num_requests_running{model_name="sim"} 2' in text
        assert 'vllm:num_requests_waiting{model_name="sim"} 3' in text
        assert "vllm:kv_cache_usage_perc" in text
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await until(lambda: not engine.running and not engine.waiting)  # each client leaving is noticed


async def test_prefix_cache_hits_on_a_repeated_prompt(serve: Any) -> None:
    engine, url = await serve(decode_tokens_per_s=1000, ttft_ms=0)
    prompt = "a long shared system prompt " * 40
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(url + "/v1/chat/completions", json=chat(1, content=prompt)) as resp:
                assert resp.status == 200
    assert engine.counters["cached_prompt_tokens"] >= 16 * (len(prompt) // 64 - 1)


async def test_faults_fail_requests_with_an_error(serve: Any) -> None:
    _, url = await serve(decode_tokens_per_s=1000, ttft_ms=0, fault_rate=1.0, seed=1)
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=chat(3)) as resp:
            assert resp.status == 500 and (await resp.json())["error"]["code"] == "engine_fault"
        async with s.post(url + "/v1/chat/completions", json=chat(50, True)) as resp:
            text = await resp.text()
    assert "event: error" in text and "[DONE]" not in text


async def test_per_token_latency_grows_with_the_batch() -> None:
    engine = SimEngine("sim", SimParams(decode_tokens_per_s=100, batch_slowdown=0.5))
    assert engine._step_seconds() == pytest.approx(0.01)
    engine.decoding.update(object() for _ in range(5))  # type: ignore[misc]
    assert engine._step_seconds() == pytest.approx(0.01 * (1 + 0.5 * 4))


async def test_wrong_model_and_bad_body_are_openai_errors(serve: Any) -> None:
    _, url = await serve()
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={**chat(1), "model": "other"}) as resp:
            assert resp.status == 404
        async with s.post(url + "/v1/chat/completions", json={"model": "sim", "messages": []}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_request"
        async with s.get(url + "/health") as resp:
            assert resp.status == 200
        async with s.get(url + "/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["sim"]
