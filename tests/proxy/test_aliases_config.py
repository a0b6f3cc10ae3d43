"""engine.aliases and a model's `fallbacks` (docs/routing.md: Aliases and fallbacks): what they load
as, and every wrong one named by its path, with nothing started."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config.loading import ConfigError, load_settings
from proxy.config.model import Fallback

MODEL = {"backend": "llama_server", "model_path": "models/tiny.gguf", "enabled": False}


@pytest.fixture(autouse=True)
def no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_POOL_SETTINGS_PATH", raising=False)
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", "/nonexistent/local.yaml")


def write(tmp_path: Path, engine: dict[str, Any]) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"engine": engine}))
    return path


def test_aliases_and_fallbacks_load_with_their_reasons(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, {
        "aliases": {"chat-default": "small", "gpt-4o": "big"},
        "models": {"small": {**MODEL, "fallbacks": ["chat-default-big", {"model": "big",
                                                                          "on": ["context_length_exceeded"]}]},
                   "big": MODEL, "chat-default-big": MODEL}}))
    assert settings.aliases == {"chat-default": "small", "gpt-4o": "big"}
    # A bare name falls back when the model is unavailable or overloaded, never for a long prompt.
    assert settings.models["small"].fallbacks == (
        Fallback("chat-default-big", frozenset({"unavailable", "overloaded"})),
        Fallback("big", frozenset({"context_length_exceeded"})))
    assert settings.models["big"].fallbacks == ()


def test_a_fallback_may_name_an_alias(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, {"aliases": {"default": "big"},
                                              "models": {"small": {**MODEL, "fallbacks": ["default"]}, "big": MODEL}}))
    assert settings.models["small"].fallbacks == (Fallback("default"),)


@pytest.mark.parametrize("engine, expected", [
    ({"aliases": {"small": "big"}, "models": {"small": MODEL, "big": MODEL}},
     "engine.aliases.small: 'small' is a model's name; an alias needs a name of its own"),
    ({"aliases": {"default": "bgi"}, "models": {"big": MODEL}},
     "engine.aliases.default: 'bgi' is not a configured model; did you mean `big`?"),
    ({"aliases": {"../etc": "big"}, "models": {"big": MODEL}}, "engine.aliases: model id '../etc' must be 1-128 characters"),
    ({"aliases": {"default": 3}, "models": {"big": MODEL}}, "engine.aliases.default: 3 is not of type 'string'"),
    ({"models": {"small": {**MODEL, "fallbacks": ["bgi"]}, "big": MODEL}},
     "engine.models.small.fallbacks.0: 'bgi' is not a configured model; did you mean `big`?"),
    ({"models": {"small": {**MODEL, "fallbacks": ["big", "small"]}, "big": MODEL}},
     "engine.models.small.fallbacks.1: 'small' is the model itself"),
    ({"aliases": {"me": "small"}, "models": {"small": {**MODEL, "fallbacks": ["me"]}}},
     "engine.models.small.fallbacks.0: 'me' is the model itself"),
    ({"models": {"small": {**MODEL, "fallbacks": [{"model": "big", "on": ["timeout"]}]}, "big": MODEL}},
     "engine.models.small.fallbacks.0"),
    ({"models": {"small": {**MODEL, "fallbacks": [{"model": "big", "on": []}]}, "big": MODEL}},
     "engine.models.small.fallbacks.0"),
    ({"models": {"small": {**MODEL, "fallbacks": "big"}, "big": MODEL}},
     "engine.models.small.fallbacks: 'big' is not of type 'array'"),
])
def test_a_wrong_alias_or_fallback_names_its_path(tmp_path: Path, engine: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, engine))
    assert expected in str(info.value), str(info.value)


def test_on_is_a_word_in_the_settings_files_and_a_boolean_field_says_so(tmp_path: Path) -> None:
    # YAML 1.1 reads a bare `on` as True: the fallback's reasons would be lost, and `enabled: on`
    # silently true. The settings files are read as YAML 1.2 reads them.
    path = tmp_path / "pool.yaml"
    path.write_text("engine:\n  models:\n    small:\n      backend: llama_server\n      model_path: m.gguf\n"
                    "      enabled: false\n      fallbacks:\n        - model: big\n          on: [unavailable]\n"
                    "    big: {backend: llama_server, model_path: m.gguf, enabled: no}\n")
    assert load_settings(path).models["small"].fallbacks == (Fallback("big", frozenset({"unavailable"})),)
    path.write_text("engine:\n  models:\n    big: {backend: llama_server, model_path: m.gguf, enabled: on}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert "engine.models.big.enabled: 'on' is not of type 'boolean'" in str(info.value)
