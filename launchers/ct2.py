"""CTranslate2 models (shims/ct2.py) as supervisord programs: `device`, `compute_type`, `prompt_format`."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from launchers.common import SHIM_HOST, none_known, shim_argv, shim_problems, shim_spec
from launchers.gguf_header import is_gguf
from launchers.spec import EngineMetrics, ProgramSpec
from proxy.capabilities import Traits
from proxy.config.model import ModelConfig
from shims.ct2 import TOKENIZER_FILE, model_kind

PORT_FIELD = "ct2_port"
PYTHON_FIELD = "ct2_python"
# What the backend can do (proxy/capabilities.py reads it; nothing else names the backend).
TRAITS = Traits(beam_search=True)  # one prompt in, one answer out: single-turn
LOAD_OVERRIDES = ("compute_type",)
DEFAULT_START_TIMEOUT_S = 300.0
DEFAULT_COMPUTE_TYPE = "int8"       # the seed's default
METRICS = EngineMetrics(running="vllm:num_requests_running", waiting="vllm:num_requests_waiting",
                        kv_cache="vllm:kv_cache_usage_perc")


def model_folder_problem(path: Path) -> str | None:
    """Why `path` is not a converted CTranslate2 folder the shim can serve (the shim's own rule), or None."""
    if path.is_dir():
        try:
            model_kind(path)
        except ValueError as exc:
            return str(exc)
        return None
    what, instead = ("a GGUF file", "; a GGUF runs on backend llama_server or llama_cpp") if is_gguf(path) \
        else ("a file", "")
    return (f"{path} is {what}; backend 'ct2' needs a CTranslate2 model folder (model.bin, a vocabulary, "
            f"{TOKENIZER_FILE}){instead}")


def device(model: ModelConfig) -> tuple[str, str]:
    """Where a replica's memory is (placement: cpu or gpu), and the field that says so."""
    value = str(model.get("device", "cpu"))
    return ("gpu" if value.startswith("cuda") else "cpu"), f"device: {value}"


def check(model: ModelConfig) -> list[str]:
    return shim_problems(model, "ctranslate2", PYTHON_FIELD, "ct2", model_folder_problem)


def argv(model: ModelConfig, host: str, port: int, stopwaitsecs: int) -> tuple[str, ...]:
    args = shim_argv(model, PYTHON_FIELD, "ct2", host, port, stopwaitsecs)
    args += ["--device", str(model.get("device", "cpu")),
             "--compute-type", str(model.get("compute_type", DEFAULT_COMPUTE_TYPE)),
             "--prompt-format", str(model.get("prompt_format", "generic")),
             # One CT2 worker per request the scheduler may send at once, so none waits behind another.
             "--max-concurrency", str(model.target_inflight)]
    if model.get("enable_thinking") is not None:
        args += ["--enable-thinking", str(bool(model.get("enable_thinking"))).lower()]
    return tuple(args)


def launch(model: ModelConfig, replica: int, port: int, stopwaitsecs: int, environ: Mapping[str, str]) -> ProgramSpec:
    return shim_spec(model, replica, port, stopwaitsecs, environ, argv(model, SHIM_HOST, port, stopwaitsecs),
                     DEFAULT_START_TIMEOUT_S, METRICS)


# No values its server refuses beyond the schema's rules, no settings known to work against the pool.
option_problems = warnings = none_known
