"""GGUF models through llama-cpp-python (shims/llama_cpp.py) as supervisord programs.

`gguf_n_gpu_layers`, `gguf_n_ctx`, `gguf_flash_attn`, `gguf_type_k`, `gguf_type_v`, `prompt_format`.
One request at a time per replica (a `Llama` is not thread-safe): the schema holds `target_inflight`
to 1, and throughput comes from `replicas`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from launchers.common import SHIM_HOST, gguf_problem, none_known, shim_argv, shim_problems, shim_spec
from launchers.options import Options, setting
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


@dataclass(frozen=True)
class LlamaCppOptions(Options):
    """A llama-cpp-python model's fields (conf/schema.json: `gguf_*`, `llama_cpp_python`), read once."""

    PREFIX = "gguf_"

    n_gpu_layers: int | None = None
    n_ctx: int | None = None
    flash_attn: str | bool | None = None
    type_k: str | None = None
    type_v: str | None = None
    python: str | None = setting(key=PYTHON_FIELD)   # the shim's interpreter; None: the proxy's own
    prompt_format: str | None = setting(key="prompt_format")   # None: the GGUF's own chat template
    model_path: str | None = setting(key="model_path")
    enable_thinking: bool | None = setting(key="enable_thinking")


def device(model: ModelConfig) -> tuple[str, str]:
    """Where a replica's memory is (placement: cpu or gpu), and the field that says so."""
    layers = LlamaCppOptions.from_config(model).n_gpu_layers
    if not layers:
        return "cpu", "gguf_n_gpu_layers: 0 or unset (llama-cpp-python keeps every layer on the CPU)"
    return "gpu", f"gguf_n_gpu_layers: {layers}"


def check(model: ModelConfig) -> list[str]:
    def judge(path: Path) -> str | None:
        return gguf_problem(path, model.backend)

    opts = LlamaCppOptions.from_config(model)
    return shim_problems(model, opts.model_path, "llama_cpp", PYTHON_FIELD, opts.python, "llama_cpp", judge)


def argv(model: ModelConfig, host: str, port: int, stopwaitsecs: int) -> tuple[str, ...]:
    opts = LlamaCppOptions.from_config(model)
    args = shim_argv(model, opts.model_path, opts.python, "llama_cpp", host, port, stopwaitsecs)
    for key, flag in FLAGS:
        if opts.value(key) is not None:
            args += [flag, str(opts.value(key))]
    flash = opts.flash_attn
    if flash is not None:
        args += ["--flash-attn", ("on" if flash else "off") if isinstance(flash, bool) else str(flash)]
    # Without prompt_format the GGUF's own chat template renders chat (the shim falls back to generic).
    if opts.prompt_format:
        args += ["--prompt-format", str(opts.prompt_format)]
    if opts.enable_thinking is not None:
        args += ["--enable-thinking", str(bool(opts.enable_thinking)).lower()]
    return tuple(args)


def launch(model: ModelConfig, replica: int, port: int, stopwaitsecs: int, environ: Mapping[str, str]) -> ProgramSpec:
    return shim_spec(model, replica, port, stopwaitsecs, environ, argv(model, SHIM_HOST, port, stopwaitsecs),
                     DEFAULT_START_TIMEOUT_S, METRICS)


# No values its server refuses beyond the schema's rules, no settings known to work against the pool.
option_problems = warnings = none_known
