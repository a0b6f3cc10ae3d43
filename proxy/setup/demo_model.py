"""A tiny random-weight llama GGUF: the demo model and the model every llama-server test loads.

It is real in every way that matters to the pool (llama-server loads it, tokenizes, applies the
chat template, streams tokens, reports usage) and tiny in every way that matters to a CPU: about
0.5 MB, loads at once, thousands of tokens a second. Its output is gibberish by design.
"""
from __future__ import annotations

from pathlib import Path

from proxy.setup.gguf_file import gguf_writer

N_EMBD = 64
N_FF = 128
N_HEAD = 4
N_LAYER = 2
N_CTX = 2048
EOS_ID = 2   # the vocabulary's third token, </s>

# ChatML-like and deliberately simple: llama-server renders it with its jinja engine, so the chat
# endpoint works without the model having to match any template llama.cpp knows by name.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is was for on that with as by at from it an be this are or not have "
    "has but which one all were they their we there can been more when will would who so "
    "hello world model pool tiny demo weather park walk lunch today"
).split()


def _vocab() -> tuple[list[bytes], list[float], list[int]]:
    from gguf import TokenType

    tokens: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>".encode() for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces = ["\u2581"]
    pieces += [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    pieces += list("0123456789.,!?'-:;()")
    pieces += ["\u2581" + w for w in _WORDS]
    tokens += [p.encode() for p in pieces]
    types += [TokenType.NORMAL] * len(pieces)
    # SPM merges by score: longer pieces score higher so whole words win over letters.
    scores = [0.0] * (3 + 256) + [-100.0 + len(p) for p in pieces]
    return tokens, scores, [int(t) for t in types]


# Qwen's fill-in-the-middle tokens, which llama.cpp finds by these keys (and by these texts).
# llama-server's /infill answers 501 "Infill is not supported by this model: prefix token is
# missing. ..." without all three.
FIM_TOKENS = (("<|fim_prefix|>", "tokenizer.ggml.fim_pre_token_id"),
              ("<|fim_suffix|>", "tokenizer.ggml.fim_suf_token_id"),
              ("<|fim_middle|>", "tokenizer.ggml.fim_mid_token_id"))


def write_tiny_gguf(path: Path, seed: int = 0, chat_template: str = CHAT_TEMPLATE, fim: bool = True) -> Path:
    """Write the tiny model to `path` atomically (a half-written model never loads) and return it.

    `fim` appends FIM_TOKENS after the whole vocabulary, so that llama-server serves /infill.
    Every other token id and weight is the same either way (the new rows come from a generator of
    their own)."""
    import numpy as np
    from gguf import TokenType

    path = Path(path)
    tokens, scores, types = _vocab()
    n_base = len(tokens)
    if fim:
        tokens += [text.encode() for text, _ in FIM_TOKENS]
        scores += [0.0] * len(FIM_TOKENS)
        types += [int(TokenType.CONTROL)] * len(FIM_TOKENS)
    rng = np.random.default_rng(seed)
    extra_rng = np.random.default_rng([seed, 1])

    def weights(*shape: int) -> "np.ndarray":
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def vocab_rows() -> "np.ndarray":
        base = weights(n_base, N_EMBD)
        extra = (extra_rng.standard_normal((len(tokens) - n_base, N_EMBD)) * 0.2).astype(np.float32)
        return np.concatenate([base, extra]) if len(extra) else base

    with gguf_writer(path, "llama") as writer:
        writer.add_name("llm-pool tiny demo")
        writer.add_context_length(N_CTX)
        writer.add_embedding_length(N_EMBD)
        writer.add_block_count(N_LAYER)
        writer.add_feed_forward_length(N_FF)
        writer.add_head_count(N_HEAD)
        writer.add_head_count_kv(N_HEAD)
        writer.add_rope_dimension_count(N_EMBD // N_HEAD)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_file_type(0)  # all F32
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(EOS_ID)
        writer.add_add_bos_token(True)
        if fim:
            for i, (_, key) in enumerate(FIM_TOKENS):
                writer.add_uint32(key, n_base + i)
        writer.add_chat_template(chat_template)

        writer.add_tensor("token_embd.weight", vocab_rows())
        writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        output = vocab_rows()
        # The FIM tokens' rows are zero, so their logit is always 0 while hundreds of random ones spread
        # around it: greedy decoding never picks them, and sampling seldom. They are control tokens,
        # which an answer's text would not show.
        output[n_base:] = 0.0
        writer.add_tensor("output.weight", output)
        for i in range(N_LAYER):
            blk = f"blk.{i}."
            writer.add_tensor(blk + "attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
            for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
                writer.add_tensor(blk + name + ".weight", weights(N_EMBD, N_EMBD))
            writer.add_tensor(blk + "ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
            writer.add_tensor(blk + "ffn_gate.weight", weights(N_FF, N_EMBD))
            writer.add_tensor(blk + "ffn_up.weight", weights(N_FF, N_EMBD))
            writer.add_tensor(blk + "ffn_down.weight", weights(N_EMBD, N_FF))
    return path
