"""The admin view of a model definition: load constraints straight from the schema, secrets redacted."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from launchers import llama_server, sim
from proxy.lifecycle.kinds.kind import traits_for
from proxy.serving.admin_view import REDACTED, definition, load_constraints
from proxy.config.checks import model_properties
from proxy.config.files import SCHEMA_PATH
from proxy.config.loading import load_settings
from proxy.config.model import ModelConfig


def configured(tmp_path: Path, **models: dict[str, Any]) -> dict[str, ModelConfig]:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"service": {"state_dir": str(tmp_path / "s")}, "engine": {"models": models}}))
    return dict(load_settings(path).models)


def test_load_constraints_list_every_live_override_with_the_schema_rule(tmp_path: Path) -> None:
    model = configured(tmp_path, m={"backend": "llama_server", "model_path": "/m.gguf", "llama_server_n_ctx": 4096,
                                    "replicas": 1, "replica_max": 3})["m"]
    constraints = load_constraints(model, model_properties(), True)
    assert list(constraints["overrides"]) == list(llama_server.LOAD_OVERRIDES)
    n_max = constraints["overrides"]["llama_server_spec_draft_n_max"]
    assert (n_max["type"], n_max["nullable"], n_max["minimum"], n_max["maximum"]) == (["integer"], True, 1, 6)
    ctx = constraints["overrides"]["llama_server_n_ctx"]
    assert (ctx["type"], ctx["minimum"], ctx["configured"]) == (["integer"], 0, 4096)
    p_min = constraints["overrides"]["llama_server_spec_draft_p_min"]
    assert (p_min["type"], p_min["minimum"], p_min["maximum"]) == (["number"], 0, 1)
    assert constraints["replicas"] == {"type": ["integer"], "minimum": 1, "maximum": 3, "configured": 1}
    assert constraints["loadable"] is True


def test_constraints_follow_the_schema_file_not_a_copy(tmp_path: Path, monkeypatch) -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    schema["$defs"]["model"]["properties"]["llama_server_spec_draft_n_max"]["maximum"] = 9
    edited = tmp_path / "schema.json"
    edited.write_text(json.dumps(schema))
    monkeypatch.setattr("proxy.config.files.SCHEMA_PATH", edited)
    model = ModelConfig(name="m", backend="llama_server", enabled=False, replicas=1, replica_max=1,
                        target_inflight=1, modalities=("text",), gpus=(), options={})
    assert load_constraints(model, model_properties(), True)["overrides"]["llama_server_spec_draft_n_max"]["maximum"] == 9


def test_an_object_override_carries_its_properties(tmp_path: Path) -> None:
    model = configured(tmp_path, s={"backend": "sim"})["s"]
    overrides = load_constraints(model, model_properties(), True)["overrides"]
    assert list(overrides) == list(sim.LOAD_OVERRIDES)
    assert overrides["sim"]["type"] == ["object"] and "max_seqs" in overrides["sim"]["properties"]
    assert "python" not in overrides["sim"]["properties"]   # config-only: a load cannot pick the interpreter


def test_a_backend_this_version_cannot_run_offers_no_overrides(tmp_path: Path, monkeypatch) -> None:
    model = configured(tmp_path, x={"backend": "exllamav3", "model_path": "/x"})["x"]
    monkeypatch.setattr("proxy.serving.admin_view.launcher_for", lambda backend: None)
    assert load_constraints(model, model_properties(), False) == {
        "loadable": False, "overrides": {},
        "replicas": {"type": ["integer"], "minimum": 1, "maximum": 1, "configured": 1}}


def test_definition_shows_metadata_and_redacts_secrets(tmp_path: Path) -> None:
    model = configured(tmp_path, v={
        "backend": "vllm_serve", "vllm_model": "/models/qwen", "prompt_format": "qwen3_template",
        "modalities": ["text", "image"], "description": "Qwen for the workbench", "replicas": 1, "replica_max": 2,
        "vllm_serve_api_key": "sk-live-123", "vllm_serve_env": {"HF_TOKEN": "hf_secret", "VLLM_X": "1"},
        "vllm_serve_extra_args": ["--max-num-seqs", "4", "--api-key", "sk-arg-456", "--hf-token=hf_arg"],
        "vllm_max_model_len": 8192, "vllm_num_speculative_tokens": 3,
    }, r={"backend": "openai_remote", "remote_base_url": "https://user:pw-789@api.example.com/v1",
          "remote_api_key_env": "TEST_REMOTE_KEY", "remote_model": "gpt-x"})
    shown = definition(model["v"], environ={}, model_field=traits_for("vllm_serve").model_field)
    text = json.dumps(shown)
    for secret in ("sk-live-123", "hf_secret", "sk-arg-456", "hf_arg"):
        assert secret not in text
    assert (shown["backend"], shown["vllm_model"], shown["prompt_format"], shown["description"]) == \
        ("vllm_serve", "/models/qwen", "qwen3_template", "Qwen for the workbench")
    assert (shown["modalities"], shown["replicas"], shown["replica_max"]) == (["text", "image"], 1, 2)
    fields = shown["fields"]
    assert fields["vllm_serve_api_key"] == REDACTED
    assert fields["vllm_serve_env"] == {"HF_TOKEN": REDACTED, "VLLM_X": REDACTED}
    assert fields["vllm_serve_extra_args"] == ["--max-num-seqs", "4", "--api-key", REDACTED,
                                               f"--hf-token={REDACTED}"]
    # Token counts are not tokens: only whole-word names are secrets.
    assert (fields["vllm_max_model_len"], fields["vllm_num_speculative_tokens"]) == (8192, 3)

    remote = definition(model["r"], environ={"TEST_REMOTE_KEY": "sk-remote-000"})
    assert remote["fields"]["remote_api_key_env"] == {"variable": "TEST_REMOTE_KEY", "set": True}
    assert remote["fields"]["remote_base_url"] == "https://api.example.com/v1"
    assert "sk-remote-000" not in json.dumps(remote) and "pw-789" not in json.dumps(remote)
    assert definition(model["r"], environ={})["fields"]["remote_api_key_env"]["set"] is False


def test_every_launchers_overrides_have_a_schema_rule() -> None:
    from launchers import LAUNCHERS
    properties = model_properties()
    for backend, launcher in LAUNCHERS.items():
        for name in getattr(launcher, "LOAD_OVERRIDES", ()):
            assert name in properties, f"{backend}: LOAD_OVERRIDES names {name}, which the schema does not define"
