from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from launchers import llama_server
from launchers.spec import group_name, ports_in_file, program_name, render_group
from proxy.config import ModelConfig

GOLDEN = Path(__file__).parent / "golden"
ENVIRON = {"LD_LIBRARY_PATH": "/usr/local/lib"}


def model(name: str = "gemma-4-26b-a4b-it-ud-q5ks-llama-server", **options: object) -> ModelConfig:
    base = {
        "backend": "llama_server",
        "model_path": "/models/gemma-4-26B-A4B-it-UD-Q5_K_S.gguf",
        "llama_server_binary": "/opt/llama.cpp/bin/llama-server",
        "llama_server_library_path": ["/opt/llama.cpp/lib"],
        "llama_server_n_ctx": 4096,
        "llama_server_n_gpu_layers": "-1",
        "llama_server_flash_attn": "on",
        "llama_server_mmproj_path": "/models/mmproj-model-f16.gguf",
        "llama_server_image_max_tokens": 512,
        "llama_server_draft_model_path": "/models/draft 50% small.gguf",
        "llama_server_spec_type": "draft",
        "llama_server_spec_draft_n_max": 5,
        "llama_server_spec_draft_p_min": 0.1,
        "llama_server_spec_draft_ngl": "-1",
        "llama_server_reasoning": "none",
        "llama_server_extra_args": ["--threads", "8"],
        "enable_thinking": False,
        **options,
    }
    return ModelConfig(name=name, backend="llama_server", enabled=True, replicas=2, replica_max=2,
                       target_inflight=2, modalities=("text", "image"), gpus=(0, 1), options=base)


def render(cfg: ModelConfig) -> str:
    specs = [llama_server.launch(cfg, i, 18100 + i, 15, ENVIRON) for i in range(cfg.replicas)]
    return render_group(cfg.name, specs, Path("/state/logs"))


def test_render_matches_golden() -> None:
    text = render(model())
    golden = GOLDEN / "llama_server.conf"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_render_is_byte_identical_for_the_same_input() -> None:
    assert render(model()) == render(model())


def test_every_field_maps_to_its_flag() -> None:
    argv = llama_server.argv(model(), "127.0.0.1", 18100)
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--model"] == "/models/gemma-4-26B-A4B-it-UD-Q5_K_S.gguf"
    assert pairs["--ctx-size"] == "4096"
    assert pairs["--n-gpu-layers"] == "-1"
    assert pairs["--flash-attn"] == "on"
    assert pairs["--mmproj"] == "/models/mmproj-model-f16.gguf"
    assert pairs["--image-max-tokens"] == "512"
    assert pairs["--spec-draft-model"] == "/models/draft 50% small.gguf"
    assert pairs["--spec-type"] == "draft"
    assert pairs["--spec-draft-n-max"] == "5"
    assert pairs["--spec-draft-p-min"] == "0.1"
    assert pairs["--spec-draft-ngl"] == "-1"
    assert pairs["--reasoning-format"] == "none"
    assert pairs["--reasoning"] == "off"
    assert pairs["--alias"] == "gemma-4-26b-a4b-it-ud-q5ks-llama-server"
    assert pairs["--parallel"] == "2"
    assert argv[-2:] == ("--threads", "8")


def test_environment_pins_gpus_and_prepends_library_path() -> None:
    spec = llama_server.launch(model(), 0, 18100, 15, ENVIRON)
    assert dict(spec.env) == {"CUDA_VISIBLE_DEVICES": "0,1", "LD_LIBRARY_PATH": "/opt/llama.cpp/lib:/usr/local/lib"}


def test_unset_fields_add_no_flags() -> None:
    cfg = ModelConfig(name="m", backend="llama_server", enabled=True, replicas=1, replica_max=1, target_inflight=1,
                      modalities=("text",), gpus=(), options={"model_path": "/m.gguf",
                                                              "llama_server_binary": "/bin/llama-server"})
    spec = llama_server.launch(cfg, 0, 18100, 15, {})
    assert spec.argv == ("/bin/llama-server", "--model", "/m.gguf", "--host", "127.0.0.1", "--port", "18100",
                         "--alias", "m", "--parallel", "1", "--metrics", "--no-webui")
    assert spec.env == ()


def test_flags_exist_in_the_built_llama_server(llama_server_bin: Path) -> None:
    help_text = subprocess.run([str(llama_server_bin), "--help"], capture_output=True, text=True, timeout=60).stdout
    argv = llama_server.argv(model(), "127.0.0.1", 18100)
    flags = {a for a in argv if a.startswith("--")} - {"--threads"}
    missing = sorted(f for f in flags if f not in help_text)
    assert not missing, missing


@pytest.mark.parametrize("name", ["demo", "Qwen/Qwen2.5", "a b;rm -rf /", "x" * 128, "gemma:7b@q4+x"])
def test_program_names_are_safe_and_distinct(name: str) -> None:
    group = group_name(name)
    assert all(c.isalnum() or c == "-" for c in group) and len(group) <= 49
    assert program_name(name, 1) == f"{group}-r1"
    assert group_name(name + "_") != group


def test_ports_are_read_back_from_a_rendered_file() -> None:
    cfg = model()
    assert ports_in_file(render(cfg)) == {program_name(cfg.name, 0): 18100, program_name(cfg.name, 1): 18101}
