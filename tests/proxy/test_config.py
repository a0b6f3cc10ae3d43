from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from proxy.cli import main
from proxy.config.files import REPO_ROOT
from proxy.config.loading import ConfigError, load_settings
from proxy.config.merge import deep_merge

LLAMA_MODEL = {"backend": "llama_server", "model_path": "models/tiny.gguf", "enabled": False}


def write(path: Path, doc: object) -> Path:
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


@pytest.fixture(autouse=True)
def no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_POOL_SETTINGS_PATH", raising=False)
    monkeypatch.delenv("LLM_POOL_LOCAL_SETTINGS_PATH", raising=False)


def problems_of(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    return info.value.problems


def test_shipped_pool_yaml_validates() -> None:
    settings = load_settings(REPO_ROOT / "conf" / "pool.yaml")
    demo = settings.models["demo"]
    assert demo.backend == "llama_server" and demo.enabled
    assert settings.service.port == 8011


@pytest.mark.parametrize("example", sorted((REPO_ROOT / "conf" / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate_merged_over_pool_yaml(example: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", str(example))
    settings = load_settings(REPO_ROOT / "conf" / "pool.yaml")
    assert str(example) in {str(s) for s in settings.sources}


def test_local_yaml_wins_per_key_with_deep_merge(tmp_path: Path) -> None:
    base = write(tmp_path / "pool.yaml", {"service": {"port": 9000, "host": "127.0.0.1"},
                                          "engine": {"models": {"m": {**LLAMA_MODEL, "target_inflight": 2}}}})
    write(tmp_path / "local.yaml", {"service": {"port": 9001}, "engine": {"models": {"m": {"enabled": True}}}})
    settings = load_settings(base)
    assert settings.service.port == 9001 and settings.service.host == "127.0.0.1"
    model = settings.models["m"]
    assert model.enabled and model.target_inflight == 2
    assert model.get("model_path") == str(tmp_path / "models" / "tiny.gguf")


def test_env_vars_choose_both_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = write(tmp_path / "a.yaml", {"service": {"port": 9100}})
    local = write(tmp_path / "b.yaml", {"service": {"port": 9200}})
    monkeypatch.setenv("LLM_POOL_SETTINGS_PATH", str(base))
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", str(local))
    assert load_settings().service.port == 9200


def test_settings_json_loads_unchanged(tmp_path: Path) -> None:
    doc = {"service": {"host": "0.0.0.0", "port": 8011, "log_level": "info"},
           "engine": {"backend": "llama_server", "decoding": {"temperature": 0.1, "max_tokens": 256},
                      "fairness": {"default_weight": 1.0, "weights": {"workbench": 1.0},
                                   "soft_max_inflight_per_key": 1, "max_pending_per_key": 32,
                                   "max_pending_per_executor": 128, "idle_state_ttl_s": 300},
                      "models": {"frontier-large": {"backend": "openai_remote", "model_path": None,
                                                    "remote_api_kind": "chat_completions",
                                                    "remote_base_url": "https://api.example.com/v1",
                                                    "remote_api_key_env": "EXAMPLE_API_KEY",
                                                    "remote_model": "provider-model", "remote_timeout_s": 120,
                                                    "target_inflight": 1, "enabled": False},
                                 "gguf": {"model_path": "/models/x.gguf", "llama_server_n_gpu_layers": "-1"}}}}
    path = tmp_path / "settings.json"
    path.write_text(json.dumps(doc, indent=2))
    settings = load_settings(path)
    assert settings.models["gguf"].backend == "llama_server"  # from engine.backend
    assert settings.models["frontier-large"].backend == "openai_remote"


def test_invalid_yaml_names_file_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path / "pool.yaml", "service:\n  port: 8011\n   host: x\n")
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:3:") and "invalid YAML" in problem


@pytest.mark.parametrize("model, expected", [
    ({**LLAMA_MODEL, "backend": "tensorflow"}, "engine.models.m.backend: 'tensorflow' is not one of"),
    ({**LLAMA_MODEL, "target_inflight": -1}, "engine.models.m.target_inflight: -1 is less than the minimum of 1"),
    ({"backend": "llama_server"}, "engine.models.m.model_path: required"),
    ({**LLAMA_MODEL, "replicas": 3, "replica_max": 2}, "engine.models.m.replicas: 3 is above replica_max 2"),
    ({**LLAMA_MODEL, "llama_server_spec_draft_n_max": 9}, "engine.models.m.llama_server_spec_draft_n_max: 9 is"),
])
def test_model_errors_name_the_path_and_rule(tmp_path: Path, model: dict, expected: str) -> None:
    path = write(tmp_path / "pool.yaml", {"engine": {"models": {"m": model}}})
    problems = problems_of(path)
    assert any(p.startswith(expected) for p in problems), problems


def test_model_ids_are_never_paths(tmp_path: Path) -> None:
    path = write(tmp_path / "pool.yaml", {"engine": {"models": {"../etc/passwd": LLAMA_MODEL}}})
    (problem,) = problems_of(path)
    assert "never paths" in problem


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path / "pool.yaml", {"service": {"port": 0, "extra": 1},
                                          "engine": {"models": {"m": {**LLAMA_MODEL, "target_inflight": 0,
                                                                      "modalities": ["image"]}}}})
    problems = problems_of(path)
    assert len(problems) == 3, problems  # the unknown `extra` is a warning, not a problem


def test_a_key_given_twice_in_one_mapping_is_an_error_naming_both_lines(tmp_path: Path) -> None:
    # Before: YAML kept the last one, and the first was dropped without a word.
    base = write(tmp_path / "pool.yaml", "engine:\n  models:\n    m:\n      backend: llama_server\n"
                                         "      model_path: /m.gguf\n      llama_server_n_ctx: 4096\n"
                                         "      target_inflight: 2\n      llama_server_n_ctx: 512\n")
    local = write(tmp_path / "local.yaml", "service: {port: 9001, port: 9002}\n")
    assert problems_of(base) == [
        f"engine.models.m.llama_server_n_ctx: set twice in one mapping ({base}:6 and {base}:8); YAML keeps only the "
        "last, so remove one",
        f"service.port: set twice in one mapping ({local}:1 and {local}:1); YAML keeps only the last, so remove one"]


def test_a_merge_key_and_keys_that_only_look_alike_are_not_duplicates(tmp_path: Path) -> None:
    # A mapping overrides what `<<` merges in by design; `1` and `"1"` are two keys.
    base = write(tmp_path / "pool.yaml", "x-model: &m {backend: sim, target_inflight: 1}\n"
                                         "engine:\n  models:\n    a:\n      <<: *m\n      target_inflight: 2\n"
                                         "    b: *m\n  fairness: {weights: {1: 1.0, '1': 2.0}}\n")
    settings = load_settings(base)
    assert settings.models["a"].target_inflight == 2 and settings.models["b"].target_inflight == 1


def test_warnings_are_shown_when_there_are_errors_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: an error hid every unknown-key warning, so the typo behind it went unseen.
    path = write(tmp_path / "pool.yaml", "engine:\n  models:\n    m:\n      backend: llama_server\n"
                                         "      model_path: /m.gguf\n      llama_server_nctx: 4096\n"
                                         "      target_inflight: 0\n")
    with pytest.raises(SystemExit) as info:
        main(["--config", str(path), "check-config"])
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("llm-pool: warning: engine.models.m.llama_server_nctx: unknown field, ignored; did you "
                             "mean `llama_server_n_ctx`?")
    assert err[1:] == ["llm-pool: 1 configuration problem(s):",
                       f"  engine.models.m.target_inflight: 0 is less than the minimum of 1 ({path}:7)"]


def test_deep_merge_replaces_lists_and_merges_maps() -> None:
    assert deep_merge({"a": {"b": 1, "c": [1, 2]}}, {"a": {"c": [3]}}) == {"a": {"b": 1, "c": [3]}}


# The CLI: every bad input is a message naming the path, exit 2, and nothing started.

def _cli(tmp_path: Path, doc: object, command: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = write(tmp_path / "pool.yaml", doc)
    with pytest.raises(SystemExit) as info:
        main(["--config", str(path), command])
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("command", ["check-config", "serve"])
@pytest.mark.parametrize("doc, expected", [
    ("engine: [1, 2\n", "invalid YAML"),
    ({"engine": {"models": {"m": {**LLAMA_MODEL, "backend": "nope"}}}}, "engine.models.m.backend"),
    ({"engine": {"models": {"m": {**LLAMA_MODEL, "target_inflight": -3}}}}, "engine.models.m.target_inflight"),
    ({"engine": {"models": {"m": {"backend": "llama_server", "enabled": True}}}}, "engine.models.m.model_path"),
    ({"engine": {"models": {"m": {**LLAMA_MODEL, "modalities": ["text", "image"]}}}},
     "engine.models.m.llama_server_mmproj_path: required (llama-server reads images only through"),
])
def test_cli_rejects_bad_config_and_starts_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   command: str, doc: object, expected: str) -> None:
    state = tmp_path / "state"
    if isinstance(doc, dict):
        doc = {**doc, "service": {"state_dir": str(state)}}
    code, err = _cli(tmp_path, doc, command, capsys)
    assert code == 2
    assert expected in err
    assert not state.exists()


def test_check_config_accepts_a_good_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          tiny_gguf: Path, llama_server_bin: Path) -> None:
    path = write(tmp_path / "pool.yaml", {"engine": {"models": {"m": {
        "backend": "llama_server", "model_path": str(tiny_gguf), "llama_server_binary": str(llama_server_bin),
        "enabled": True}}}})
    assert main(["--config", str(path), "check-config"]) == 0
    assert capsys.readouterr().out.startswith("ok: 1 model(s), 1 enabled")


def test_a_prompt_format_the_shims_do_not_know_is_an_error_with_the_closest_name(tmp_path: Path) -> None:
    # Before: the model loaded and answered every request 400 invalid_request (blaming the client).
    path = write(tmp_path / "pool.yaml", {"engine": {"models": {"m": {**LLAMA_MODEL, "prompt_format": "genric"}}}})
    (problem,) = problems_of(path)
    assert problem.startswith("engine.models.m.prompt_format: 'genric' is not a prompt format llm-pool knows; "
                              "did you mean `generic`? (one of generic, mistral_template, qwen3_template, "
                              "gemma4_template, translategemma_template)"), problem


def test_prompt_formats_come_from_the_shims_renderers() -> None:
    from proxy.config.checks import PROMPT_FORMATS
    from shims import prompts

    assert PROMPT_FORMATS is prompts.FORMATS
    for name in PROMPT_FORMATS:  # every format named is one the renderer takes
        prompts.render([{"role": "user", "content": [{"type": "text", "text": "hi", "source_lang_code": "en",
                                                      "target_lang_code": "de"}]}], name, multi_turn=False)


@pytest.mark.parametrize("model, expected", [
    ({"backend": "llama_server", "model_path": "{yaml}"}, "engine.models.m.model_path: {yaml} is not a GGUF file"),
    ({"backend": "llama_server", "model_path": "{dir}"}, "engine.models.m.model_path: {dir} is a folder"),
    ({"backend": "ct2", "model_path": "{gguf}", "ct2_python": "{python}"},
     "engine.models.m.model_path: {gguf} is a GGUF file"),
    ({"backend": "llama_server", "model_path": "{gguf}", "llama_server_extra_args": ["--no-such-flag"]},
     "engine.models.m.llama_server_extra_args: --no-such-flag is not an option of"),
    ({"backend": "llama_cpp", "model_path": "{gguf}", "llama_cpp_python": "{python}", "prompt_format": "genric"},
     "engine.models.m.prompt_format: 'genric' is not a prompt format llm-pool knows; did you mean `generic`?"),
])
def test_check_config_fails_what_would_fail_at_load(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    tiny_gguf: Path, llama_server_bin: Path,
                                                    model: dict, expected: str) -> None:
    import sys

    yaml_file = write(tmp_path / "notes.yaml", {"a": 1})
    values = {"yaml": str(yaml_file), "dir": str(tmp_path), "gguf": str(tiny_gguf), "python": sys.executable}
    model = {k: v.format(**values) if isinstance(v, str) else v for k, v in model.items()}
    path = write(tmp_path / "pool.yaml", {"service": {"state_dir": str(tmp_path / "state")}, "engine": {"models": {
        "m": {**model, "llama_server_binary": str(llama_server_bin), "enabled": True}}}})
    try:
        code = main(["--config", str(path), "check-config"])
    except SystemExit as exc:  # a problem of the settings themselves, found before any model is checked
        code = exc.code
    assert code == 2
    assert expected.format(**values) in capsys.readouterr().err


@pytest.mark.parametrize("how", [{"load_on_demand": True}, {"enabled": True}])
def test_check_config_fails_a_model_that_loads_without_an_admin_and_cannot_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], how: dict[str, bool]) -> None:
    # Before: a load_on_demand model was not checked; its first request got 409 model_not_loadable.
    missing = tmp_path / "missing.gguf"
    path = write(tmp_path / "pool.yaml", {"service": {"state_dir": str(tmp_path / "state")}, "engine": {"models": {
        "m": {**LLAMA_MODEL, "model_path": str(missing), "llama_server_binary": "/bin/true", **how}}}})
    assert main(["--config", str(path), "check-config"]) == 2
    assert f"  engine.models.m.model_path: {missing} does not exist ({path}:" in capsys.readouterr().err


