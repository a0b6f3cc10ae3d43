"""The ExLlamaV3 shim against the FAKE exllamav3 module (tests/fakes.py): ExLlamaV3 needs CUDA.

The fake replaces the library at its one boundary (the `exllamav3` import); the shim's batching,
cancellation, field mapping and HTTP behaviour are its own. tests/gpu/exllamav3_e2e.py runs the
real library on an NVIDIA machine.
"""
from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import aiohttp
import pytest

from fakes import FakeExllamaV3
from launchers import exllamav3 as launcher
from proxy.config.model import ModelConfig
from shims.exllamav3 import ExLlamaV3Engine, ExLlamaV3Options, cache_bits, main


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeExllamaV3:
    lib = FakeExllamaV3()
    for name, module in lib.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return lib


@pytest.fixture
def serve(fake: FakeExllamaV3, tmp_path: Any, shim_server: Any) -> Any:
    async def start(**options: Any) -> tuple[ExLlamaV3Engine, str]:
        engine = ExLlamaV3Engine("exl3", ExLlamaV3Options(model_path=str(tmp_path), **options))
        return engine, await shim_server(engine)
    return start


def test_cache_quant_names_become_k_and_v_bits() -> None:
    assert cache_bits(None) is None and cache_bits("fp16") is None
    assert cache_bits("8") == (8, 8) and cache_bits("q4") == (4, 4)
    assert cache_bits("4,6") == (4, 6) and cache_bits("k4v6") == (4, 6)
    with pytest.raises(ValueError):
        cache_bits("9")


async def test_every_exllama_field_reaches_the_library(serve: Any, fake: FakeExllamaV3) -> None:
    await serve(cache_size=1000, cache_quant="4,6", gpu_split=(20.0, 24.0), tensor_parallel=True,
                tp_backend="nccl", max_batch_size=8, max_chunk_size=512, max_q_size=4, max_rq_tokens=512)
    calls = dict(fake.calls)
    assert calls["Cache"] == {"max_num_tokens": 1024, "layer_type": fake.CacheLayer_quant, "k_bits": 4, "v_bits": 6}
    assert calls["Model.load"] == {"progressbar": False, "use_per_device": [20.0, 24.0], "tensor_p": True,
                                   "tp_backend": "nccl"}
    assert calls["Generator"] == {"max_batch_size": 8, "max_chunk_size": 512, "max_q_size": 4}


async def test_requests_are_batched_together_and_stream(serve: Any, fake: FakeExllamaV3) -> None:
    engine, url = await serve(max_concurrency=4)
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 30, "stream": True}
    async with aiohttp.ClientSession() as s:
        async def one() -> list[str]:
            async with s.post(url + "/v1/chat/completions", json=body) as resp:
                return [e for e in (await resp.text()).split("\n\n") if e]
        results = await asyncio.gather(*(one() for _ in range(4)))
    assert fake.max_active == 4            # one batch, not four turns
    for events in results:
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == \
            "".join(f" w{i}" for i in range(1, 31))
        assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 30, "total_tokens": 33}


async def test_a_client_that_leaves_has_its_job_cancelled_in_the_generator(serve: Any, fake: FakeExllamaV3) -> None:
    engine, url = await serve()
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 8000, "stream": True})
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()
        for _ in range(2000):
            if fake.cancelled:
                break
            await asyncio.sleep(0.005)
    assert len(fake.cancelled) == 1 and engine.generator.num_active_jobs() == 0
    assert engine.counters["requests_cancelled"] == 1


async def test_single_turn_and_cache_bound_refusals(serve: Any) -> None:
    _, url = await serve(cache_size=256)
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={"messages": turns}) as resp:
            assert (await resp.json())["error"]["code"] == "multi_turn_unsupported"
        async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1000}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "context_length_exceeded"


def test_the_seed_example_runs_through_launcher_argv_and_shim(fake: FakeExllamaV3, tmp_path: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # The seed's ExLlamaV3 example, model_path pointed at a folder: the launcher's argv, parsed by the shim.
    seed = {"backend": "exllamav3", "model_path": str(tmp_path), "prompt_format": "generic",
            "exllama_cache_size": 8192, "exllama_cache_quant": None, "enabled": False}
    model = ModelConfig(name="some-exl3-model", backend="exllamav3", enabled=False, replicas=1, replica_max=1,
                        target_inflight=1, modalities=("text",), gpus=(), options=seed)
    argv = launcher.argv(model, "127.0.0.1", 18000, stopwaitsecs=15)
    assert argv[1:3] == ("-m", "shims.exllamav3")
    started: dict[str, Any] = {}
    monkeypatch.setattr("shims.exllamav3.run", lambda app, host, port, timeout: started.update(
        app=app, host=host, port=port, timeout=timeout))
    main(list(argv[3:]))
    assert (started["host"], started["port"], started["timeout"]) == ("127.0.0.1", 18000, 13.0)
