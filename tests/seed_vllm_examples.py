"""The seed's three vLLM model definitions, verbatim (docs/engines.md, "vLLM: `vllm_serve` and `vllm`").

Golden tests pin the program each renders to; integration tests load each with its paths pointed
at the tiny model and CPU-friendly settings, through `cpu_variant`.
"""
from __future__ import annotations

from typing import Any

QWEN25_VL_VLLM: dict[str, Any] = {
    "backend": "vllm",
    "model_path": None,
    "prompt_format": "generic",
    "modalities": ["text", "image"],
    "vllm_model": "Qwen/Qwen2.5-VL-3B-Instruct",
    "vllm_dtype": "bfloat16",
    "vllm_gpu_memory_utilization": 0.01,
    "vllm_kv_cache_memory_bytes": 1073741824,
    "vllm_max_model_len": 12288,
    "vllm_limit_mm_per_prompt": {"image": 1},
    "vllm_mm_processor_kwargs": {"max_pixels": 4014080},
    "enabled": False,
}

GEMMA4_NVFP4_VLLM_SERVE: dict[str, Any] = {
    "backend": "vllm_serve",
    "model_path": None,
    "prompt_format": "generic",
    "target_inflight": 4,
    "modalities": ["text", "image"],
    "vllm_model": "/models/nvidia/Gemma-4-26B-A4B-NVFP4",
    "vllm_dtype": "auto",
    "vllm_gpu_memory_utilization": 0.01,
    "vllm_kv_cache_memory_bytes": 2147483648,
    "vllm_max_model_len": 20480,
    "vllm_limit_mm_per_prompt": {"image": 1},
    "vllm_mm_processor_kwargs": {"max_pixels": 4014080},
    "vllm_speculative_method": "mtp",
    "vllm_speculative_model": "google/gemma-4-26B-A4B-it-assistant",
    "vllm_num_speculative_tokens": 8,
    "vllm_serve_binary": "/opt/vllm/bin/vllm",
    "vllm_serve_library_path": ["/opt/cuda/lib64"],
    "vllm_serve_env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"},
    "vllm_serve_extra_args": ["--max-num-seqs", "4"],
    "enabled": False,
}

QWEN36_NVFP4_VLLM_SERVE: dict[str, Any] = {
    "backend": "vllm_serve",
    "model_path": None,
    "prompt_format": "qwen3_template",
    "enable_thinking": False,
    "modalities": ["text", "image"],
    "vllm_model": "/models/nvidia/Qwen3.6-35B-A3B-NVFP4",
    "vllm_dtype": "auto",
    "vllm_gpu_memory_utilization": 0.01,
    "vllm_kv_cache_memory_bytes": 1073741824,
    "vllm_kv_cache_dtype": "fp8",
    "vllm_max_model_len": 8192,
    "vllm_trust_remote_code": True,
    "vllm_limit_mm_per_prompt": {"image": 1},
    "vllm_mm_processor_kwargs": {"max_pixels": 4014080},
    "vllm_speculative_method": "mtp",
    "vllm_speculative_moe_backend": "triton",
    "vllm_speculative_attention_backend": "triton_attn",
    "vllm_num_speculative_tokens": 1,
    "vllm_serve_binary": "/opt/vllm-qwen/bin/vllm",
    "vllm_serve_start_timeout_s": 900.0,
    "vllm_serve_library_path": [
        "/opt/vllm-qwen/lib/python3.12/site-packages/nvidia/cu13/lib",
        "/opt/vllm-qwen/lib/python3.12/site-packages/nvidia/cublas/lib",
    ],
    "vllm_serve_env": {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"},
    "vllm_serve_extra_args": [
        "--quantization", "modelopt", "--attention-backend", "triton_attn", "--moe-backend", "marlin",
        "--load-format", "fastsafetensors", "--max-num-seqs", "1", "--max-num-batched-tokens", "2048",
        "--reasoning-parser", "qwen3", "--default-chat-template-kwargs", "{\"enable_thinking\": false}",
        "--linear-backend", "cutlass",
    ],
    "enabled": False,
}

SEED_EXAMPLES: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-3b": QWEN25_VL_VLLM,
    "gemma4-nvfp4-vllm-serve": GEMMA4_NVFP4_VLLM_SERVE,
    "qwen3.6-35b-a3b-nvfp4-vllm-serve": QWEN36_NVFP4_VLLM_SERVE,
}

# Extra args of the Qwen 3.6 example that need its CUDA build and NVFP4 checkpoint; the rest stay.
_GPU_ONLY_ARGS = ("--quantization", "--attention-backend", "--moe-backend", "--load-format", "--linear-backend")
# What a 2-core CPU and the tiny float32 model need: the fields in their own fields (an extra
# argument that gives a field's flag again is refused), the rest as extra args.
CPU_FIELDS: dict[str, Any] = {"vllm_dtype": "float32", "vllm_max_model_len": 512}
CPU_ARGS = ["--enforce-eager"]
# Live overrides that take the GPU-only parts out for one load, as an admin would.
CPU_OVERRIDES: dict[str, Any] = {
    "vllm_kv_cache_memory_bytes": 4 * 1024 * 1024, "vllm_kv_cache_dtype": None, "vllm_max_model_len": 512,
    "vllm_speculative_method": None, "vllm_speculative_model": None, "vllm_speculative_moe_backend": None,
    "vllm_speculative_attention_backend": None, "vllm_num_speculative_tokens": None,
}


def cpu_variant(example: dict[str, Any], model_dir: str, vllm: str, env: dict[str, str]) -> dict[str, Any]:
    """The example with its paths pointed at the tiny model and the cached CPU vLLM."""
    args = list(example.get("vllm_serve_extra_args", []))
    kept: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in _GPU_ONLY_ARGS:
            i += 2
            continue
        kept.append(args[i])
        i += 1
    return {**example, **CPU_FIELDS, "vllm_model": model_dir, "vllm_serve_binary": vllm, "vllm_serve_library_path": [],
            "vllm_serve_env": {**example.get("vllm_serve_env", {}), **env},
            "vllm_serve_extra_args": kept + CPU_ARGS, "enabled": False}
