"""Approximate memory a model needs (on its GPU, or on the CPU), from its files and its configured
context: loaded or not.

Weights are what the model's files weigh (a GGUF file, the safetensors of a Hugging Face or EXL3
folder, CTranslate2's model.bin, plus a draft model or a vision projector when configured). The KV
cache is computed where the files tell the architecture (GGUF metadata, config.json) and the config
tells the context, or taken from vLLM's explicit `vllm_kv_cache_memory_bytes`. Each estimate lists
what it counted and what it could not, so nobody mistakes a lower bound for the whole story.
For llama-server the compute buffers are counted too (from the GGUF's sizes and the batch it
reserves for), and on the CPU the server process itself (its code, libraries and threads), which
for a small model is most of what it holds: the demo model was estimated at 1.5 MiB against 14
measured before these were counted (issue 29). Engine workspace, CUDA graphs and the CUDA context
are not counted.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.config.model import ModelConfig

MIB = 1024 * 1024
# The model's main weights come from the first of these that names an existing file or folder.
MAIN_WEIGHT_FIELDS = ("model_path", "vllm_model")
# Other weights a replica holds: a draft model for speculative decoding, a vision projector.
EXTRA_WEIGHT_FIELD = re.compile(r"_(?:draft_model_path|mmproj_path|speculative_model)$")
# The configured context, in the order a backend's field is looked for; 0 or null means the
# model's own context length (llama-server's --ctx-size 0 does that).
CONTEXT_FIELDS = ("llama_server_n_ctx", "gguf_n_ctx", "vllm_max_model_len", "exllama_cache_size")
# Bytes per KV element by cache type name (llama.cpp's quantised types carry a block scale).
KV_TYPE_BYTES = {"f32": 4.0, "float32": 4.0, "f16": 2.0, "float16": 2.0, "half": 2.0, "bf16": 2.0,
                 "bfloat16": 2.0, "auto": 2.0, "q8_0": 34 / 32, "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0,
                 "q5_1": 24 / 32, "q5_0": 22 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}
SPLIT_GGUF = re.compile(r"-\d{5}-of-(\d{5})\.gguf$")
DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "float8": 1.0}
# llama-server's micro-batch (-ub, its default): the compute graph is reserved for this many tokens.
LLAMA_UBATCH = 512
# What a llama-server process holds besides the model: code, libraries, thread stacks, HTTP buffers.
# Measured on the pinned build (llama-cpp-python 0.3.36's tree, x86-64, 2 cores): the tiny GGUF with
# 2,048 tokens had 18.1 MiB resident after a request, 4.5 of them its weights, KV cache and compute
# buffer, so about 14 MiB is the process; counted as 16 for the threads a machine with more cores
# starts (one per core).
LLAMA_SERVER_PROCESS_BYTES = 16 * MIB


@dataclass
class Estimate:
    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    compute_bytes: int = 0        # the engine's compute and output buffers
    process_bytes: int = 0        # the engine process itself (counted on the CPU only)
    counted: list[str] = field(default_factory=list)
    not_counted: list[str] = field(default_factory=list)
    # The weight files or folders the settings name that do not exist (`model_path /m/x.gguf`): the
    # estimate of such a model is not what it needs, and a load of it fails.
    missing: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.compute_bytes + self.process_bytes

    def as_dict(self, replicas: int) -> dict[str, Any]:
        return {"weights_mib": _mib(self.weights_bytes), "kv_cache_mib": _mib(self.kv_cache_bytes),
                "compute_mib": _mib(self.compute_bytes), "process_mib": _mib(self.process_bytes),
                "per_replica_mib": _mib(self.total_bytes), "replicas": replicas,
                "total_mib": _mib(self.total_bytes * replicas),
                "counted": self.counted, "not_counted": self.not_counted}


@dataclass(frozen=True)
class Architecture:
    """What the KV cache size depends on: per layer, KV heads times (key + value) head size."""

    source: str
    layers: int
    kv_width: int                 # sum over layers of kv_heads * (key_length + value_length)
    context_length: int | None    # the model's own maximum context
    dtype_bytes: float | None = None
    embedding: int | None = None  # what llama.cpp's compute buffers are sized by
    vocab: int | None = None
    feed_forward: int | None = None
    heads: int | None = None


class Estimator:
    """Estimates for models; parsed file metadata is kept per (path, size, mtime), since a large
    GGUF's header takes a while to read and the files rarely change."""

    def __init__(self) -> None:
        self._arch: dict[tuple[str, int, int], Architecture | str] = {}

    def estimate(self, model: ModelConfig, on_cpu: bool = False) -> Estimate:
        """`on_cpu`: the model runs on the CPU, where the engine's own process counts too."""
        est = Estimate()
        main = _main_weights(model)
        if main is None:
            est.missing += missing_weights(model)
            est.not_counted.append(f"weights: {', '.join(est.missing)} does not exist" if est.missing else
                                   "weights: no local model file or folder configured "
                                   f"({' or '.join(MAIN_WEIGHT_FIELDS)})")
        else:
            key, path = main
            est.weights_bytes += _weigh(path, key, est)
            arch = self._architecture(path)
            self._kv_cache(model, arch, est)
            if model.backend == "llama_server":
                _llama_buffers(model, arch, est)
        if model.backend == "llama_server" and on_cpu:
            est.process_bytes = LLAMA_SERVER_PROCESS_BYTES
            est.counted.append(f"the llama-server process itself: {_mib(LLAMA_SERVER_PROCESS_BYTES)} MiB "
                               "(code, libraries, threads; measured on the pinned build)")
        for key, value in sorted(model.options.items()):
            if EXTRA_WEIGHT_FIELD.search(key) and isinstance(value, str) and _local(value):
                est.weights_bytes += _weigh(Path(value), key, est)
        for adapter in model.adapters:
            # Every replica holds each of its adapters (llama-server from its start, vLLM in its cache).
            path = Path(adapter.path)
            if path.exists():
                est.weights_bytes += _weigh(path, f"lora_adapters.{adapter.name}", est)
            else:
                est.not_counted.append(f"weights: lora_adapters.{adapter.name} {path} does not exist")
        return est

    def _architecture(self, path: Path) -> Architecture | str:
        target = _gguf_file(path) or path / "config.json"
        try:
            st = target.stat()
        except OSError:
            return f"no GGUF file or config.json at {path}"
        cache_key = (str(target), st.st_size, st.st_mtime_ns)
        if cache_key not in self._arch:
            self._arch[cache_key] = gguf_architecture(target) if target.suffix == ".gguf" \
                else hf_architecture(target)
        return self._arch[cache_key]

    def _kv_cache(self, model: ModelConfig, arch: Architecture | str, est: Estimate) -> None:
        explicit = model.options.get("vllm_kv_cache_memory_bytes")
        if explicit:
            est.kv_cache_bytes = int(explicit)
            est.counted.append(f"KV cache: vllm_kv_cache_memory_bytes = {int(explicit)}")
            return
        if isinstance(arch, str):
            est.not_counted.append(f"KV cache: {arch}")
            return
        found = _context(model, arch)
        if found is None:
            est.not_counted.append(f"KV cache: no context configured and none in {arch.source}")
            return
        ctx, ctx_field = found
        type_name, elem = _kv_type(model, arch)
        est.kv_cache_bytes = int(ctx * arch.kv_width * elem)
        est.counted.append(f"KV cache: {ctx} tokens ({ctx_field}) x {arch.layers} layers x "
                           f"{arch.kv_width // max(arch.layers, 1)} K+V values per token and layer x "
                           f"{elem:g} bytes ({type_name}), from {arch.source}")
        if "vllm_gpu_memory_utilization" in model.options and model.options["vllm_gpu_memory_utilization"]:
            est.not_counted.append("vLLM reserves vllm_gpu_memory_utilization of the GPU for its KV cache; "
                                   "the estimate is one sequence at full context")


