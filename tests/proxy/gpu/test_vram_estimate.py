"""VRAM estimates from model files and context settings, for models that are not loaded."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from proxy.config.model import Adapter, ModelConfig
from proxy.setup.demo_lora import write_tiny_lora
from proxy.setup.demo_model import N_EMBD, N_HEAD, N_LAYER, write_tiny_gguf
from proxy.gpu.vram_estimate import MIB, Estimator


def model(**options: Any) -> ModelConfig:
    return ModelConfig(name="m", backend=options.get("backend", "llama_server"), enabled=False, replicas=1,
                       replica_max=2, target_inflight=1, modalities=("text",), gpus=(), options=options)


def test_gguf_weights_and_kv_cache_from_its_metadata(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    est = Estimator().estimate(model(model_path=str(gguf), llama_server_n_ctx=4096))
    assert est.weights_bytes == gguf.stat().st_size
    head_dim = N_EMBD // N_HEAD
    assert est.kv_cache_bytes == 4096 * N_LAYER * N_HEAD * (2 * head_dim) * 2  # K and V, f16
    assert any("llama_server_n_ctx" in c and "GGUF metadata" in c for c in est.counted)


def test_context_zero_means_the_models_own_context_and_a_cache_type_changes_the_size(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    own = Estimator().estimate(model(model_path=str(gguf), llama_server_n_ctx=0))
    assert own.kv_cache_bytes == 2048 * N_LAYER * N_HEAD * (2 * (N_EMBD // N_HEAD)) * 2  # context_length 2048
    q8 = Estimator().estimate(model(backend="llama_cpp", model_path=str(gguf), gguf_n_ctx=2048, gguf_type_k="q8_0"))
    assert q8.kv_cache_bytes == int(own.kv_cache_bytes / 2 * 34 / 32)


def test_draft_model_and_split_gguf_are_weighed(tmp_path: Path) -> None:
    parts = [tmp_path / f"big-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for i, part in enumerate(parts):
        part.write_bytes(b"x" * (1000 * (i + 1)))
    draft = tmp_path / "draft.bin"
    draft.write_bytes(b"y" * 500)
    est = Estimator().estimate(model(model_path=str(parts[0]), llama_server_draft_model_path=str(draft)))
    assert est.weights_bytes == 6000 + 500
    assert any("2 more part(s)" in c for c in est.counted)
    # Not a readable GGUF: the KV cache is reported as not counted, never silently zero.
    assert any(n.startswith("KV cache: cannot read GGUF metadata") for n in est.not_counted)


def test_lora_adapters_are_weighed_with_their_base(tmp_path: Path) -> None:
    """Every replica holds each adapter (llama-server from its start, vLLM in its cache)."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    lora = write_tiny_lora(tmp_path / "tiny-lora.gguf")
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "adapter_model.safetensors").write_bytes(b"z" * 700)
    base = Estimator().estimate(model(model_path=str(gguf)))
    est = Estimator().estimate(replace(model(model_path=str(gguf)), adapters=(
        Adapter("tiny", "m:tiny", str(lora)), Adapter("peft", "m:peft", str(peft)),
        Adapter("gone", "m:gone", str(tmp_path / "none.gguf")))))
    assert est.weights_bytes == base.weights_bytes + lora.stat().st_size + 700
    assert any(c.startswith("weights: lora_adapters.tiny tiny-lora.gguf") for c in est.counted), est.counted
    assert any(n.startswith("weights: lora_adapters.gone") and "does not exist" in n for n in est.not_counted)


def hf_folder(path: Path, **config: Any) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "model-00001-of-00002.safetensors").write_bytes(b"a" * 3000)
    (path / "model-00002-of-00002.safetensors").write_bytes(b"b" * 2000)
    return path


def test_hf_folder_safetensors_and_config_json(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "qwen", num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       hidden_size=2048, head_dim=128, torch_dtype="bfloat16", max_position_embeddings=32768)
    est = Estimator().estimate(model(backend="vllm_serve", vllm_model=str(folder), vllm_max_model_len=8192))
    assert est.weights_bytes == 5000
    assert est.kv_cache_bytes == 8192 * 28 * 8 * 2 * 128 * 2
    fp8 = Estimator().estimate(model(backend="vllm_serve", vllm_model=str(folder), vllm_max_model_len=8192,
                                     vllm_kv_cache_dtype="fp8"))
    assert fp8.kv_cache_bytes == est.kv_cache_bytes // 2


def test_explicit_vllm_kv_cache_bytes_win(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "m", num_hidden_layers=2, num_attention_heads=2, hidden_size=128)
    est = Estimator().estimate(model(backend="vllm_serve", vllm_model=str(folder),
                                     vllm_kv_cache_memory_bytes=4 * MIB, vllm_max_model_len=512))
    assert est.kv_cache_bytes == 4 * MIB
    assert est.counted[-1] == f"KV cache: vllm_kv_cache_memory_bytes = {4 * MIB}"


