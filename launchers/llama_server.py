"""llama.cpp's llama-server: every `llama_server_*` field mapped to the flag of the pinned build.

Flag names were checked against `llama-server --help` of the llama.cpp tree vendored in
llama-cpp-python 0.3.36 (LLAMA_CPP_PYTHON_VERSION in proxy/setup/paths.py, built by
proxy/setup/llama_build.py); tests/launchers checks every flag and every enumerated value against
the built binary. At config time, the values of enumerated fields are
checked against the binary that will run them (launchers/llama_help.py), and so are the options of
`llama_server_extra_args`: a value or an option it refuses is a config error listing what it
accepts, not a failed load.
"""
from __future__ import annotations

import difflib
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

from launchers.common import gguf_problem, library_env, managed_flag_problem, model_file_problems
from launchers.gguf_header import declared_pooling, lora_problem
from launchers.llama_help import HelpUnavailable, Option, choices, help_text, options
from launchers.options import Options, setting, strings
from launchers.spec import Adapters, EngineMetrics, ProgramSpec, program_name
from proxy.capabilities import Traits
from proxy.config.model import ModelConfig
from proxy.setup.paths import cache_root, cached_llama_server

# (config field, flag): scalar fields that map one to one, in the order they are emitted.
# llama_server_n_ctx is not here: it is per request, and becomes --ctx-size times the slots.
FLAGS = (
    ("llama_server_n_gpu_layers", "--n-gpu-layers"),
    ("llama_server_flash_attn", "--flash-attn"),
    ("llama_server_mmproj_path", "--mmproj"),
    ("llama_server_image_max_tokens", "--image-max-tokens"),
    ("llama_server_draft_model_path", "--spec-draft-model"),
    ("llama_server_spec_type", "--spec-type"),
    ("llama_server_spec_draft_n_max", "--spec-draft-n-max"),
    ("llama_server_spec_draft_p_min", "--spec-draft-p-min"),
    ("llama_server_spec_draft_ngl", "--spec-draft-ngl"),
    ("llama_server_reasoning", "--reasoning-format"),
    ("llama_server_pooling", "--pooling"),
    ("llama_server_media_path", "--media-path"),
)
# Switches: the flag is given when the field is true. `--reranking` is also `--embeddings` plus
# `--pooling rank` in the pinned build (common/arg.cpp), and /v1/rerank answers only with both.
SWITCHES = (("llama_server_embeddings", "--embeddings"), ("llama_server_reranking", "--reranking"))
# The field behind each flag argv gives besides FLAGS and SWITCHES (None: llm-pool sets it for
# itself), named when llama_server_extra_args gives one again. Which flags a model's argv gives is
# read from argv itself (managed_flags), so a flag added there is caught without an edit here.
FIXED_FLAGS: dict[str, str | None] = {
    "--model": "model_path", "--host": "llama_server_host", "--port": "llama_server_port", "--alias": None,
    "--parallel": "target_inflight", "--metrics": None, "--no-webui": None, "--ctx-size": "llama_server_n_ctx",
    "--kv-unified": "llama_server_n_ctx", "--reasoning": "enable_thinking",
}
# Fields whose value must be one the binary lists for the flag; checked against the binary's --help.
ENUM_FIELDS = (("llama_server_flash_attn", "--flash-attn"), ("llama_server_spec_type", "--spec-type"),
               ("llama_server_reasoning", "--reasoning-format"), ("llama_server_pooling", "--pooling"))
# The seed's speculative types, named as llama.cpp named them before the pinned build, mapped to its
# names (`draft` is `draft-simple` there; the binary refuses the old name).
SPEC_TYPE_NAMES = {"draft": "draft-simple", "eagle3": "draft-eagle3", "mtp": "draft-mtp", "dflash": "draft-dflash",
                   "dspark": "draft-dspark"}
# The pooling embeddings get when llama_server_pooling is unset and the GGUF declares none: with
# llama-server's `none`, every /v1/embeddings answers 400 "Pooling type 'none' is not OAI compatible".
DEFAULT_EMBEDDINGS_POOLING = "mean"
# What the backend can do (proxy/capabilities.py reads it; nothing else names the backend).
TRAITS = Traits(multi_turn=True, thinking="template", embeddings_field="llama_server_embeddings",
                repetition_field="repeat_penalty", rerank_field="llama_server_reranking",
                apis=frozenset({"chat", "completions", "embeddings", "messages", "count_tokens", "rerank", "infill",
                                "tokenize"}), usage_on_request=True)