def _context(model: ModelConfig, arch: Architecture) -> tuple[int, str] | None:
    """The tokens the engine's KV cache holds, all slots together, and where that comes from."""
    ctx_field, ctx = configured_context(model)
    if not ctx:
        if arch.context_length is None:
            return None
        ctx, ctx_field = arch.context_length, f"the model's context_length from {arch.source}"
    if ctx_field == "llama_server_n_ctx" and model.target_inflight > 1:
        # It is one request's context: llama-server gets --ctx-size n_ctx times its slots.
        ctx, ctx_field = ctx * model.target_inflight, f"{ctx_field} x {model.target_inflight} slots"
    return ctx, ctx_field


def _llama_buffers(model: ModelConfig, arch: Architecture | str, est: Estimate) -> None:
    """llama.cpp's compute buffer (its graph reserved for one micro-batch) and output buffer (the
    logits of each slot), from the GGUF's sizes.

    As the pinned build reserves them (its log's `CPU compute buffer size`, matched to within 0.3
    MiB for the tiny GGUF from 2,048 to 524,288 tokens, flash attention on and off): the micro-batch's
    logits or feed-forward, whichever is larger, a few embeddings, and the attention over the
    cache a sequence sees (a slot's context, or the whole cache when it is unified): its mask (f16)
    with flash attention, else the scores of every head and the mask (f32). Flash attention `auto`
    is on for this build's CPU and CUDA backends."""
    if isinstance(arch, str):
        est.not_counted.append(f"compute buffers: {arch}")
        return
    found = _context(model, arch)
    if found is None or not (arch.embedding and arch.vocab and arch.feed_forward and arch.heads):
        est.not_counted.append(f"compute buffers: {arch.source} gives no embedding, vocabulary, feed-forward "
                               "and head sizes")
        return
    per_request = model.options.get("llama_server_n_ctx")
    seen = int(per_request) if per_request else found[0]    # unset: one unified cache for every slot
    ubatch = min(LLAMA_UBATCH, found[0])
    flash = str(model.options.get("llama_server_flash_attn") or "auto").lower()
    compute = 4 * ubatch * max(arch.vocab, 3 * arch.feed_forward) + 8 * ubatch * arch.embedding
    compute += 4 * ubatch * seen * (arch.heads + 1) if flash in ("off", "false", "0") else 2 * ubatch * seen
    output = 4 * arch.vocab * max(1, model.target_inflight)
    est.compute_bytes = compute + output
    est.counted.append(f"compute buffers: {_mib(compute)} MiB for a micro-batch of {ubatch} tokens over "
                       f"{seen} of cache (flash attention {flash}), output buffer {_mib(output)} MiB for "
                       f"{model.target_inflight} slot(s), from {arch.source}")