def test_ct2_and_exl3_folders(tmp_path: Path) -> None:
    ct2 = tmp_path / "ct2"
    ct2.mkdir()
    (ct2 / "model.bin").write_bytes(b"c" * 1234)
    (ct2 / "config.json").write_text(json.dumps({"layer_norm_epsilon": 1e-5}))
    est = Estimator().estimate(model(backend="ct2", model_path=str(ct2)))
    assert est.weights_bytes == 1234 and est.kv_cache_bytes == 0
    assert any("gives no num_hidden_layers" in n for n in est.not_counted)
    exl3 = hf_folder(tmp_path / "exl3", num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                     hidden_size=512)
    est = Estimator().estimate(model(backend="exllamav3", model_path=str(exl3), exllama_cache_size=1024,
                                     exllama_cache_quant="4,4"))
    assert est.kv_cache_bytes == int(1024 * 4 * 2 * 2 * 64 * 0.5)


def test_no_local_files_say_so(tmp_path: Path) -> None:
    est = Estimator().estimate(model(backend="vllm_serve", vllm_model="Qwen/Qwen3-0.6B"))
    assert (est.weights_bytes, est.kv_cache_bytes) == (0, 0)
    assert est.not_counted and "no local model file" in est.not_counted[0]
    assert est.as_dict(2)["total_mib"] == 0


def test_a_weight_file_the_settings_name_that_is_not_there_is_said_missing(tmp_path: Path) -> None:
    gone = tmp_path / "gone.gguf"
    est = Estimator().estimate(model(backend="llama_server", model_path=str(gone)), on_cpu=True)
    assert est.missing == [f"model_path {gone}"] and est.not_counted[0] == f"weights: model_path {gone} does not exist"
    assert Estimator().estimate(model(backend="vllm_serve", vllm_model="Qwen/Qwen3-0.6B")).missing == []
    assert Estimator().estimate(model(backend="llama_server", model_path=str(write_tiny_gguf(gone)))).missing == []


def test_metadata_is_read_once_per_file_version(tmp_path: Path, monkeypatch) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    calls = []
    import proxy.gpu.vram_estimate as ve
    real = ve.gguf_architecture
    monkeypatch.setattr(ve, "gguf_architecture", lambda p: calls.append(p) or real(p))
    estimator = Estimator()
    first = estimator.estimate(model(model_path=str(gguf), llama_server_n_ctx=1024))
    second = estimator.estimate(model(model_path=str(gguf), llama_server_n_ctx=1024))
    assert len(calls) == 1 and first.kv_cache_bytes == second.kv_cache_bytes > 0


def test_llama_servers_kv_cache_is_its_per_request_context_times_its_slots(tiny_gguf: Path) -> None:
    def kv(slots: int) -> int:
        model = ModelConfig(name="m", backend="llama_server", enabled=False, replicas=1, replica_max=1,
                            target_inflight=slots, modalities=("text",), gpus=(),
                            options={"model_path": str(tiny_gguf), "llama_server_n_ctx": 4096})
        return Estimator().estimate(model).kv_cache_bytes

    assert kv(2) == 2 * kv(1) and kv(4) == 4 * kv(1)


def test_llama_servers_compute_buffers_are_counted_as_the_pinned_build_reserves_them(tiny_gguf: Path) -> None:
    # Before: weights and KV cache only; the compute buffer (what the pinned build's log says as
    # `CPU compute buffer size`, here for the tiny GGUF) was left out, and could be most of it.
    def compute(n_ctx: int, slots: int = 1, **options: Any) -> float:
        config = ModelConfig(name="m", backend="llama_server", enabled=False, replicas=1, replica_max=1,
                             target_inflight=slots, modalities=("text",), gpus=(),
                             options={"model_path": str(tiny_gguf), "llama_server_n_ctx": n_ctx, **options})
        est = Estimator().estimate(config)
        assert any(c.startswith("compute buffers:") for c in est.counted)
        return est.compute_bytes / MIB

    for (n_ctx, slots, flash), logged in {(2048, 1, "auto"): 3.01, (8192, 4, "auto"): 9.01,
                                          (524288, 1, "auto"): 513.01, (16384, 1, "off"): 160.88,
                                          (2048, 4, "off"): 20.88}.items():
        assert abs(compute(n_ctx, slots, llama_server_flash_attn=flash) - logged) < 0.3, (n_ctx, slots, flash)


def test_on_the_cpu_llama_servers_own_process_counts_and_on_a_gpu_it_does_not(tiny_gguf: Path) -> None:
    config = model(model_path=str(tiny_gguf), llama_server_n_ctx=2048)
    on_gpu, on_cpu = Estimator().estimate(config), Estimator().estimate(config, on_cpu=True)
    assert on_gpu.process_bytes == 0 and on_cpu.process_bytes > 10 * MIB
    assert on_cpu.total_bytes == on_gpu.total_bytes + on_cpu.process_bytes
    assert on_cpu.as_dict(1)["process_mib"] == round(on_cpu.process_bytes / MIB, 1)
    # Other engines are not given llama-server's buffers.
    assert Estimator().estimate(model(backend="llama_cpp", model_path=str(tiny_gguf)), on_cpu=True).compute_bytes == 0
