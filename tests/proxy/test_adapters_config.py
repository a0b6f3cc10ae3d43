"""A model's `lora_adapters` (docs/adapters.md): what they load as, how each engine is started with
them and told which one a request runs, and every wrong one named by `check-config`, with nothing
started."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from launchers import llama_server, vllm_serve
from launchers.spec import Adapters
from proxy.cli import main
from proxy.config.loading import ConfigError, load_settings
from proxy.config.model import Adapter
from proxy.setup.demo_lora import write_tiny_lora
from proxy.setup.gguf_file import gguf_writer
from proxy.upstream.reach import ProgramReach

MODEL = {"backend": "llama_server", "model_path": "models/tiny.gguf", "enabled": False}
VLLM = {"backend": "vllm_serve", "enabled": True, "target_inflight": 8, "vllm_model": "org/m", "vllm_serve_binary": "/bin/true",
        "vllm_kv_cache_memory_bytes": 1 << 30}


@pytest.fixture(autouse=True)
def no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_POOL_SETTINGS_PATH", raising=False)
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", "/nonexistent/local.yaml")


def write(tmp_path: Path, engine: dict[str, Any], **top: Any) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"service": {"state_dir": str(tmp_path / "s")}, "engine": engine, **top},
                                   sort_keys=False))   # the adapters keep their order (their ids)
    return path


def test_adapters_load_with_their_ids_paths_and_scales(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, {
        "aliases": {"helper": "base:sql"},
        "models": {"base": {**MODEL, "lora_adapters": {"sql": {"path": "lora/sql.gguf", "scale": 0.5},
                                                       "acme": {"path": "/abs/acme.gguf", "id": "acme-writer"}}}}}))
    model = settings.models["base"]
    # In the order of the settings (llama-server's ids), relative paths against the settings' folder.
    assert model.adapters == (Adapter("sql", "base:sql", str(tmp_path / "lora" / "sql.gguf"), 0.5),
                              Adapter("acme", "acme-writer", "/abs/acme.gguf", 1.0))
    assert {aid: (base.name, a.name) for aid, (base, a) in settings.adapters.items()} == {
        "base:sql": ("base", "sql"), "acme-writer": ("base", "acme")}
    assert model.adapter("acme") == model.adapters[1] and model.adapter("none") is None


@pytest.mark.parametrize("engine, expected", [
    ({"models": {"base": {**MODEL, "lora_adapters": {"x": {"path": "a.gguf", "id": "other"}}}, "other": MODEL}},
     "engine.models.base.lora_adapters.x: its id 'other' is a model's name; give it an id of its own"),
    ({"aliases": {"fast": "other"}, "models": {"base": {**MODEL, "lora_adapters": {"x": {"path": "a", "id": "fast"}}},
                                               "other": MODEL}},
     "engine.models.base.lora_adapters.x: its id 'fast' is an alias (engine.aliases)"),
    ({"models": {"a": {**MODEL, "lora_adapters": {"x": {"path": "a", "id": "same"}}},
                 "b": {**MODEL, "lora_adapters": {"y": {"path": "b", "id": "same"}}}}},
     "engine.models.b.lora_adapters.y: its id 'same' is also engine.models.a.lora_adapters.x's"),
    ({"models": {"c": {"backend": "ct2", "model_path": "m", "lora_adapters": {"x": {"path": "a"}}}}},
     "engine.models.c.lora_adapters: backend 'ct2' serves no LoRA adapters per request (one of llama_server, "
     "vllm_serve, vllm does)"),
    ({"models": {"base": {**MODEL, "lora_adapters": {"a:b": {"path": "a"}}}}},
     "engine.models.base.lora_adapters: adapter name 'a:b' must be 1-64 characters of letters, digits and ._@+- "
     "(its model id is `<model>:<name>`)"),
    ({"models": {"base": {**MODEL, "lora_adapters": {"x": {"scale": 1}}}}},
     "engine.models.base.lora_adapters.x.path: required"),
])
def test_a_wrong_adapter_is_named_by_its_path(tmp_path: Path, engine: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, engine))
    assert any(p.startswith(expected) for p in err.value.problems), err.value.problems


def test_llama_server_loads_every_adapter_and_a_request_names_them_all(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, {"models": {"base": {
        **MODEL, "lora_adapters": {"sql": {"path": "/l/sql.gguf", "scale": 0.5}, "acme": {"path": "/l/acme.gguf"}}}}}))
    spec = llama_server.launch(settings.models["base"], 0, 18100, 5, {})
    argv = list(spec.argv)
    # At a global scale of 0, in the order of the settings (their ids).
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--lora-scaled"] == ["/l/sql.gguf:0", "/l/acme.gguf:0"]
    assert spec.adapters is not None
    # An adapter's request names them all, the chosen one at its scale; the base's names none (all 0).
    assert spec.adapters.fields("acme") == {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]}
    assert spec.adapters.fields(None) == {}
    plain = llama_server.launch(load_settings(write(tmp_path, {"models": {"p": MODEL}})).models["p"], 0, 18100, 5, {})
    assert "--lora-scaled" not in plain.argv and plain.adapters is None


def test_vllm_serves_each_adapter_by_name_and_may_change_them_at_run_time(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, {"models": {"v": {
        **VLLM, "vllm_max_loras": 2, "vllm_max_lora_rank": 32, "lora_adapters": {"sql": {"path": "/l/sql"}}}}}))
    spec = vllm_serve.launch(settings.models["v"], 0, 18100, 5, {})
    argv = " ".join(spec.argv)
    # Served under its public id, so that the answers' `model` is the id the client asked for.
    assert "--enable-lora --lora-modules v:sql=/l/sql" in argv and "--max-loras 2" in argv
    assert "--max-lora-rank 32" in argv
    assert ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True") in spec.env
    assert spec.adapters is not None and spec.adapters.fields("sql") == {"model": "v:sql"}
    assert spec.adapters.fields(None) == {} and spec.adapters.load_path == "/v1/load_lora_adapter"


class Sent:
    """Stands in for the upstream session: keeps what a reach would send."""

    def __init__(self) -> None:
        self.body: bytes = b""

    def post(self, url: str, *, data: bytes, headers: dict[str, str], timeout: aiohttp.ClientTimeout) -> None:
        self.body = data


@pytest.mark.parametrize("adapters, adapter, payload, raw, sent", [
    # A client's own `lora` never reaches the engine, with or without adapters.
    (None, None, {"model": "m", "lora": [{"id": 0, "scale": 1}]}, b'{"model":"m","lora":[{"id":0,"scale":1}]}',
     {"model": "m"}),
    (Adapters(scales=(("a", 0.7),)), "a", {"model": "m:a", "lora": [{"id": 0, "scale": 9}]}, None,
     {"model": "m", "lora": [{"id": 0, "scale": 0.7}]}),
    # The base of a model with adapters: the client's bytes as they came (the server's scales are 0)...
    (Adapters(scales=(("a", 0.7),)), None, {"model": "m", "n": 1}, b'{"model":"m","n":1}', {"model": "m", "n": 1}),
    # ... but never with a `lora` of the client's.
    (Adapters(scales=(("a", 0.7),)), None, {"model": "m", "lora": [{"id": 0, "scale": 1}]},
     b'{"model":"m","lora":[{"id":0,"scale":1}]}', {"model": "m"}),
    (Adapters(by_name=(("a", "m:a"),)), "a", {"model": "m:a"}, None, {"model": "m:a"}),
    (None, None, {"model": "m"}, b'{"model":"m"}', {"model": "m"}),
])
def test_a_reach_sends_the_adapter_the_model_id_chose(adapters: Adapters | None, adapter: str | None,
                                                     payload: dict[str, Any], raw: bytes | None,
                                                     sent: dict[str, Any]) -> None:
    reach = ProgramReach.__new__(ProgramReach)
    reach.base_url, reach.served_model, reach.headers = "http://x", "m", {}
    reach.read_timeout_s, reach.closes_after_streams, reach.adapters = None, False, adapters
    http = Sent()
    reach.post(http, "/v1/chat/completions", payload, "r1", aiohttp.ClientTimeout(), raw, adapter)   # type: ignore[arg-type]
    assert json.loads(http.body) == sent


def check(tmp_path: Path, models: dict[str, Any]) -> int:
    return main(["--config", str(write(tmp_path, {"models": models})), "check-config"])


def test_check_config_reads_each_llama_server_adapter_against_its_base(
        tmp_path: Path, tiny_gguf: Path, tiny_lora_gguf: Path, llama_server_bin: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    model = {"backend": "llama_server", "model_path": str(tiny_gguf), "llama_server_binary": str(llama_server_bin),
             "enabled": True}
    assert check(tmp_path, {"demo": {**model, "lora_adapters": {"tiny": {"path": str(tiny_lora_gguf)}}}}) == 0
    other = tmp_path / "qwen-lora.gguf"
    with gguf_writer(other, "qwen2") as w:
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
    capsys.readouterr()
    assert check(tmp_path, {"demo": {**model, "lora_adapters": {"q": {"path": str(other)}}}}) == 2
    err = capsys.readouterr().err
    assert "engine.models.demo.lora_adapters.q.path:" in err and "qwen2" in err and "llama" in err, err
    comma = write_tiny_lora(tmp_path / "a,b.gguf")
    assert check(tmp_path, {"demo": {**model, "lora_adapters": {"c": {"path": str(comma)}}}}) == 2
    assert "has a comma or a colon, which llama-server's --lora-scaled reads as separators" in capsys.readouterr().err


def test_check_config_reads_a_vllm_adapters_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "sql"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 64}))
    assert check(tmp_path, {"v": {**VLLM, "lora_adapters": {"sql": {"path": str(folder)}}}}) == 2
    assert f"engine.models.v.lora_adapters.sql.path: the adapter's rank 64 ({folder / 'adapter_config.json'}) is " \
           "above vllm_max_lora_rank 16" in capsys.readouterr().err
    assert check(tmp_path, {"v": {**VLLM, "vllm_max_lora_rank": 64, "lora_adapters": {"sql": {"path": str(folder)}}}}) == 0
    assert check(tmp_path, {"v": {**VLLM, "lora_adapters": {"x": {"path": str(tmp_path / "none")}}}}) == 2
    assert "is not a PEFT adapter folder (no readable adapter_config.json)" in capsys.readouterr().err
