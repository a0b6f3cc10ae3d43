"""The CTranslate2 shim on the tiny random-weight models, real CT2 served on a loopback port."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fakes import FakeCT2Generator
from helpers import gauge, metrics, wait_metric
from shims.ct2 import CT2Engine, CT2Options, model_kind

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def serve(tiny_ct2: dict[str, Path], shim_server: Any) -> Any:
    async def start(kind: str = "decoder", **options: Any) -> tuple[CT2Engine, str]:
        engine = CT2Engine("tiny", CT2Options(model_path=str(tiny_ct2[kind]), **options))
        return engine, await shim_server(engine)
    return start


def test_the_model_folder_chooses_generator_or_translator(tiny_ct2: dict[str, Path], tmp_path: Path) -> None:
    assert model_kind(tiny_ct2["decoder"]) == "generator"
    assert model_kind(tiny_ct2["seq2seq"]) == "translator"
    with pytest.raises(ValueError, match="not a CTranslate2 model folder"):
        model_kind(tmp_path)


async def test_stream_sends_tokens_as_made_and_matches_the_whole_answer(serve: Any) -> None:
    _, url = await serve()
    body = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 24, "ignore_eos": True,
            "temperature": 0}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
            events = [e for e in (await resp.text()).split("\n\n") if e]
        async with s.post(url + "/v1/chat/completions", json=body) as resp:
            whole = (await resp.json())["choices"][0]["message"]["content"]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks[:-1]]
    # One event per token whose text is complete (a token holding half a UTF-8 character waits).
    assert len(deltas) >= 12 and all(deltas)
    assert "".join(deltas) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 24


async def test_prompt_format_renders_chat_and_counts_the_rendered_prompt(serve: Any) -> None:
    engine, url = await serve(prompt_format="qwen3_template")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    async with aiohttp.ClientSession() as s, \
            s.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}) as resp:
        out = await resp.json()
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert out["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(rendered).ids)


async def test_single_turn_only_and_text_only(serve: Any) -> None:
    _, url = await serve()
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    async with aiohttp.ClientSession() as s:
        for messages, code in ((turns, "multi_turn_unsupported"), (image, "modality_unsupported")):
            async with s.post(url + "/v1/chat/completions", json={"messages": messages}) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["code"] == code


async def test_beam_size_is_honoured(serve: Any, tiny_ct2: dict[str, Path]) -> None:
    import ctranslate2

    engine, url = await serve()
    tokens = engine.tokenizer.encode("the weather is").tokens
    direct = ctranslate2.Generator(str(tiny_ct2["decoder"]), compute_type="int8")
    expected = {beam: engine.tokenizer.decode(direct.generate_batch(
        [tokens], max_length=12, beam_size=beam, include_prompt_in_result=False)[0].sequences_ids[0])
        for beam in (1, 4)}
    async with aiohttp.ClientSession() as s:
        for beam in (1, 4):
            async with s.post(url + "/v1/completions", json={"prompt": "the weather is", "max_tokens": 12,
                                                             "beam_size": beam, "temperature": 0}) as resp:
                assert (await resp.json())["choices"][0]["text"] == expected[beam]


@pytest.mark.parametrize("beam", [1, 4])
async def test_an_answer_ending_inside_a_character_keeps_its_last_bytes(serve: Any, beam: int) -> None:
    engine, url = await serve()
    # Byte-level tokens: a snowman whole, then one cut after two of its three bytes, at the very end.
    ids = engine.tokenizer.encode("snow \u2603 ok \u2603", add_special_tokens=False).ids[:-1]
    expected = engine.tokenizer.decode(ids)
    assert expected == "snow \u2603 ok \ufffd"   # what the library makes of the incomplete bytes
    engine.model = FakeCT2Generator(ids)
    body = {"prompt": "x", "max_tokens": len(ids), "beam_size": beam}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=body) as resp:
            whole = await resp.json()
        async with s.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
            events = [json.loads(e[6:]) for e in (await resp.text()).split("\n\n") if e and e != "data: [DONE]"]
    assert whole["choices"][0]["text"] == expected
    assert whole["usage"]["completion_tokens"] == len(ids)
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    assert events[-1]["usage"]["completion_tokens"] == len(ids)


async def test_concurrent_requests_run_together(serve: Any) -> None:
    _, url = await serve(max_concurrency=2)
    body = {"prompt": "hello", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        streams = [await s.post(url + "/v1/completions", json=body) for _ in range(2)]
        # Both decode at once (two CT2 workers): each stream keeps getting tokens while the other,
        # far from done, runs too. Serialized, the second would get nothing until the first ended.
        for _ in range(20):
            for resp in streams:
                line = await asyncio.wait_for(resp.content.readline(), 60)
                assert line.startswith(b"data: ")
                await asyncio.wait_for(resp.content.readline(), 60)
        text = await wait_metric(s, url, "vllm:num_requests_running", lambda v: v == 2)
        assert gauge(text, "vllm:num_requests_waiting") == 0
        for resp in streams:
            resp.close()
        await wait_metric(s, url, "vllm:num_requests_running", lambda v: v == 0)


async def test_a_client_that_leaves_stops_the_decoding(serve: Any) -> None:
    _, url = await serve()
    body = {"prompt": "hello", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url + "/v1/completions", json=body)
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()
        text = await wait_metric(s, url, "llm_pool_shim:requests_cancelled_total", lambda v: v == 1)
        assert gauge(text, "vllm:num_requests_running") == 0
        produced = gauge(text, "vllm:generation_tokens_total")
        assert produced < 100_000
        # Nothing decodes for nobody: the token count stays where the cancellation left it.
        async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as probe:
            assert probe.status == 200
        assert gauge(await metrics(s, url), "vllm:generation_tokens_total") == produced + 1


async def test_encoder_decoder_model_translates(serve: Any) -> None:
    engine, url = await serve(kind="seq2seq")
    assert engine.kind == "translator"
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello world"}],
                                                             "max_tokens": 6, "ignore_eos": True}) as resp:
            out = await resp.json()
        assert out["usage"]["completion_tokens"] == 6
        async with s.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 6, "beam_size": 2}) as resp:
            assert resp.status == 200
