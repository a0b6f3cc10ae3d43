"""A model that cannot start (a binary or model file that is missing) ends FAILED with its
reason; the pool and its other models are untouched. Against the fake supervisord driver."""
from __future__ import annotations

import contextlib
from pathlib import Path

import aiohttp
import pytest

from fakes import FakeSupervisor
from in_process import serve_routes
from proxy.config.loading import load_settings
from proxy.errors import Conflict
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import ModelState
from proxy.serving.forward import upstream_session


@pytest.fixture
def pool(tmp_path: Path) -> Pool:
    (tmp_path / "pool.yaml").write_text(
        f"service: {{state_dir: {tmp_path}}}\n"
        "engine: {models: {"
        "vl: {backend: vllm, model_path: null, vllm_model: Qwen/Qwen2.5-VL-3B-Instruct, enabled: true, "
        "vllm_serve_binary: /nonexistent/vllm}, "
        "gone: {backend: llama_server, model_path: /nonexistent/model.gguf, llama_server_binary: /bin/true}, "
        "ok: {backend: sim}}}\n")
    settings = load_settings(tmp_path / "pool.yaml")
    return Pool(settings, FakeSupervisor(), http=None, environ={})  # type: ignore[arg-type]


@pytest.mark.parametrize("name, code, reason", [
    ("vl", "model_not_loadable", "engine.models.vl.vllm_serve_binary: /nonexistent/vllm does not exist"),
    ("gone", "model_not_loadable", "engine.models.gone.model_path: /nonexistent/model.gguf does not exist"),
])
async def test_a_model_that_cannot_start_ends_failed_with_its_reason(pool: Pool, name: str, code: str,
                                                                    reason: str) -> None:
    with pytest.raises(Conflict) as info:
        await pool.load(name)
    assert info.value.code == code
    runtime = pool.models[name]
    assert runtime.state == ModelState.FAILED
    assert reason in (runtime.last_error or "")
    assert runtime.describe()["last_error"] == runtime.last_error
    assert pool.models["ok"].state == ModelState.UNLOADED and pool.supervisor.calls == []  # nothing else touched


async def test_a_request_for_an_on_demand_model_that_cannot_start_gets_409_naming_why_without_retry_after(
        tmp_path: Path) -> None:
    # Before: 409 model_not_loadable with `Retry-After: 5`, for a missing file that no wait brings back.
    # Real HTTP on loopback to the proxy's routes and the placer's own on-demand load.
    (tmp_path / "pool.yaml").write_text(
        f"service: {{state_dir: {tmp_path}}}\n"
        "engine: {models: {od: {backend: llama_server, model_path: /nonexistent/model.gguf, "
        "llama_server_binary: /bin/true, load_on_demand: true}}}\n")
    settings = load_settings(tmp_path / "pool.yaml")
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(upstream_session())
        pool = Pool(settings, FakeSupervisor(), http, environ={}, nvml_loader=lambda: None)  # type: ignore[arg-type]
        await pool.start()
        stack.push_async_callback(pool.close, False)
        url = await serve_routes(stack, settings, pool, http)
        client = await stack.enter_async_context(aiohttp.ClientSession())
        for attempt in ("the request that starts the load", "one while it backs off"):
            async with client.post(url + "/v1/chat/completions",
                                   json={"model": "od", "messages": [{"role": "user", "content": "hi"}]}) as resp:
                body = await resp.json()
                assert resp.status == 409 and body["error"]["code"] == "model_not_loadable", (attempt, body)
                assert "Retry-After" not in resp.headers, attempt
                assert "engine.models.od.model_path: /nonexistent/model.gguf does not exist" in body["error"]["message"]
        assert pool.models["od"].state == ModelState.FAILED and pool.supervisor.calls == []
