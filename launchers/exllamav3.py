"""ExLlamaV3 (EXL3) models (shims/exllamav3.py) as supervisord programs; every `exllama_*` field."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from launchers.common import SHIM_HOST, none_known, shim_argv, shim_problems, shim_spec
from launchers.gguf_header import is_gguf
from launchers.options import Options, setting
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


@dataclass(frozen=True)
class Exllamav3Options(Options):
    """An EXL3 model's fields (conf/schema.json: `exllama_*`, `exllamav3_python`), read once."""

    PREFIX = "exllama_"

    cache_size: int | None = None
    cache_quant: str | int | None = None
    gpu_split: tuple[float, ...] | None = setting(convert=tuple)
    tensor_parallel: bool | None = None
    tp_backend: str | None = None
    max_batch_size: int | None = None
    max_chunk_size: int | None = None
    max_q_size: int | None = None
    max_rq_tokens: int | None = None
    python: str | None = setting(key=PYTHON_FIELD)   # the shim's interpreter; None: the proxy's own
    prompt_format: str = setting("generic", key="prompt_format")
    model_path: str | None = setting(key="model_path")
    enable_thinking: bool | None = setting(key="enable_thinking")


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
    opts = Exllamav3Options.from_config(model)
    return shim_problems(model, opts.model_path, "exllamav3", PYTHON_FIELD, opts.python, "exllamav3",
                         model_folder_problem)


def argv(model: ModelConfig, host: str, port: int, stopwaitsecs: int) -> tuple[str, ...]:
    opts = Exllamav3Options.from_config(model)
    args = shim_argv(model, opts.model_path, opts.python, "exllamav3", host, port, stopwaitsecs)
    args += ["--prompt-format", str(opts.prompt_format),
             # The continuous-batching generator runs every request the scheduler sends together.
             "--max-concurrency", str(model.target_inflight)]
    for key, flag in FLAGS:
        if opts.value(key) is not None:
            args += [flag, str(opts.value(key))]
    if opts.gpu_split:
        args += ["--gpu-split", ",".join(repr(float(x)) for x in opts.gpu_split)]
    if opts.tensor_parallel is not None:
        args += ["--tensor-parallel", str(bool(opts.tensor_parallel)).lower()]
    if opts.enable_thinking is not None:
        args += ["--enable-thinking", str(bool(opts.enable_thinking)).lower()]
    return tuple(args)


def launch(model: ModelConfig, replica: int, port: int, stopwaitsecs: int, environ: Mapping[str, str]) -> ProgramSpec:
    return shim_spec(model, replica, port, stopwaitsecs, environ, argv(model, SHIM_HOST, port, stopwaitsecs),
                     DEFAULT_START_TIMEOUT_S, METRICS)


# No values its server refuses beyond the schema's rules, no settings known to work against the pool.
option_problems = warnings = none_known
