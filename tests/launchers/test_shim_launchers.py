"""Launchers for the engines behind shims: config fields to `python -m shims.<engine>` arguments."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from launchers import ct2, exllamav3, launcher_for, llama_cpp
from launchers.spec import render_replica
from proxy.config import REPO_ROOT, ConfigError, ModelConfig, load_settings

GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = REPO_ROOT / "conf" / "examples" / "in-process.yaml"


@pytest.fixture
def seed_models(monkeypatch: pytest.MonkeyPatch) -> dict[str, ModelConfig]:
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", str(EXAMPLES))
    return dict(load_settings(REPO_ROOT / "conf" / "pool.yaml").models)


def test_each_backend_has_its_launcher() -> None:
    assert launcher_for("ct2") is ct2 and launcher_for("llama_cpp") is llama_cpp
    assert launcher_for("exllamav3") is exllamav3


def test_seed_examples_render_byte_identical_programs(seed_models: dict[str, ModelConfig]) -> None:
    parts = []
    for name, port in (("some-ct2-model", 18101), ("some-exl3-model", 18102), ("some-gguf-model", 18103)):
        model = seed_models[name]
        launcher = launcher_for(model.backend)
        pinned = model.with_overrides({launcher.PYTHON_FIELD: "/opt/venvs/engine/bin/python"})
        spec = launcher.launch(pinned, 0, port, 15, {"LD_LIBRARY_PATH": "/usr/lib"})
        parts.append(render_replica(name, spec, Path("/var/log/llm-pool")))
    text = "\n".join(parts).replace(str(REPO_ROOT), "{REPO}")
    assert text == (GOLDEN / "shims.conf").read_text()


def test_the_default_interpreter_is_the_proxys_own(seed_models: dict[str, ModelConfig]) -> None:
    spec = ct2.launch(seed_models["some-ct2-model"], 0, 18101, 15, {})
    assert spec.argv[:3] == (sys.executable, "-m", "shims.ct2")
    assert dict(spec.env)["PYTHONPATH"] == str(REPO_ROOT)
    assert spec.argv[spec.argv.index("--compute-type") + 1] == "int8"


def test_compute_type_defaults_to_int8_and_flash_attn_bools_map_to_on_off(seed_models) -> None:
    model = seed_models["some-ct2-model"].with_overrides({"compute_type": None, "device": None})
    args = ct2.argv(model, "127.0.0.1", 1, 15)
    assert args[args.index("--compute-type") + 1] == "int8" and args[args.index("--device") + 1] == "cpu"
    gguf = seed_models["some-gguf-model"].with_overrides({"gguf_flash_attn": False, "gguf_type_k": "q8_0"})
    args = llama_cpp.argv(gguf, "127.0.0.1", 1, 15)
    assert args[args.index("--flash-attn") + 1] == "off" and args[args.index("--type-k") + 1] == "q8_0"


def test_check_names_a_missing_model_a_missing_interpreter_and_a_missing_engine(tmp_path: Path) -> None:
    def model(backend: str, **options: object) -> ModelConfig:
        return ModelConfig(name="m", backend=backend, enabled=True, replicas=1, replica_max=1, target_inflight=1,
                           modalities=("text",), gpus=(), options={"backend": backend, **options})

    assert ct2.check(model("ct2")) == ["engine.models.m.model_path: required for backend 'ct2'"]
    assert ct2.check(model("ct2", model_path=str(tmp_path / "nope"))) == \
        [f"engine.models.m.model_path: {tmp_path / 'nope'} does not exist"]
    assert llama_cpp.check(model("llama_cpp", model_path=str(tmp_path), llama_cpp_python="/no/python")) == \
        ["engine.models.m.llama_cpp_python: /no/python is not an executable interpreter"]
    problems = exllamav3.check(model("exllamav3", model_path=str(tmp_path)))  # no exllamav3 here: no CUDA
    assert problems == ["engine.models.m.backend: 'exllamav3' needs the exllamav3 package in this interpreter "
                        "(pip install 'llm-pool[exllamav3]'), or exllamav3_python naming one that has it"]


def test_schema_holds_llama_cpp_to_one_request_at_a_time(tmp_path: Path) -> None:
    import yaml

    for engine in ({"models": {"g": {"backend": "llama_cpp", "model_path": "x.gguf", "target_inflight": 2}}},
                   {"backend": "llama_cpp", "models": {"g": {"model_path": "x.gguf", "target_inflight": 2}}}):
        path = tmp_path / "pool.yaml"
        path.write_text(yaml.safe_dump({"engine": engine}))
        with pytest.raises(ConfigError) as err:
            load_settings(path)
        assert any(p.startswith("engine.models.g.target_inflight: 2 is greater than the maximum of 1")
                   for p in err.value.problems), err.value.problems
