"""GGUF models through llama-cpp-python (shims/llama_cpp.py) as supervisord programs.

`gguf_n_gpu_layers`, `gguf_n_ctx`, `gguf_flash_attn`, `gguf_type_k`, `gguf_type_v`, `prompt_format`.
One request at a time per replica (a `Llama` is not thread-safe): the schema holds `target_inflight`
to 1, and throughput comes from `replicas`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from launchers.common import SHIM_HOST, gguf_problem, none_known, shim_argv, shim_problems, shim_spec
from launchers.spec import EngineMetrics, ProgramSpec
from proxy.capabilities import Traits
from proxy.config.model import ModelConfig
from shims.prompts import MULTI_TURN_FORMATS

PORT_FIELD = "llama_cpp_port"
PYTHON_FIELD = "llama_cpp_python"
# What the backend can do (proxy/capabilities.py reads it; nothing else names the backend).
TRAITS = Traits(multi_turn_formats=MULTI_TURN_FORMATS, text_only=True)  # in-process GGUF: text only
LOAD_OVERRIDES = ("gguf_n_ctx",)
DEFAULT_START_TIMEOUT_S = 300.0
DEFAULT_N_CTX = 4096
# (config field, shim flag), emitted in this order when set.
FLAGS = (
    ("gguf_n_gpu_layers", "--n-gpu-layers"),
    ("gguf_n_ctx", "--n-ctx"),
    ("gguf_type_k", "--type-k"),
    ("gguf_type_v", "--type-v"),
)
METRICS = EngineMetrics(running="vllm:num_requests_running", waiting="vllm:num_requests_waiting",
                        kv_cache="vllm:kv_cache_usage_perc")


def device(model: ModelConfig) -> tuple[str, str]:
    """Where a replica's memory is (placement: cpu or gpu), and the field that says so."""
    layers = model.options.get("gguf_n_gpu_layers")
    if not layers:
        return "cpu", "gguf_n_gpu_layers: 0 or unset (llama-cpp-python keeps every layer on the CPU)"
    return "gpu", f"gguf_n_gpu_layers: {layers}"


def check(model: ModelConfig) -> list[str]:
    def judge(path: Path) -> str | None:
        return gguf_problem(path, model.backend)

    return shim_problems(model, "llama_cpp", PYTHON_FIELD, "llama_cpp", judge)


def argv(model: ModelConfig, host: str, port: int, stopwaitsecs: int) -> tuple[str, ...]:
    args = shim_argv(model, PYTHON_FIELD, "llama_cpp", host, port, stopwaitsecs)
    for key, flag in FLAGS:
        if model.get(key) is not None:
            args += [flag, str(model.get(key))]
    flash = model.get("gguf_flash_attn")
    if flash is not None:
        args += ["--flash-attn", ("on" if flash else "off") if isinstance(flash, bool) else str(flash)]
    # Without prompt_format the GGUF's own chat template renders chat (the shim falls back to generic).
    if model.get("prompt_format"):
        args += ["--prompt-format", str(model.get("prompt_format"))]
    if model.get("enable_thinking") is not None:
        args += ["--enable-thinking", str(bool(model.get("enable_thinking"))).lower()]
    return tuple(args)


def launch(model: ModelConfig, replica: int, port: int, stopwaitsecs: int, environ: Mapping[str, str]) -> ProgramSpec:
    return shim_spec(model, replica, port, stopwaitsecs, environ, argv(model, SHIM_HOST, port, stopwaitsecs),
                     DEFAULT_START_TIMEOUT_S, METRICS)


# No values its server refuses beyond the schema's rules, no settings known to work against the pool.
option_problems = warnings = none_known
