"""A tiny random-weight Hugging Face Llama that `vllm serve` loads from a folder, with no download.

Real in what the pool exercises (vLLM loads it, tokenizes with a byte-level BPE tokenizer, renders
a ChatML chat template, streams tokens, reports usage and its gauges on /metrics) and tiny in what
costs a CPU: hidden size 128, 2 layers, a vocabulary of about 400, float32. The output is
gibberish by design. Written with numpy, safetensors and tokenizers; no torch needed.

    python -m tests.tiny_hf_model DIR      writes the model into DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4
VOCAB = 400
MAX_POSITIONS = 4096
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] if message['content'] is string else "
    "message['content'] | map(attribute='text') | join('')) + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "the of and to in is was for on that with as by at from it an be this are or not have has but "
    "which one all were they their we there can been more when will would who so hello world model "
    "pool tiny demo weather park walk lunch today say reply count write story about numbers letters"
)


def _tokenizer() -> "object":
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 20, trainer=trainer)
    return tok


def _weights(vocab: int, seed: int) -> dict[str, "object"]:
    import numpy as np

    rng = np.random.default_rng(seed)

    def dense(rows: int, cols: int) -> "np.ndarray":
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    ones = np.ones(HIDDEN, dtype=np.float32)
    tensors = {"model.embed_tokens.weight": dense(vocab, HIDDEN), "model.norm.weight": ones.copy(),
               "lm_head.weight": dense(vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = dense(HIDDEN, HIDDEN)
        tensors[p + "mlp.gate_proj.weight"] = dense(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = dense(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = dense(HIDDEN, INTERMEDIATE)
        tensors[p + "input_layernorm.weight"] = ones.copy()
        tensors[p + "post_attention_layernorm.weight"] = ones.copy()
    return tensors


def write_tiny_hf_llama(target: Path, seed: int = 0) -> Path:
    """Write the model folder `target` (config, weights, tokenizer, chat template); returns it."""
    from safetensors.numpy import save_file

    target.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    bos = tok.token_to_id("<|endoftext|>")
    tok.save(str(target / "tokenizer.json"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "head_dim": HIDDEN // HEADS, "vocab_size": vocab,
        "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": bos,
    }
    (target / "config.json").write_text(json.dumps(config, indent=1))
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    (target / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE, "add_bos_token": False, "clean_up_tokenization_spaces": False,
    }, indent=1))
    (target / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    save_file(_weights(vocab, seed), str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


LORA_RANK = 8
LORA_TARGETS = ("q_proj", "v_proj")


def write_tiny_peft_adapter(target: Path, model_folder: Path, seed: int = 1) -> Path:
    """Write a PEFT LoRA adapter folder `target` for the model in `model_folder` (rank LORA_RANK on
    q_proj and v_proj of every layer); returns it. Its deltas dwarf the random weights, so a greedy
    answer through it differs from the base's."""
    import numpy as np
    from safetensors.numpy import save_file

    target.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(LAYERS):
        for name in LORA_TARGETS:
            p = f"base_model.model.model.layers.{i}.self_attn.{name}."
            # lora_alpha == r: a scaling of 1, so B @ A is the delta: entries of about 0.7, weights 0.02.
            tensors[p + "lora_A.weight"] = (rng.standard_normal((LORA_RANK, HIDDEN)) * 0.5).astype(np.float32)
            tensors[p + "lora_B.weight"] = (rng.standard_normal((HIDDEN, LORA_RANK)) * 0.5).astype(np.float32)
    (target / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_folder),
        "r": LORA_RANK, "lora_alpha": LORA_RANK, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(LORA_TARGETS), "fan_in_fan_out": False, "inference_mode": True,
    }, indent=1))
    save_file(tensors, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
    return target


if __name__ == "__main__":
    print(write_tiny_hf_llama(Path(sys.argv[1])))
