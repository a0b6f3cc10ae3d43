"""A seed user's settings run unchanged: every JSON example of seed 000, a settings.json + local.json
pair, inherited backends, unknown keys as warnings, and the config-time rules of llama_server."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.capabilities import capabilities
from proxy.lifecycle.kinds.kind import traits_for
from proxy.cli import main
from proxy.config.loading import ConfigError, load_settings
from proxy.serving.responses import parse

SEED = Path(__file__).resolve().parent.parent / "fixtures" / "seed_000"
SETTINGS_EXAMPLES = sorted(SEED.glob("settings_*.json"))
REQUEST_EXAMPLES = sorted(SEED.glob("request_*.json"))
# Model-level fragments the seed shows for the openai_remote model.
REMOTE_FRAGMENTS = sorted(SEED.glob("model_remote_*.json"))


@pytest.fixture(autouse=True)
def no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_POOL_SETTINGS_PATH", raising=False)
    monkeypatch.delenv("LLM_POOL_LOCAL_SETTINGS_PATH", raising=False)


def seed(name: str) -> Any:
    return json.loads((SEED / f"{name}.json").read_text())


def write_pair(folder: Path, settings: Any, local: Any | None) -> Path:
    """config/settings.json (verbatim text when given a fixture path) and config/local.json beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    base = folder / "settings.json"
    base.write_text(settings.read_text() if isinstance(settings, Path) else json.dumps(settings, indent=2))
    if local is not None:
        (folder / "local.json").write_text(json.dumps(local, indent=2))
    return base


def enable_all(doc: dict[str, Any]) -> dict[str, Any]:
    """The seed's minimal local override, for each model of an example: `enabled: true`."""
    models = doc.get("engine", {}).get("models", {})
    return {"engine": {"models": {name: {"enabled": True} for name in models}}}


def test_the_fixture_holds_every_json_example_of_the_seed() -> None:
    # 9 settings examples (8 models, the fairness block), the minimal local override, 6 requests,
    # 3 content items, 3 remote fragments, 1 response: the seed's 23 JSON blocks.
    assert len(list(SEED.glob("*.json"))) == 23
    assert len(SETTINGS_EXAMPLES) == 9 and len(REQUEST_EXAMPLES) == 6


@pytest.mark.parametrize("example", SETTINGS_EXAMPLES, ids=lambda p: p.stem)
def test_every_seed_settings_example_loads_over_its_local_override(example: Path, tmp_path: Path) -> None:
    doc = json.loads(example.read_text())
    settings = load_settings(write_pair(tmp_path / "config", example, enable_all(doc)))
    assert settings.warnings == ()  # every field of the seed is known
    for name, raw in doc.get("engine", {}).get("models", {}).items():
        model = settings.models[name]
        assert model.enabled
        assert model.backend == raw.get("backend", doc["engine"].get("backend"))
        for key, value in raw.items():
            if key == "enabled" or key.endswith("_path") and isinstance(value, str):
                continue  # enabled comes from local.json; paths are absolute already
            assert model.options[key] == value, key
    fairness = doc.get("engine", {}).get("fairness")
    if fairness:
        assert dict(settings.fairness) == fairness


def test_the_seed_local_override_enables_the_seed_llama_server_model(tmp_path: Path) -> None:
    base = write_pair(tmp_path / "config", SEED / "settings_llama_server.json", seed("local_override"))
    settings = load_settings(base)
    model = settings.models["gemma-4-26b-a4b-it-ud-q5ks-llama-server"]
    assert model.enabled and model.modalities == ("text", "image")
    assert [s.name for s in settings.sources] == ["settings.json", "local.json"]


@pytest.mark.parametrize("fragment", REMOTE_FRAGMENTS, ids=lambda p: p.stem)
def test_the_seed_remote_fragments_load_in_the_remote_model(fragment: Path, tmp_path: Path) -> None:
    local = {"engine": {"models": {"frontier-large": {**json.loads(fragment.read_text()), "enabled": True}}}}
    settings = load_settings(write_pair(tmp_path / "config", SEED / "settings_openai_remote.json", local))
    model = settings.models["frontier-large"]
    assert all(model.options[k] == v for k, v in json.loads(fragment.read_text()).items())
    assert capabilities(model, traits_for(model.backend)).file_inputs == ("remote_file_mode" in fragment.read_text())


