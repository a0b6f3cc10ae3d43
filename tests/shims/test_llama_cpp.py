"""The llama-cpp-python shim on the tiny GGUF: real llama.cpp, served on a loopback port."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from helpers import gauge, wait_metric
from shims.llama_cpp import LlamaCppEngine, LlamaCppOptions, flash_attn_enabled, kv_type


def test_flash_attn_and_kv_cache_type_names() -> None:
    assert flash_attn_enabled("auto", 0) is False and flash_attn_enabled("auto", -1) is True
    assert flash_attn_enabled("on", 0) is True and flash_attn_enabled("off", 99) is False
    with pytest.raises(ValueError):
        flash_attn_enabled("sometimes", 0)
    assert (kv_type(None), kv_type("f16"), kv_type("Q8_0")) == (None, 1, 8)
    with pytest.raises(ValueError, match="not one of"):
        kv_type("q9_9")


@pytest.fixture
def serve(llama_cpp_python: None, tiny_gguf: Path, shim_server: Any) -> Any:
    async def start(**options: Any) -> tuple[LlamaCppEngine, str]:
        engine = LlamaCppEngine("tiny", LlamaCppOptions(model_path=str(tiny_gguf), **options))
        return engine, await shim_server(engine)
    return start


async def test_streams_tokens_and_counts_them(serve: Any) -> None:
    _, url = await serve()
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 32, "ignore_eos": True,
            "temperature": 0}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
            events = [e for e in (await resp.text()).split("\n\n") if e]
        async with s.post(url + "/v1/chat/completions", json=body) as resp:
            whole = await resp.json()
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks[:-1]]
    assert len(deltas) >= 16 and "".join(deltas) == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 32 == whole["usage"]["completion_tokens"]


async def test_the_ggufs_own_template_renders_chat_without_a_prompt_format(serve: Any) -> None:
    engine, url = await serve()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    prompt, _ = engine.render_chat(messages, {})
    # The demo GGUF's template: <|role|>\ncontent\n per message, then <|assistant|>\n.
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\nyo\n<|user|>\nagain\n<|assistant|>\n"
    async with aiohttp.ClientSession() as s, \
            s.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4}) as resp:
        assert resp.status == 200


async def test_one_request_at_a_time_the_next_waits(serve: Any) -> None:
    _, url = await serve()
    body = {"prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        first = await s.post(url + "/v1/completions", json=body)
        assert (await first.content.readline()).startswith(b"data: ")
        second = asyncio.create_task(s.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}))
        text = await wait_metric(s, url, "vllm:num_requests_waiting", lambda v: v == 1)
        assert gauge(text, "vllm:num_requests_running") == 1
        first.close()   # the running one leaves: the waiting one gets the model
        resp = await asyncio.wait_for(second, 60)
        assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 4
        text = await wait_metric(s, url, "vllm:num_requests_running", lambda v: v == 0)
        assert gauge(text, "llm_pool_shim:requests_cancelled_total") == 1
        assert gauge(text, "vllm:generation_tokens_total") < 3000


async def test_multi_turn_formats_and_the_context_bound(serve: Any) -> None:
    _, url = await serve(prompt_format="translategemma_template", n_ctx=256)
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={"messages": turns}) as resp:
            assert resp.status == 400  # TranslateGemma takes one structured user turn
        async with s.post(url + "/v1/completions", json={"prompt": "word " * 400, "max_tokens": 4}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "context_length_exceeded"
