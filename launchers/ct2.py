"""CTranslate2 models (shims/ct2.py) as supervisord programs: `device`, `compute_type`, `prompt_format`."""
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
from shims.ct2 import TOKENIZER_FILE, model_kind

PORT_FIELD = "ct2_port"
PYTHON_FIELD = "ct2_python"
# What the backend can do (proxy/capabilities.py reads it; nothing else names the backend).
TRAITS = Traits(beam_search=True)  # one prompt in, one answer out: single-turn
LOAD_OVERRIDES = ("compute_type",)
DEFAULT_START_TIMEOUT_S = 300.0
METRICS = EngineMetrics(running="vllm:num_requests_running", waiting="vllm:num_requests_waiting",
                        kv_cache="vllm:kv_cache_usage_perc")


@dataclass(frozen=True)
class Ct2Options(Options):
    """A CTranslate2 model's fields (conf/schema.json: `ct2_*`, `device`, `compute_type`), read once."""

    PREFIX = "ct2_"

    python: str | None = None                         # the shim's interpreter; None: the proxy's own
    device: str = setting("cpu", key="device")
    compute_type: str = setting("int8", key="compute_type")   # the seed's default
    prompt_format: str = setting("generic", key="prompt_format")
    model_path: str | None = setting(key="model_path")
    enable_thinking: bool | None = setting(key="enable_thinking")


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
    value = str(Ct2Options.from_config(model).device)
    return ("gpu" if value.startswith("cuda") else "cpu"), f"device: {value}"


def check(model: ModelConfig) -> list[str]:
    opts = Ct2Options.from_config(model)
    return shim_problems(model, opts.model_path, "ctranslate2", PYTHON_FIELD, opts.python, "ct2", model_folder_problem)


def argv(model: ModelConfig, host: str, port: int, stopwaitsecs: int) -> tuple[str, ...]:
    opts = Ct2Options.from_config(model)
    args = shim_argv(model, opts.model_path, opts.python, "ct2", host, port, stopwaitsecs)
    args += ["--device", str(opts.device),
             "--compute-type", str(opts.compute_type),
             "--prompt-format", str(opts.prompt_format),
             # One CT2 worker per request the scheduler may send at once, so none waits behind another.
             "--max-concurrency", str(model.target_inflight)]
    if opts.enable_thinking is not None:
        args += ["--enable-thinking", str(bool(opts.enable_thinking)).lower()]
    return tuple(args)


def launch(model: ModelConfig, replica: int, port: int, stopwaitsecs: int, environ: Mapping[str, str]) -> ProgramSpec:
    return shim_spec(model, replica, port, stopwaitsecs, environ, argv(model, SHIM_HOST, port, stopwaitsecs),
                     DEFAULT_START_TIMEOUT_S, METRICS)


# No values its server refuses beyond the schema's rules, no settings known to work against the pool.
option_problems = warnings = none_known