# Runtime knobs an admin may change for one load without editing files (seed: "Live admin overrides").
LOAD_OVERRIDES = ("llama_server_n_ctx", "llama_server_image_max_tokens", "llama_server_spec_type",
                  "llama_server_spec_draft_n_max", "llama_server_spec_draft_p_min")
METRICS = EngineMetrics(running="llamacpp:requests_processing", waiting="llamacpp:requests_deferred",
                        kv_cache="llamacpp:kv_cache_usage_ratio")


@dataclass(frozen=True)
class LlamaServerOptions(Options):
    """Every `llama_server_*` field of a model (conf/schema.json), read once, and the model's own
    fields llama-server is given."""

    PREFIX = "llama_server_"

    binary: str | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    library_path: tuple[str, ...] = setting((), convert=strings)
    n_ctx: int | None = None                  # per request: --ctx-size is this times the slots
    n_gpu_layers: str | int | None = None
    flash_attn: str | None = None
    mmproj_path: str | None = None
    image_max_tokens: int | None = None
    draft_model_path: str | None = None
    spec_type: str | None = None
    spec_draft_n_max: int | None = None
    spec_draft_p_min: float | None = None
    spec_draft_ngl: str | int | None = None
    reasoning: str | None = None
    embeddings: bool | None = None
    reranking: bool = False
    pooling: str | None = None
    media_path: str | None = None
    extra_args: tuple[str, ...] = setting((), convert=strings)
    start_timeout_s: float = setting(120.0, convert=float)
    model_path: str | None = setting(key="model_path")
    enable_thinking: bool | None = setting(key="enable_thinking")


def binary(model: ModelConfig) -> str:
    """The configured binary, else llama-server on PATH, else the build `llm-pool setup` caches."""
    return _binary(LlamaServerOptions.from_config(model))


def _binary(opts: LlamaServerOptions) -> str:
    if opts.binary:
        return opts.binary
    return shutil.which("llama-server") or str(cached_llama_server())


def device(model: ModelConfig) -> tuple[str, str]:
    """Where a replica's memory is (placement: cpu or gpu), and the field that says so."""
    layers = LlamaServerOptions.from_config(model).n_gpu_layers
    if layers is not None and int(layers) == 0:
        return "cpu", "llama_server_n_gpu_layers: 0"
    return "gpu", ("llama_server_n_gpu_layers: " + str(layers)) if layers is not None else \
        "llama_server_n_gpu_layers unset: llama-server offloads the layers to a GPU"


def check(model: ModelConfig) -> list[str]:
    """Problems that would stop this model from starting, each naming the field and the path."""
    where = f"engine.models.{model.name}"
    opts = LlamaServerOptions.from_config(model)
    problems = []
    exe = _binary(opts)
    if not (Path(exe).is_file() and os.access(exe, os.X_OK)):
        hint = "" if opts.binary else " (run `llm-pool setup` to build it)"
        return [f"{where}.llama_server_binary: {exe} does not exist or is not executable{hint}"]
    def judge(path: Path) -> str | None:
        return gguf_problem(path, model.backend)

    for key in ("model_path", "llama_server_mmproj_path", "llama_server_draft_model_path"):
        problems += model_file_problems(where, key, opts.value(key), judge)
    for adapter in model.adapters:
        field = f"{where}.lora_adapters.{adapter.name}.path"
        if "," in adapter.path or ":" in adapter.path:
            # llama-server splits a --lora-scaled value at commas and colons: the path would be cut.
            problems.append(f"{field}: {adapter.path} has a comma or a colon, which llama-server's --lora-scaled "
                            "reads as separators")
        elif opts.model_path and Path(opts.model_path).is_file():
            problem = lora_problem(Path(opts.model_path), Path(adapter.path))
            if problem is not None:
                problems.append(f"{field}: {problem}")
    media = opts.media_path
    if media and not Path(media).is_dir():
        problems.append(f"{where}.llama_server_media_path: {media} is not a folder")
    if opts.reranking and opts.pooling not in (None, "rank"):
        # --reranking sets the pooling to rank after --pooling, so the configured one would be dropped.
        problems.append(f"{where}.llama_server_pooling: {opts.pooling!r} cannot serve llama_server_reranking, "
                        f"which pools by rank; leave it unset or set it to rank")
    return problems + _option_problems(model, opts)


