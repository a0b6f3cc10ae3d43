"""Load overrides are data: they change a number or pick from a set the engine documents, never
what runs (an executable, a path, a library). proxy.config.checks.override_problems, against the schema."""
from __future__ import annotations

import json
from typing import Any, Iterator

import pytest

from launchers import LAUNCHERS, ct2, llama_server, sim, vllm_serve
from proxy.config.checks import model_properties, override_problems, override_rule
from proxy.config.model import PATH_FIELDS, PATH_LIST_FIELDS, ModelConfig

# The two payloads: an interpreter of the caller's choosing, and a line break that gives
# supervisord a second `command=`.
INJECTED = 'x\ncommand=/bin/sh -c "id > out.txt"\n;'


def model(backend: str) -> ModelConfig:
    return ModelConfig(name="m", backend=backend, enabled=False, replicas=1, replica_max=2, target_inflight=1,
                       modalities=("text",), gpus=(), options={"backend": backend})


def problems(backend: str, launcher: Any, **overrides: Any) -> list[str]:
    return override_problems(model(backend), overrides, launcher.LOAD_OVERRIDES)


@pytest.mark.parametrize("python", ["/usr/bin/env", INJECTED])
def test_the_sims_interpreter_is_config_only(python: str) -> None:
    (problem,) = problems("sim", sim, sim={"ttft_ms": 5, "python": python})
    assert problem.startswith("overrides.sim.python: set in the config files only")
    assert problems("sim", sim, sim={"ttft_ms": 5}) == []


def test_a_checkpoint_or_a_binary_is_config_only() -> None:
    for key, value in (("vllm_speculative_model", "/tmp/evil"), ("vllm_speculative_model", "org/draft"),
                       ("vllm_serve_binary", "/bin/sh"), ("vllm_serve_env", {"LD_PRELOAD": "/tmp/x.so"}),
                       ("vllm_serve_extra_args", ["--x"])):
        (problem,) = problems("vllm_serve", vllm_serve, **{key: value})
        assert problem.startswith(f"overrides.{key}: set in the config files only"), problem


def test_a_load_may_remove_a_checkpoint_but_not_a_binary() -> None:
    # null names nothing: the load runs without speculation. A binary is not a live override at all.
    assert problems("vllm_serve", vllm_serve, vllm_speculative_model=None, vllm_speculative_method=None) == []
    (problem,) = problems("vllm_serve", vllm_serve, vllm_serve_binary=None)
    assert problem.startswith("overrides.vllm_serve_binary: not a live override")


@pytest.mark.parametrize("backend, launcher, key, good, bad", [
    ("ct2", ct2, "compute_type", "int8_float16", INJECTED),
    ("ct2", ct2, "compute_type", "auto", "int3"),
    ("vllm_serve", vllm_serve, "vllm_kv_cache_dtype", "fp8", INJECTED),
    ("vllm_serve", vllm_serve, "vllm_speculative_method", "mtp", "mtp\n"),
    ("vllm_serve", vllm_serve, "vllm_speculative_moe_backend", "triton", "triton --x"),
    ("vllm_serve", vllm_serve, "vllm_speculative_attention_backend", "triton_attn", INJECTED),
    ("llama_server", llama_server, "llama_server_spec_type", "draft,ngram-mod", INJECTED),
    ("llama_server", llama_server, "llama_server_spec_type", "draft-simple", "draft ;x"),
])
def test_a_free_string_override_is_refused_outside_its_set(backend: str, launcher: Any, key: str, good: str,
                                                           bad: str) -> None:
    assert problems(backend, launcher, **{key: good}) == []
    assert problems(backend, launcher, **{key: None}) == []   # null: the field is left out for that load
    (problem,) = problems(backend, launcher, **{key: bad})
    assert problem.startswith(f"overrides.{key}: ")


def _strings(rule: dict[str, Any], where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every rule under `rule` (itself included) that admits a string, with its path."""
    types = rule.get("type", [])
    if "string" in ([types] if isinstance(types, str) else types) or \
            ("enum" not in rule and "type" not in rule and "properties" not in rule):
        yield where, rule
    for key, sub in rule.get("properties", {}).items():
        yield from _strings(sub, f"{where}.{key}")
    if isinstance(rule.get("items"), dict):
        yield from _strings(rule["items"], f"{where}[]")
    if isinstance(rule.get("additionalProperties"), dict):
        yield from _strings(rule["additionalProperties"], f"{where}.*")


def test_every_string_a_load_may_override_is_an_enum_or_a_pattern_and_none_names_what_runs() -> None:
    properties = model_properties()
    for backend, launcher in LAUNCHERS.items():
        for name in launcher.LOAD_OVERRIDES:
            if properties[name].get("readOnly"):
                # A load may only remove it: what it offers is null alone.
                assert override_rule(properties[name])["type"] == "null", f"{backend}: {name}"
                continue
            for where, rule in _strings(properties[name], name):
                if rule.get("readOnly"):
                    continue   # refused as an override, at any depth
                assert "enum" in rule or "pattern" in rule, f"{backend}: override {where} takes any string"


def test_every_field_that_names_a_file_is_config_only() -> None:
    properties = model_properties()
    for name in (*PATH_FIELDS, *PATH_LIST_FIELDS):
        assert properties[name].get("readOnly") is True, name
    for name in properties:
        if name.endswith(("_python", "_binary", "_extra_args", "_library_path")):
            assert properties[name].get("readOnly") is True, name
    assert properties["sim"]["properties"]["python"]["readOnly"] is True


def test_the_schema_stays_valid_json_schema() -> None:
    import jsonschema

    from proxy.config.files import SCHEMA_PATH

    jsonschema.Draft202012Validator.check_schema(json.loads(SCHEMA_PATH.read_text()))
