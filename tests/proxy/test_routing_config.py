"""Routing settings: per model, with defaults under engine.routing; every wrong value is named by
its path and rule, and nothing starts."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from proxy.cli import main
from proxy.config.loading import ConfigError, load_settings

MODEL = {"backend": "llama_server", "model_path": "models/tiny.gguf", "enabled": False}


@pytest.fixture(autouse=True)
def no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_POOL_SETTINGS_PATH", raising=False)
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", "/nonexistent/local.yaml")


def write(tmp_path: Path, engine: dict) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"engine": engine}))
    return path


def test_affinity_is_the_default_and_engine_routing_changes_it_for_every_model(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, {"models": {"a": MODEL}}))
    assert settings.models["a"].get("routing") == "affinity"
    assert settings.models["a"].get("affinity_max_imbalance") is None
    assert settings.models["a"].get("affinity_prefix_chars") == 1024
    assert settings.models["a"].get("affinity_max_wait_s") == 1.0
    settings = load_settings(write(tmp_path, {
        "routing": {"routing": "least_loaded", "affinity_max_imbalance": 3, "affinity_max_wait_s": None},
        "models": {"a": MODEL, "b": {**MODEL, "routing": "affinity", "affinity_prefix_chars": 256}}}))
    a, b = settings.models["a"], settings.models["b"]
    assert (a.get("routing"), a.get("affinity_max_imbalance")) == ("least_loaded", 3)
    assert a.get("affinity_max_wait_s") is None and b.get("affinity_max_wait_s") is None
    assert (b.get("routing"), b.get("affinity_max_imbalance"), b.get("affinity_prefix_chars")) == ("affinity", 3, 256)


@pytest.mark.parametrize("engine, expected", [
    ({"models": {"m": {**MODEL, "routing": "round_robin"}}}, "engine.models.m.routing: 'round_robin' is not one of"),
    ({"models": {"m": {**MODEL, "affinity_max_imbalance": -1}}},
     "engine.models.m.affinity_max_imbalance: -1 is less than the minimum of 0"),
    ({"models": {"m": {**MODEL, "affinity_prefix_chars": 4}}},
     "engine.models.m.affinity_prefix_chars: 4 is less than the minimum of 16"),
    ({"routing": {"routing": "random"}, "models": {"m": MODEL}}, "engine.routing.routing: 'random' is not one of"),
    ({"routing": {"affinity_max_imbalance": "two"}, "models": {"m": MODEL}},
     "engine.routing.affinity_max_imbalance: 'two' is not of type"),
    ({"models": {"m": {**MODEL, "affinity_max_wait_s": -0.5}}},
     "engine.models.m.affinity_max_wait_s: -0.5 is less than the minimum of 0"),
    ({"routing": {"affinity_max_wait_s": "1s"}, "models": {"m": MODEL}},
     "engine.routing.affinity_max_wait_s: '1s' is not of type"),
])
def test_a_wrong_routing_value_names_its_path_and_rule(tmp_path: Path, engine: dict, expected: str) -> None:
    path = write(tmp_path, engine)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert any(p.startswith(expected) and str(path) in p for p in info.value.problems), info.value.problems


def test_serve_refuses_a_wrong_routing_value_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, {"models": {"m": {**MODEL, "routing": "sticky"}}})
    with pytest.raises(SystemExit) as info:
        main(["--config", str(path), "check-config"])
    assert info.value.code == 2 and "engine.models.m.routing" in capsys.readouterr().err


def test_an_unknown_key_under_engine_routing_is_a_warning_with_the_closest_name(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, {"routing": {"affinity_max_imbalanse": 2}, "models": {"m": MODEL}}))
    assert any("engine.routing.affinity_max_imbalanse: unknown field" in w and "affinity_max_imbalance" in w
               for w in settings.warnings), settings.warnings