def option_problems(model: ModelConfig) -> list[str]:
    """Values and extra arguments the binary would refuse at start, each with what it accepts (from its --help)."""
    return _option_problems(model, LlamaServerOptions.from_config(model))


def _option_problems(model: ModelConfig, opts: LlamaServerOptions) -> list[str]:
    wanted = [(key, flag, _flag_value(key, opts.value(key))) for key, flag in ENUM_FIELDS
              if opts.value(key) is not None]
    extra = list(opts.extra_args)
    if not wanted and not extra:
        return []
    exe = _binary(opts)
    try:
        known = options(help_text(exe, cache_root()))
    except HelpUnavailable as exc:
        return [f"engine.models.{model.name}.llama_server_binary: cannot read what it accepts: {exc}"]
    problems = []
    for key, flag, value in wanted:
        option = known.get(flag)
        if option is None:
            problems.append(f"engine.models.{model.name}.{key}: {exe} has no {flag} option")
            continue
        accepted = choices(option)
        given = value.split(",") if flag == "--spec-type" else [value]
        refused = [v for v in given if accepted is not None and v not in accepted]
        if refused:
            problems.append(f"engine.models.{model.name}.{key}: {opts.value(key)!r} is not accepted by {exe} "
                            f"({flag} {', '.join(refused)}); it accepts: {', '.join(sorted(accepted or ()))}")
    return problems + extra_args_problems(f"engine.models.{model.name}.llama_server_extra_args", extra, exe, known,
                                          _managed_flags(model, opts, known))


def managed_flags(model: ModelConfig, known: Mapping[str, Option]) -> dict[str, tuple[str, str | None]]:
    """Each flag llm-pool's own argv gives this model, under every name the binary has for it (`-c`
    is `--ctx-size`): the flag as argv gives it, and the field behind it."""
    return _managed_flags(model, LlamaServerOptions.from_config(model), known)


def _managed_flags(model: ModelConfig, opts: LlamaServerOptions,
                   known: Mapping[str, Option]) -> dict[str, tuple[str, str | None]]:
    fields = {**FIXED_FLAGS, **{flag: key for key, flag in FLAGS + SWITCHES}}
    own = _argv(model, replace(opts, extra_args=()), "127.0.0.1", 0)
    managed: dict[str, tuple[str, str | None]] = {}
    for flag in own[1:]:
        if re.match(r"--?[A-Za-z]", flag):
            option = known.get(flag)
            managed.update((name, (flag, fields.get(flag))) for name in (option.flags if option else (flag,)))
    return managed


def extra_args_problems(where: str, extra: list[str], exe: str, known: Mapping[str, Option],
                        managed: Mapping[str, tuple[str, str | None]] | None = None) -> list[str]:
    """Options of `llama_server_extra_args` the binary does not have: it would exit at start with
    `invalid argument`; and options `managed` (managed_flags) says llm-pool gives already, which
    llama-server would take from the extra argument, the last one given. Each option's values (as
    many as its --help hint names) are skipped, so a value such as `-1` is never taken for an
    option; a stray value is left to llama-server."""
    problems = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        i += 1
        if not re.match(r"--?[A-Za-z]", arg):
            continue
        option = known.get(arg)
        name, _, value = arg.partition("=")
        if managed and name in managed:
            problems.append(managed_flag_problem(where, name, *managed[name], "llama-server"))
            i += option.nargs if option is not None else 0
            continue
        if option is not None:
            i += option.nargs
            continue
        if value and name in known:
            # The pinned build reads `--threads 8` and refuses `--threads=8`.
            # The value is not repeated: it may be a secret (`--api-key=...`).
            problems.append(f"{where}: {exe} does not read {name}=<value>; give the value as the next item: "
                            f"{name}, <value>")
            continue
        same_kind = [flag for flag in known if flag.startswith("--") == arg.startswith("--")]
        close = difflib.get_close_matches(arg, same_kind, n=1, cutoff=0.8)
        hint = f"; did you mean {close[0]}?" if close else ""
        problems.append(f"{where}: {arg} is not an option of {exe}{hint}")
    return problems