@pytest.mark.parametrize("example", REQUEST_EXAMPLES, ids=lambda p: p.stem)
def test_every_seed_request_example_is_a_valid_request(example: Path) -> None:
    req = parse(json.loads(example.read_text()))
    assert req.ignored == ()


def test_the_seed_content_items_are_valid_input() -> None:
    items = [seed(n) for n in ("content_text", "content_image_url", "content_file")]
    assert parse({"model": "m", "input": items}).ignored == ()


# What a user hit (issue 7, items 1, 2, 3, 8, 9 of the config).

def test_settings_json_finds_local_json_beside_it(tmp_path: Path) -> None:
    base = write_pair(tmp_path / "config", {"service": {"port": 9000}}, {"service": {"port": 9001}})
    (tmp_path / "config" / "local.yaml").write_text("service: {port: 9002}\n")  # not the pair of a .json
    settings = load_settings(base)
    assert settings.service.port == 9001
    assert settings.sources == (base, tmp_path / "config" / "local.json")


def test_the_environment_still_chooses_the_local_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = write_pair(tmp_path / "config", {"service": {"port": 9000}}, {"service": {"port": 9001}})
    other = tmp_path / "elsewhere.json"
    other.write_text(json.dumps({"service": {"port": 9003}}))
    monkeypatch.setenv("LLM_POOL_SETTINGS_PATH", str(base))
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", str(other))
    assert load_settings().service.port == 9003


def test_a_model_inheriting_a_backend_is_judged_by_it(tmp_path: Path) -> None:
    doc = {"engine": {"backend": "vllm", "models": {"qwen": {"model_path": None, "vllm_model": "Qwen/Qwen2.5"}}}}
    settings = load_settings(write_pair(tmp_path, doc, None))
    assert settings.models["qwen"].backend == "vllm"
    # ... and llama_server's rules still hold for a model that inherits llama_server.
    doc = {"engine": {"backend": "llama_server", "models": {"g": {"model_path": None}}}}
    with pytest.raises(ConfigError) as info:
        base = write_pair(tmp_path, doc, None)
        load_settings(base)
    assert info.value.problems == [f"engine.models.g.model_path: None is not of type 'string' "
                                   f"({base}:{line_of(base, 'model_path')})"]


@pytest.mark.parametrize("fields", [{"modalities": ["text", "image"]},
                                    {"modalities": ["text", "image"], "llama_server_mmproj_path": None}])
@pytest.mark.parametrize("inherited", [False, True])
def test_image_input_on_llama_server_needs_an_mmproj(tmp_path: Path, fields: dict, inherited: bool) -> None:
    model = {"model_path": "/m.gguf", **fields, **({} if inherited else {"backend": "llama_server"})}
    doc = {"engine": {**({"backend": "llama_server"} if inherited else {}), "models": {"v": model}}}
    with pytest.raises(ConfigError) as info:
        load_settings(write_pair(tmp_path, doc, None))
    (problem,) = info.value.problems
    assert problem.startswith("engine.models.v.llama_server_mmproj_path: ")
    assert "multimodal projector" in problem


def test_unknown_keys_are_warnings_with_the_closest_name(tmp_path: Path) -> None:
    doc = {"servce": {"port": 1}, "engine": {"models": {"m": {
        "backend": "llama_server", "model_path": "/m.gguf", "llama_server_nctx": 4096, "flavour": 1}}}}
    base = write_pair(tmp_path, doc, None)
    settings = load_settings(base)
    assert settings.warnings == (
        f"engine.models.m.flavour: unknown field, ignored ({base}:{line_of(base, 'flavour')})",
        "engine.models.m.llama_server_nctx: unknown field, ignored; did you mean `llama_server_n_ctx`? "
        f"({base}:{line_of(base, 'llama_server_nctx')})",
        f"servce: unknown field, ignored; did you mean `service`? ({base}:{line_of(base, 'servce')})",
    )
    with pytest.raises(ConfigError) as info:
        load_settings(write_pair(tmp_path, doc, None), strict=True)
    assert info.value.problems == [w.replace(", ignored", ", refused under --strict") for w in settings.warnings]


