"""Tiny random-weight CTranslate2 models: what the CT2 shim's tests and benchmark load.

Written with `ctranslate2.specs` and numpy (no torch), with a small byte-level BPE `tokenizer.json`
from the `tokenizers` library saved beside the weights, as a converted Hugging Face model would
have it. A decoder-only model (llama-like: RMS norm, rotary, gated SiLU feed-forward) goes through
`ctranslate2.Generator`; an encoder-decoder one through `ctranslate2.Translator`. Their output is
gibberish; loading, tokenizing, streaming and stopping are all real.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

D_MODEL = 64
D_FFN = 128
N_HEADS = 4
N_LAYERS = 2
VOCAB_SIZE = 400
SPECIAL = ("<unk>", "<s>", "</s>")
# A fixed corpus so the trained vocabulary (and so the model file) is the same on every machine.
_CORPUS = (
    "the weather is pleasant today and i would like to take a walk in the park after lunch. "
    "hello world, this is a tiny model in a pool of models. translate to dutch: het weer is mooi. "
    "user assistant system instructions input output text tokens stream replica proxy engine. "
    "<|im_start|> <|im_end|> <start_of_turn> <end_of_turn> [INST] [/INST] 0123456789 ,.!?;:'\"-()"
)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    # A BOS before every prompt, as a Llama tokenizer.json adds it.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def _fill_norm(spec: Any, rng: Any) -> None:
    import numpy as np

    spec.gamma = np.ones(D_MODEL, dtype=np.float32)
    if hasattr(spec, "beta"):
        spec.beta = np.zeros(D_MODEL, dtype=np.float32)


def _weights(rng: Any, *shape: int) -> Any:
    import numpy as np

    return (rng.standard_normal(shape) * 0.2).astype(np.float32)


def _fill_attention(spec: Any, rng: Any, self_attention: bool) -> None:
    _fill_norm(spec.layer_norm, rng)
    if self_attention:
        spec.linear[0].weight = _weights(rng, 3 * D_MODEL, D_MODEL)   # fused q, k, v
        spec.linear[1].weight = _weights(rng, D_MODEL, D_MODEL)
    else:
        spec.linear[0].weight = _weights(rng, D_MODEL, D_MODEL)       # q from the decoder
        spec.linear[1].weight = _weights(rng, 2 * D_MODEL, D_MODEL)   # fused k, v from the encoder
        spec.linear[2].weight = _weights(rng, D_MODEL, D_MODEL)


def _fill_ffn(spec: Any, rng: Any) -> None:
    _fill_norm(spec.layer_norm, rng)
    spec.linear_0.weight = _weights(rng, D_FFN, D_MODEL)
    if hasattr(spec, "linear_0_noact"):
        spec.linear_0_noact.weight = _weights(rng, D_FFN, D_MODEL)
    spec.linear_1.weight = _weights(rng, D_MODEL, D_FFN)


def _decoder_spec(rng: Any, vocab: list[str]) -> Any:
    from ctranslate2.specs import common_spec, transformer_spec

    spec = transformer_spec.TransformerDecoderModelSpec.from_config(
        N_LAYERS, N_HEADS, activation=common_spec.Activation.SWISH, pre_norm=True, ffn_glu=True, rms_norm=True,
        rotary_dim=0, rotary_interleave=False)
    dec = spec.decoder
    dec.scale_embeddings = False
    dec.embeddings.weight = _weights(rng, len(vocab), D_MODEL)
    _fill_norm(dec.layer_norm, rng)
    dec.projection.weight = _weights(rng, len(vocab), D_MODEL)
    for layer in dec.layer:
        _fill_attention(layer.self_attention, rng, True)
        _fill_ffn(layer.ffn, rng)
    spec.register_vocabulary(vocab)
    spec.config.bos_token, spec.config.eos_token, spec.config.unk_token = "<s>", "</s>", "<unk>"
    spec.config.layer_norm_epsilon = 1e-5
    return spec


def _seq2seq_spec(rng: Any, vocab: list[str]) -> Any:
    from ctranslate2.specs import transformer_spec

    spec = transformer_spec.TransformerSpec.from_config(N_LAYERS, N_HEADS, pre_norm=True)
    for stack in (spec.encoder, spec.decoder):
        for emb in stack.embeddings if isinstance(stack.embeddings, list) else [stack.embeddings]:
            emb.weight = _weights(rng, len(vocab), D_MODEL)
        stack.scale_embeddings = True
        _fill_norm(stack.layer_norm, rng)
    spec.decoder.projection.weight = _weights(rng, len(vocab), D_MODEL)
    for layer in spec.encoder.layer:
        _fill_attention(layer.self_attention, rng, True)
        _fill_ffn(layer.ffn, rng)
    for layer in spec.decoder.layer:
        _fill_attention(layer.self_attention, rng, True)
        _fill_attention(layer.attention, rng, False)
        _fill_ffn(layer.ffn, rng)
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    return spec


def write_tiny_ct2(path: Path, kind: str = "decoder", seed: int = 0) -> Path:
    """Write a tiny model folder (`kind` "decoder" or "seq2seq") atomically and return it."""
    import numpy as np

    if kind not in ("decoder", "seq2seq"):
        raise ValueError(f"kind must be decoder or seq2seq, not {kind!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tok = _tokenizer()
    vocab = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda item: item[1])]
    spec = _decoder_spec(rng, vocab) if kind == "decoder" else _seq2seq_spec(rng, vocab)
    spec.validate()
    spec.optimize(quantization=None)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    spec.save(str(tmp))
    tok.save(str(tmp / "tokenizer.json"))
    if path.exists():
        shutil.rmtree(path)
    tmp.replace(path)  # atomic: a half-written model is never found
    return path


def cached_tiny_ct2() -> dict[str, Path]:
    """The tiny decoder and seq2seq models in the llm-pool cache, written once (the setup step)."""
    from proxy.setup.paths import cache_root

    import ctranslate2

    # Keyed by the CT2 version: a newer CT2 may not read an older model format, and rewriting is cheap.
    base = cache_root() / "models" / f"ct2-tiny-v1-ct2-{ctranslate2.__version__}"
    models = {}
    for kind in ("decoder", "seq2seq"):
        path = base / kind
        if not (path / "model.bin").is_file():
            write_tiny_ct2(path, kind)
            print(f"tiny CT2 {kind} model: wrote {path}", flush=True)
        else:
            print(f"tiny CT2 {kind} model: cached at {path}", flush=True)
        models[kind] = path
    return models
