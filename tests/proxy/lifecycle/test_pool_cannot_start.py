"""A model that cannot start (a binary or model file that is missing) ends FAILED with its
reason; the pool and its other models are untouched. Against the fake supervisord driver."""
from __future__ import annotations

from pathlib import Path

import pytest

from fakes import FakeSupervisor
from proxy.config import load_settings
from proxy.errors import Conflict
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.replicas import ModelState


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