def test_check_config_fails_an_extra_arg_that_repeats_a_flag_llm_pool_sets(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_gguf: Path, llama_server_bin: Path) -> None:
    # Before: it passed, and llama-server took the last --ctx-size: llama_server_n_ctx was silently ignored.
    path = write(tmp_path / "pool.yaml", {"service": {"state_dir": str(tmp_path / "state")}, "engine": {"models": {
        "m": {"backend": "llama_server", "model_path": str(tiny_gguf), "llama_server_binary": str(llama_server_bin),
              "llama_server_n_ctx": 512, "llama_server_extra_args": ["-c", "8192"], "load_on_demand": True}}}})
    assert main(["--config", str(path), "check-config"]) == 2
    assert ("engine.models.m.llama_server_extra_args: -c (--ctx-size) is set by llm-pool from llama_server_n_ctx"
            in capsys.readouterr().err)


def test_a_load_override_of_a_nested_field_keeps_the_models_other_settings() -> None:
    from proxy.config.model import ModelConfig

    sim = {"ttft_ms": 100, "decode_tokens_per_s": 50.0, "max_seqs": 4}
    config = ModelConfig(name="m", backend="sim", enabled=True, replicas=1, replica_max=2, target_inflight=1,
                         modalities=("text",), gpus=(), options={"backend": "sim", "sim": sim})
    loaded = config.with_overrides({"sim": {"ttft_ms": 5}, "replicas": 2})
    # Before: the whole `sim` object was replaced, dropping decode_tokens_per_s and max_seqs.
    assert loaded.options["sim"] == {"ttft_ms": 5, "decode_tokens_per_s": 50.0, "max_seqs": 4}
    assert loaded.replicas == 2 and config.options["sim"] == sim