def _flag_value(key: str, value: object) -> str:
    if key == "llama_server_spec_type":
        return ",".join(SPEC_TYPE_NAMES.get(v.strip(), v.strip()) for v in str(value).split(","))
    if isinstance(value, float):
        return repr(value)
    return str(value)


def ctx_args(model: ModelConfig, opts: LlamaServerOptions) -> list[str]:
    """llama_server_n_ctx is the context of one request. llama-server splits --ctx-size over its
    --parallel slots, so the total is n_ctx times the slots; unset (or 0), every slot may use the
    model's whole trained context from one shared (unified) KV cache."""
    if not opts.n_ctx:
        return ["--kv-unified"]
    return ["--ctx-size", str(int(opts.n_ctx) * model.target_inflight)]


def pooling(opts: LlamaServerOptions) -> str | None:
    """The --pooling value: the configured one; with embeddings on and none configured, the GGUF's
    own when it declares one that serves OAI embeddings, else DEFAULT_EMBEDDINGS_POOLING; None for
    no flag (embeddings off, reranking on, which pools by rank itself, or a model file that cannot
    be read, which fails its load anyway)."""
    configured = opts.pooling
    if configured is not None or not opts.embeddings or opts.reranking:
        return None if configured is None else str(configured)
    declared = declared_pooling(Path(str(opts.model_path)))
    return DEFAULT_EMBEDDINGS_POOLING if declared in ("", "none") else None


def argv(model: ModelConfig, host: str, port: int) -> tuple[str, ...]:
    return _argv(model, LlamaServerOptions.from_config(model), host, port)


def _argv(model: ModelConfig, opts: LlamaServerOptions, host: str, port: int) -> tuple[str, ...]:
    args = [_binary(opts), "--model", str(opts.model_path), "--host", host, "--port", str(port),
            "--alias", model.name,
            # One slot per request the scheduler may send at once, so none waits inside llama-server.
            "--parallel", str(model.target_inflight),
            # /metrics feeds replica routing (running, deferred, KV-cache use).
            "--metrics", "--no-webui", *ctx_args(model, opts)]
    for key, flag in FLAGS:
        value = pooling(opts) if key == "llama_server_pooling" else opts.value(key)
        if value is not None:
            args += [flag, _flag_value(key, value)]
    args += [flag for key, flag in SWITCHES if opts.value(key)]
    if opts.enable_thinking is not None:
        args += ["--reasoning", "on" if opts.enable_thinking else "off"]
    for adapter in model.adapters:
        # Each its own flag (llama-server appends them; their order is their ids), at a global scale
        # of 0: a request that names none is the base model's, an adapter's names it with its
        # scale (spec.Adapters).
        args += ["--lora-scaled", f"{adapter.path}:0"]
    args += opts.extra_args
    return tuple(args)


PORT_FIELD = "llama_server_port"


def launch(model: ModelConfig, replica: int, port: int, stopwaitsecs: int, environ: Mapping[str, str]) -> ProgramSpec:
    opts = LlamaServerOptions.from_config(model)
    host = opts.host
    return ProgramSpec(
        program=program_name(model.name, replica),
        argv=_argv(model, opts, host, port),
        env=library_env(model, opts.library_path, environ),
        host=host,
        port=port,
        health_path="/health",
        models_path="/v1/models",
        served_model=model.name,
        start_timeout_s=opts.start_timeout_s,
        stopwaitsecs=stopwaitsecs,
        metrics=METRICS,
        closes_after_streams=True,
        adapters=Adapters(scales=tuple((a.name, a.scale) for a in model.adapters)) if model.adapters else None,
    )


def warnings(model: ModelConfig) -> list[str]:
    """Settings that load but work against the pool (none known for this backend)."""
    return []
