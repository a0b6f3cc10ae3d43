"""engine.fairness.classes and a tenant's `priority` (docs/routing.md#priority-classes): what they
load as, and every wrong one named by its path, with nothing started."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config.loading import ConfigError, load_settings
from proxy.fairness import FairnessPolicy, PriorityClass

MODEL = {"backend": "llama_server", "model_path": "models/tiny.gguf", "enabled": False}


@pytest.fixture(autouse=True)
def no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_POOL_SETTINGS_PATH", raising=False)
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", "/nonexistent/local.yaml")


def write(tmp_path: Path, fairness: dict[str, Any] | None = None, **tenant: Any) -> Path:
    doc: dict[str, Any] = {"engine": {"models": {"m": MODEL}, **({"fairness": fairness} if fairness else {})}}
    if tenant:
        doc["tenants"] = {"jobs": {"key_sha256": ["0" * 64], "fairness_key": "jobs", **tenant}}
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    return info.value.problems


def test_classes_and_a_tenants_priority_load(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, {"classes": [{"name": "gold"}, {"name": "default"},
                                                          {"name": "night", "max_wait_s": 3600}]},
                                   priority="gold"))
    policy = FairnessPolicy.from_settings(settings.fairness)
    assert policy.classes == (PriorityClass("gold"), PriorityClass("default"), PriorityClass("night", 3600))
    assert settings.tenants["jobs"].priority == "gold"


def test_unset_classes_are_the_defaults_and_a_tenant_without_priority_is_default(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, priority="batch"))
    assert [c.name for c in FairnessPolicy.from_settings(settings.fairness).classes] == \
        ["interactive", "default", "batch"]
    assert load_settings(write(tmp_path, fairness_key="x")).tenants["jobs"].priority is None


def test_a_class_named_twice_no_default_class_and_a_tenants_unknown_class_are_errors(tmp_path: Path) -> None:
    found = problems(write(tmp_path, {"classes": [{"name": "gold"}, {"name": "gold"}]}, priority="bronze"))
    assert any("engine.fairness.classes.1.name: 'gold' is named twice" in p for p in found), found
    assert any("engine.fairness.classes: needs a class named default" in p for p in found), found
    assert any("tenants.jobs.priority: 'bronze' is not a priority class" in p and "gold" in p for p in found), found


@pytest.mark.parametrize("classes, field", [
    ([], "classes"), ([{"name": "a b"}, {"name": "default"}], "name"),
    ([{"name": "default", "max_wait_s": 0}], "max_wait_s")])
def test_a_malformed_class_is_a_schema_error_naming_its_field(tmp_path: Path, classes: list, field: str) -> None:
    found = problems(write(tmp_path, {"classes": classes}))
    assert any("engine.fairness.classes" in p and field in p for p in found), found


def test_an_unknown_key_of_a_class_is_a_warning_as_every_unknown_key(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, {"classes": [{"name": "default", "max_wait": 5}]}))
    assert any("max_wait" in w and "max_wait_s" in w for w in settings.warnings), settings.warnings