def _check_config(base: Path, *extra: str) -> int:
    try:
        return main(["--config", str(base), "check-config", *extra])
    except SystemExit as exc:
        return int(exc.code or 0)


def test_check_config_warns_of_unknown_keys_and_strict_fails(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    base = write_pair(tmp_path, {"engine": {"models": {"m": {"backend": "sim", "enabled": True,
                                                              "target_inflght": 2}}}}, None)
    assert _check_config(base) == 0
    out = capsys.readouterr()
    assert "warning: engine.models.m.target_inflght: unknown field, ignored; did you mean `target_inflight`?" \
        in out.err
    assert out.out.startswith("ok: 1 model(s), 1 enabled, 1 warning(s)")
    assert _check_config(base, "--strict") == 2
    err = capsys.readouterr().err
    # An error under --strict: the message says it is refused, not that it is ignored.
    assert "engine.models.m.target_inflght: unknown field, refused under --strict; did you mean " \
        "`target_inflight`?" in err
    assert "ignored" not in err and "warning" not in err


def test_check_config_fails_for_an_enabled_model_that_cannot_start_here(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads((SEED / "settings_vllm.json").read_text())
    base = write_pair(tmp_path / "config", doc, enable_all(doc))
    assert _check_config(base) == 2
    # No `vllm` on this machine's PATH (the seed's example names none): that model cannot start here.
    assert "engine.models.qwen2.5-vl-3b.vllm_serve_binary: vllm does not exist or is not executable" \
        in capsys.readouterr().err
    (tmp_path / "config" / "local.json").unlink()  # disabled, as the seed ships it: fine
    assert _check_config(base) == 0


def test_the_seed_response_example_is_our_envelope_with_our_metric_names() -> None:
    from proxy.edge.response_metrics import METRIC_KEYS
    from proxy.serving.routes_responses import _envelope

    example = seed("response_inference")
    ours = _envelope(example["id"], example["model"], example["output_text"], example["metrics"])
    assert ours == example
    assert set(example["metrics"]) <= set(METRIC_KEYS)


@pytest.mark.parametrize("spec_type, code", [("draft", 0), ("draft-turbo", 2)])
def test_check_config_judges_the_spec_type_by_the_binary(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch, tiny_gguf: Path,
                                                         llama_server_bin: Path, spec_type: str, code: int) -> None:
    # Before: `draft` passed check-config and then the pinned llama-server refused it at load (502).
    monkeypatch.setenv("LLM_POOL_CACHE_DIR", str(tmp_path / "cache"))
    base = write_pair(tmp_path, {"engine": {"models": {"g": {
        "backend": "llama_server", "model_path": str(tiny_gguf), "llama_server_binary": str(llama_server_bin),
        "llama_server_draft_model_path": str(tiny_gguf), "llama_server_spec_type": spec_type, "enabled": True}}}}, None)
    assert _check_config(base) == code
    if code:
        err = capsys.readouterr().err
        assert "engine.models.g.llama_server_spec_type: 'draft-turbo' is not accepted by" in err
        assert "it accepts: " in err and "draft-simple" in err


# Every config message names the file (and line) its key was set in.

def line_of(path: Path, needle: str, after: str = "") -> int:
    """The 1-based line of the first `needle` in the file (after the first `after`, when given)."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if after in line) if after else 0
    return next(i for i, line in enumerate(lines) if i >= start and needle in line) + 1


TINY = {"backend": "llama_server", "model_path": "/models/tiny.gguf", "enabled": False}


def test_a_model_only_in_local_json_is_named_there_with_the_base_model_it_misspells(tmp_path: Path) -> None:
    base = write_pair(tmp_path, {"engine": {"models": {"tiny-lcpp": TINY}}}, {"engine": {"models": {
        "tiny-lpp": {"enabled": True}}}})
    local = base.with_name("local.json")
    with pytest.raises(ConfigError) as info:
        load_settings(base)
    (problem,) = info.value.problems
    assert problem == ("engine.models.tiny-lpp.backend: required (or set engine.backend); `tiny-lpp` is set only "
                       f"in {local}: did you mean `tiny-lcpp` of {base}? ({local}:{line_of(local, 'tiny-lpp')})")


def test_a_wrong_value_names_the_file_and_line_that_set_it(tmp_path: Path) -> None:
    base = write_pair(tmp_path, {"engine": {"models": {"m": {**TINY, "replicas": 1}}}},
                      {"engine": {"models": {"m": {"replicas": "two"}}}})
    local = base.with_name("local.json")
    with pytest.raises(ConfigError) as info:
        load_settings(base)
    assert info.value.problems == [f"engine.models.m.replicas: 'two' is not of type 'integer' "
                                   f"({local}:{line_of(local, 'replicas')})"]
    # The same value in the base file is the base file's.
    base = write_pair(tmp_path, {"engine": {"models": {"m": {**TINY, "replicas": "two"}}}}, {})
    with pytest.raises(ConfigError) as info:
        load_settings(base)
    assert info.value.problems == [f"engine.models.m.replicas: 'two' is not of type 'integer' "
                                   f"({base}:{line_of(base, 'replicas')})"]


def test_a_missing_field_names_every_file_that_sets_its_model(tmp_path: Path) -> None:
    base = write_pair(tmp_path, {"engine": {"models": {"m": {"backend": "llama_server"}}}},
                      {"engine": {"models": {"m": {"enabled": True}}}})
    local = base.with_name("local.json")
    with pytest.raises(ConfigError) as info:
        load_settings(base)
    key = '"m"'
    assert info.value.problems == [f"engine.models.m.model_path: required ({base}:{line_of(base, key)}, "
                                   f"{local}:{line_of(local, key)})"]


def test_semantic_problems_and_warnings_name_their_line(tmp_path: Path) -> None:
    base = write_pair(tmp_path, {"engine": {"models": {"m": {**TINY, "replicas": 3, "replica_max": 2,
                                                             "flavour": 1}}}}, None)
    with pytest.raises(ConfigError) as info:
        load_settings(base)
    assert info.value.problems == [f"engine.models.m.replicas: 3 is above replica_max 2 ({base}:"
                                   f"{line_of(base, 'replicas')})"]
    settings = load_settings(write_pair(tmp_path, {"engine": {"models": {"m": {**TINY, "flavour": 1}}}}, None))
    assert settings.warnings == (f"engine.models.m.flavour: unknown field, ignored ({base}:{line_of(base, 'flavour')})",)


def test_yaml_files_name_their_lines_too(tmp_path: Path) -> None:
    base = tmp_path / "pool.yaml"
    base.write_text("engine:\n  models:\n    m:\n      backend: llama_server\n      model_path: /m.gguf\n"
                    "      target_inflight: -1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(base)
    assert info.value.problems == [f"engine.models.m.target_inflight: -1 is less than the minimum of 1 ({base}:6)"]


def test_check_config_names_the_file_of_a_model_that_cannot_start(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    base = write_pair(tmp_path, {"service": {"state_dir": str(tmp_path / "state")},
                                 "engine": {"models": {"m": {**TINY, "llama_server_binary": "/no/llama-server"}}}},
                      {"engine": {"models": {"m": {"enabled": True}}}})
    assert _check_config(base) == 2
    err = capsys.readouterr().err
    assert (f"engine.models.m.llama_server_binary: /no/llama-server does not exist or is not executable "
            f"({base}:{line_of(base, 'llama_server_binary')})") in err