def _mib(n: float) -> float:
    return round(n / MIB, 1)


def _local(value: str) -> bool:
    path = Path(value).expanduser()
    return path.is_absolute() and path.exists()


def _main_weights(model: ModelConfig) -> tuple[str, Path] | None:
    for key in MAIN_WEIGHT_FIELDS:
        value = model.options.get(key)
        if isinstance(value, str) and _local(value):
            return key, Path(value).expanduser()
    return None


def missing_weights(model: ModelConfig) -> list[str]:
    """The main weight fields that name a path (absolute, as the settings resolve a model_path) where
    nothing is; a repository id (`Qwen/Qwen3-0.6B`) is no path."""
    return [f"{key} {value}" for key in MAIN_WEIGHT_FIELDS if isinstance(value := model.options.get(key), str)
            and Path(value).expanduser().is_absolute() and not Path(value).expanduser().exists()]


def _weigh(path: Path, key: str, est: Estimate) -> int:
    """Bytes of the weight files at `path` (a file, or a model folder), noting what was counted."""
    if path.is_file():
        split = SPLIT_GGUF.search(path.name)
        # A split GGUF is named by its first part; llama.cpp loads every part.
        files = sorted(path.parent.glob(path.name[:split.start()] + "-*-of-" + split.group(1) + ".gguf")) \
            if split else [path]
        size = sum(f.stat().st_size for f in files)
        est.counted.append(f"weights: {key} {path.name}" + (f" and {len(files) - 1} more part(s)" if split else "")
                           + f" ({_mib(size)} MiB)")
        return size
    for pattern in ("*.safetensors", "model.bin", "*.gguf", "pytorch_model*.bin"):
        files = sorted(path.glob(pattern))
        if files:
            size = sum(f.stat().st_size for f in files)
            est.counted.append(f"weights: {key} {len(files)} {pattern} file(s) in {path} ({_mib(size)} MiB)")
            return size
    est.not_counted.append(f"weights: {key} {path} holds no *.safetensors, model.bin or *.gguf")
    return 0


def _gguf_file(path: Path) -> Path | None:
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    found = sorted(path.glob("*.gguf"))
    return found[0] if found else None


