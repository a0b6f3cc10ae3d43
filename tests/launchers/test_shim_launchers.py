"""Launchers for the engines behind shims: config fields to `python -m shims.<engine>` arguments."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from launchers import ct2, exllamav3, launcher_for, llama_cpp
from launchers.spec import render_replica
from proxy.config.checks import model_properties
from proxy.config.files import REPO_ROOT
from proxy.config.loading import ConfigError, load_settings
from proxy.config.model import ModelConfig

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


def test_the_compute_types_a_load_may_pick_are_exactly_those_ctranslate2_parses() -> None:
    ctranslate2 = pytest.importorskip("ctranslate2")
    allowed = [v for v in model_properties()["compute_type"]["enum"] if v is not None]
    for value in [*allowed, "int3"]:
        # CTranslate2 parses the compute type before it opens the model.
        with pytest.raises((RuntimeError, ValueError)) as failed:
            ctranslate2.Generator("/nonexistent-model", compute_type=value)
        assert ("Invalid compute type" in str(failed.value)) == (value == "int3"), value


def test_check_names_a_missing_model_a_missing_interpreter_and_a_missing_engine(tmp_path: Path,
                                                                               tiny_gguf: Path) -> None:
    def model(backend: str, **options: object) -> ModelConfig:
        return ModelConfig(name="m", backend=backend, enabled=True, replicas=1, replica_max=1, target_inflight=1,
                           modalities=("text",), gpus=(), options={"backend": backend, **options})

    assert ct2.check(model("ct2")) == ["engine.models.m.model_path: required for backend 'ct2'"]
    assert ct2.check(model("ct2", model_path=str(tmp_path / "nope"))) == \
        [f"engine.models.m.model_path: {tmp_path / 'nope'} does not exist"]
    assert llama_cpp.check(model("llama_cpp", model_path=str(tiny_gguf), llama_cpp_python="/no/python")) == \
        ["engine.models.m.llama_cpp_python: /no/python is not an executable interpreter"]
    (tmp_path / "config.json").write_text("{}")
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


def _shim_model(backend: str, model_path: object, **options: object) -> ModelConfig:
    # The proxy's own interpreter stands in for the engine's, so only the model files are judged.
    python = {"ct2": "ct2_python", "llama_cpp": "llama_cpp_python", "exllamav3": "exllamav3_python"}[backend]
    return ModelConfig(name="m", backend=backend, enabled=True, replicas=1, replica_max=1, target_inflight=1,
                       modalities=("text",), gpus=(), options={"backend": backend, "model_path": str(model_path),
                                                                python: sys.executable, **options})


def test_a_ct2_model_must_be_a_converted_folder_not_a_gguf_or_a_bare_folder(tmp_path: Path, tiny_gguf: Path,
                                                                           tiny_ct2: dict[str, Path]) -> None:
    assert ct2.check(_shim_model("ct2", tiny_ct2["decoder"])) == []
    assert ct2.check(_shim_model("ct2", tiny_ct2["seq2seq"])) == []
    (problem,) = ct2.check(_shim_model("ct2", tiny_gguf))
    assert problem.startswith(f"engine.models.m.model_path: {tiny_gguf} is a GGUF file;")
    assert "llama_server" in problem  # where a GGUF runs instead
    (problem,) = ct2.check(_shim_model("ct2", tmp_path))
    assert problem.startswith(f"engine.models.m.model_path: {tmp_path} is not a CTranslate2 model folder (no model.bin)")
    (tmp_path / "model.bin").write_bytes(b"\0")
    (problem,) = ct2.check(_shim_model("ct2", tmp_path))
    assert problem.startswith(f"engine.models.m.model_path: {tmp_path}: no vocabulary file")


def test_a_llama_cpp_model_must_be_a_gguf_file(tmp_path: Path, tiny_gguf: Path) -> None:
    assert llama_cpp.check(_shim_model("llama_cpp", tiny_gguf)) == []
    assert llama_cpp.check(_shim_model("llama_cpp", tmp_path)) == \
        [f"engine.models.m.model_path: {tmp_path} is a folder; backend 'llama_cpp' needs a GGUF file"]
    yaml_file = tmp_path / "pool.yaml"
    yaml_file.write_text("engine: {}\n")
    assert llama_cpp.check(_shim_model("llama_cpp", yaml_file)) == \
        [f"engine.models.m.model_path: {yaml_file} is not a GGUF file (it does not start with the GGUF magic)"]


def test_an_exllamav3_model_must_be_a_folder_with_its_config(tmp_path: Path, tiny_gguf: Path) -> None:
    (problem,) = exllamav3.check(_shim_model("exllamav3", tiny_gguf))
    assert problem.startswith(f"engine.models.m.model_path: {tiny_gguf} is a GGUF file; backend 'exllamav3' needs "
                              "an EXL3 model folder")
    assert exllamav3.check(_shim_model("exllamav3", tmp_path)) == \
        [f"engine.models.m.model_path: {tmp_path} holds no config.json, so it is not an EXL3 model folder"]
    (tmp_path / "config.json").write_text("{}")
    assert exllamav3.check(_shim_model("exllamav3", tmp_path)) == []


def test_shims_keep_their_connections_after_streams(seed_models: dict[str, ModelConfig]) -> None:
    # aiohttp servers: a stream's connection goes back to the proxy's pool, no Connection: close.
    for name in ("some-ct2-model", "some-exl3-model", "some-gguf-model"):
        model = seed_models[name]
        assert not launcher_for(model.backend).launch(model, 0, 18101, 15, {}).closes_after_streams