def test_lifecycle_keys_default_per_model_to_engine_lifecycle_and_keep_todays_behaviour(tmp_path: Path) -> None:
    sim = {"backend": "sim"}
    plain = load_settings(write(tmp_path / "plain.yaml", {"engine": {"models": {"a": sim}}}))
    a = plain.models["a"]
    assert (a.load_on_demand, a.idle_unload_s, a.pinned) == (False, None, False)
    assert plain.lifecycle.max_loaded_models is None and plain.lifecycle.cpu_budget_mib is None
    assert plain.lifecycle.gpu_headroom_mib is None
    doc = {"engine": {"lifecycle": {"load_on_demand": True, "idle_unload_s": 600, "max_loaded_models": 3,
                                    "memory": {"cpu_budget_mib": 2048, "gpu_headroom_mib": 512}},
                      "models": {"a": sim, "b": {**sim, "idle_unload_s": None, "pinned": True},
                                 "c": {**sim, "load_on_demand": False, "idle_unload_s": 5}}}}
    settings = load_settings(write(tmp_path / "pool.yaml", doc))
    got = {n: (m.load_on_demand, m.idle_unload_s, m.pinned) for n, m in settings.models.items()}
    assert got == {"a": (True, 600.0, False), "b": (True, None, True), "c": (False, 5.0, False)}
    assert (settings.lifecycle.max_loaded_models, settings.lifecycle.cpu_budget_mib,
            settings.lifecycle.gpu_headroom_mib) == (3, 2048, 512)


@pytest.mark.parametrize("lifecycle, expected", [
    ({"max_loaded_models": 0}, "engine.lifecycle.max_loaded_models: 0 is less than the minimum of 1"),
    ({"memory": {"cpu_budget_mib": -1}}, "engine.lifecycle.memory.cpu_budget_mib: -1 is less than or equal"),
    ({"idle_unload_s": "soon"}, "engine.lifecycle.idle_unload_s: 'soon' is not of type 'number', 'null'"),
    ({"pinned": "yes"}, "engine.lifecycle.pinned: 'yes' is not of type 'boolean'"),
])
def test_lifecycle_errors_name_the_path_and_rule(tmp_path: Path, lifecycle: dict, expected: str) -> None:
    path = write(tmp_path / "pool.yaml", {"engine": {"lifecycle": lifecycle, "models": {"a": {"backend": "sim"}}}})
    assert any(p.startswith(expected) for p in problems_of(path)), problems_of(path)