def configured_context(model: ModelConfig) -> tuple[str, int]:
    for key in CONTEXT_FIELDS:
        value = model.options.get(key)
        if isinstance(value, int) and value > 0:
            return key, value
    return "", 0


def _kv_type(model: ModelConfig, arch: Architecture) -> tuple[str, float]:
    """The KV cache element size: a configured cache type, else the model's dtype, else f16."""
    for key in ("gguf_type_k", "vllm_kv_cache_dtype"):
        value = model.options.get(key)
        if isinstance(value, str) and value.lower() in KV_TYPE_BYTES and value.lower() != "auto":
            return f"{key} {value}", KV_TYPE_BYTES[value.lower()]
    quant = model.options.get("exllama_cache_quant")
    if quant:
        bits = [int(b) for b in re.findall(r"\d+", str(quant))]
        if bits:
            return f"exllama_cache_quant {quant}", sum(bits) / len(bits) / 8
    if arch.dtype_bytes:
        return "the model's dtype", arch.dtype_bytes
    return "f16, the default cache type", 2.0


def gguf_architecture(path: Path) -> Architecture | str:
    """Layers, KV heads and head sizes from a GGUF file's metadata (`<arch>.block_count`, ...)."""
    try:
        from gguf import GGUFReader  # the `gguf` package: an optional dependency (extras demo, gpu)
    except ImportError:
        return "the gguf package is not installed (pip install gguf), so GGUF metadata cannot be read"
    try:
        reader = GGUFReader(path)
        meta = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("tokenizer.")}
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None   # not its contents: a long list
    except Exception as exc:  # a damaged or unsupported file: say so, never fail the whole answer
        return f"cannot read GGUF metadata of {path.name}: {type(exc).__name__}: {exc}"
    arch = meta.get("general.architecture")
    layers = meta.get(f"{arch}.block_count")
    heads = meta.get(f"{arch}.attention.head_count")
    embd = meta.get(f"{arch}.embedding_length")
    if not isinstance(layers, int) or heads is None:
        return f"{path.name} does not give {arch}.block_count and {arch}.attention.head_count"
    per_layer_heads = _per_layer(heads, layers)
    per_layer_kv = _per_layer(meta.get(f"{arch}.attention.head_count_kv", heads), layers)
    kv_width = 0
    for h, kv in zip(per_layer_heads, per_layer_kv):
        if not h or not kv:
            continue  # a layer without attention (recurrent or hybrid models) holds no KV cache
        default = (embd // h) if isinstance(embd, int) else 0
        key_len = meta.get(f"{arch}.attention.key_length", default)
        value_len = meta.get(f"{arch}.attention.value_length", default)
        kv_width += kv * (int(key_len) + int(value_len))
    if not kv_width:
        return f"{path.name} gives no attention head sizes"
    ctx = meta.get(f"{arch}.context_length")
    ff = meta.get(f"{arch}.feed_forward_length")
    return Architecture(source=f"GGUF metadata of {path.name}", layers=layers, kv_width=kv_width,
                        context_length=int(ctx) if isinstance(ctx, int) else None,
                        embedding=embd if isinstance(embd, int) else None, vocab=vocab,
                        feed_forward=max(_per_layer(ff, layers)) if ff is not None else None,
                        heads=max(per_layer_heads) if per_layer_heads else None)


def _per_layer(value: Any, layers: int) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value][:layers]
    return [int(value)] * layers


def hf_architecture(config_path: Path) -> Architecture | str:
    """Layers, KV heads and head size from a Hugging Face config.json (or its text_config)."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"cannot read {config_path}: {exc}"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    layers = text.get("num_hidden_layers")
    heads = text.get("num_attention_heads")
    if not isinstance(layers, int) or not isinstance(heads, int) or not heads:
        return f"{config_path} gives no num_hidden_layers and num_attention_heads"
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (text.get("hidden_size", 0) // heads)
    if not head_dim:
        return f"{config_path} gives neither head_dim nor hidden_size"
    dtype = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "")
    ctx = text.get("max_position_embeddings")
    return Architecture(source=config_path.name, layers=layers, kv_width=layers * kv_heads * 2 * head_dim,
                        context_length=int(ctx) if isinstance(ctx, int) else None,
                        dtype_bytes=DTYPE_BYTES.get(dtype))
