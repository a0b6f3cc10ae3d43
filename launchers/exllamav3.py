"""ExLlamaV3 (EXL3) models (shims/exllamav3.py) as supervisord programs; every `exllama_*` field."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from launchers.common import SHIM_HOST, none_known, shim_argv, shim_problems, shim_spec
from launchers.gguf_header import is_gguf
from launchers.spec import EngineMetrics, ProgramSpec
from proxy.capabilities import Traits
from proxy.config.model import ModelConfig

PORT_FIELD = "exllamav3_port"
PYTHON_FIELD = "exllamav3_python"
# What the backend can do (proxy/capabilities.py reads it; nothing else names the backend).
TRAITS = Traits()  # single-turn prompts
LOAD_OVERRIDES = ("exllama_cache_size",)
DEFAULT_START_TIMEOUT_S = 600.0      # large quantized models take minutes to load
# (config field, shim flag), emitted in this order when set.
FLAGS = (
    ("exllama_cache_size", "--cache-size"),
    ("exllama_cache_quant", "--cache-quant"),
    ("exllama_tp_backend", "--tp-backend"),
    ("exllama_max_batch_size", "--max-batch-size"),
    ("exllama_max_chunk_size", "--max-chunk-size"),
    ("exllama_max_q_size", "--max-q-size"),
    ("exllama_max_rq_tokens", "--max-rq-tokens"),
)
METRICS = EngineMetrics(running="vllm:num_requests_running", waiting="vllm:num_requests_waiting",
                        kv_cache="vllm:kv_cache_usage_perc")


def model_folder_problem(path: Path) -> str | None:
    """Why `path` is not an EXL3 model folder (exllamav3's Config.from_directory reads its config.json), or None."""
    if path.is_dir():
        return None if (path / "config.json").is_file() else \
            f"{path} holds no config.json, so it is not an EXL3 model folder"
    what, instead = ("a GGUF file", "; a GGUF runs on backend llama_server or llama_cpp") if is_gguf(path) \
        else ("a file", "")
    return (f"{path} is {what}; backend 'exllamav3' needs an EXL3 model folder (config.json and its .safetensors)"
            f"{instead}")


def device(model: ModelConfig) -> tuple[str, str]:
    """Where a replica's memory is (placement): ExLlamaV3 runs on CUDA only."""
    return "gpu", "backend exllamav3 runs on a GPU"


def check(model: ModelConfig) -> list[str]:
    return shim_problems(model, "exllamav3", PYTHON_FIELD, "exllamav3", model_folder_problem)


def argv(model: ModelConfig, host: str, port: int, stopwaitsecs: int) -> tuple[str, ...]:
    args = shim_argv(model, PYTHON_FIELD, "exllamav3", host, port, stopwaitsecs)
    args += ["--prompt-format", str(model.get("prompt_format", "generic")),
             # The continuous-batching generator runs every request the scheduler sends together.
             "--max-concurrency", str(model.target_inflight)]
    for key, flag in FLAGS:
        if model.get(key) is not None:
            args += [flag, str(model.get(key))]
    if model.get("exllama_gpu_split"):
        args += ["--gpu-split", ",".join(repr(float(x)) for x in model.get("exllama_gpu_split"))]
    if model.get("exllama_tensor_parallel") is not None:
        args += ["--tensor-parallel", str(bool(model.get("exllama_tensor_parallel"))).lower()]
    if model.get("enable_thinking") is not None:
        args += ["--enable-thinking", str(bool(model.get("enable_thinking"))).lower()]
    return tuple(args)


def launch(model: ModelConfig, replica: int, port: int, stopwaitsecs: int, environ: Mapping[str, str]) -> ProgramSpec:
    return shim_spec(model, replica, port, stopwaitsecs, environ, argv(model, SHIM_HOST, port, stopwaitsecs),
                     DEFAULT_START_TIMEOUT_S, METRICS)


# No values its server refuses beyond the schema's rules, no settings known to work against the pool.
option_problems = warnings = none_known
