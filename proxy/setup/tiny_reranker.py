"""A tiny random-weight BERT cross-encoder GGUF: the model every llama-server reranking test loads.

llama.cpp serves /v1/rerank from an encoder whose pooling is `rank`: it reads the [CLS] row of the
last layer through the classification head (`cls`, then `cls.output`) and answers that one number as
the document's score. This file is such a model in the shape the pinned llama.cpp's `bert`
architecture loads (src/models/bert.cpp): word-piece vocabulary (`bert`, WPM), token-type and
position embeddings, post-norm blocks, and a one-label head. Everything is F32 and seeded, and the
vocabulary is fixed, so the file is byte-identical on every machine; its scores mean nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from proxy.setup.gguf_file import gguf_writer

if TYPE_CHECKING:
    import numpy as np

N_EMBD = 32
N_FF = 64
N_HEAD = 2
N_LAYER = 2
N_CTX = 512
N_TOKEN_TYPES = 2

# BERT's own special tokens, first. llama-server builds each rerank prompt from them:
# [CLS] query [SEP] document, so BOS ([CLS]) and SEP must be declared or reranking is refused.
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD, UNK, CLS, SEP, MASK = range(len(SPECIALS))

_WORDS = (
    "the of and to in is was for on that with as by at from it an be this are or not have "
    "has but which one all were they their we there can been more when will would who so "
    "hello world model pool tiny demo weather park walk lunch today rain sun city paris capital"
).split()


def _vocab() -> tuple[list[str], list[int]]:
    from gguf import TokenType

    # Word pieces as llama.cpp's converter writes them: a word-initial piece carries the phantom
    # space U+2581, a continuation ("##ing" in the HF vocabulary) is bare. Every lowercase letter,
    # digit and punctuation mark exists both ways, so any ASCII text tokenizes without [UNK].
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789")
    punct = list(".,!?'-:;()\"")
    pieces = ["\u2581" + c for c in chars + punct] + chars + ["\u2581" + w for w in _WORDS]
    tokens = list(SPECIALS) + pieces
    types = [TokenType.CONTROL] * len(SPECIALS) + [TokenType.NORMAL] * len(pieces)
    types[UNK] = TokenType.UNKNOWN
    return tokens, [int(t) for t in types]


def write_tiny_reranker(path: Path, seed: int = 0) -> Path:
    """Write the tiny reranker to `path` atomically (a half-written model never loads) and return it."""
    import numpy as np
    from gguf import PoolingType

    path = Path(path)
    tokens, types = _vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def ones() -> np.ndarray:
        return np.ones(N_EMBD, dtype=np.float32)

    def zeros(n: int = N_EMBD) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    with gguf_writer(path, "bert") as writer:
        writer.add_name("llm-pool tiny reranker")
        writer.add_context_length(N_CTX)
        writer.add_embedding_length(N_EMBD)
        writer.add_block_count(N_LAYER)
        writer.add_feed_forward_length(N_FF)
        writer.add_head_count(N_HEAD)
        writer.add_layer_norm_eps(1e-12)
        writer.add_causal_attention(False)
        # Declared by the file, so llama-server pools by rank even before --reranking forces it.
        writer.add_pooling_type(PoolingType.RANK)
        # One label: the head's single output is the score llama-server answers (embd[0]).
        writer.add_classifier_output_labels(["LABEL_0"])
        writer.add_file_type(0)  # all F32
        writer.add_tokenizer_model("bert")
        writer.add_token_type_count(N_TOKEN_TYPES)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_bos_token_id(CLS)
        writer.add_sep_token_id(SEP)
        writer.add_unk_token_id(UNK)
        writer.add_pad_token_id(PAD)
        writer.add_mask_token_id(MASK)
        writer.add_add_bos_token(True)
        writer.add_add_sep_token(True)

        writer.add_tensor("token_embd.weight", weights(n_vocab, N_EMBD))
        writer.add_tensor("token_types.weight", weights(N_TOKEN_TYPES, N_EMBD))
        writer.add_tensor("position_embd.weight", weights(N_CTX, N_EMBD))
        writer.add_tensor("token_embd_norm.weight", ones())
        writer.add_tensor("token_embd_norm.bias", zeros())
        for i in range(N_LAYER):
            blk = f"blk.{i}."
            for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
                writer.add_tensor(blk + name + ".weight", weights(N_EMBD, N_EMBD))
                writer.add_tensor(blk + name + ".bias", zeros())
            writer.add_tensor(blk + "attn_output_norm.weight", ones())
            writer.add_tensor(blk + "attn_output_norm.bias", zeros())
            writer.add_tensor(blk + "ffn_up.weight", weights(N_FF, N_EMBD))
            writer.add_tensor(blk + "ffn_up.bias", zeros(N_FF))
            writer.add_tensor(blk + "ffn_down.weight", weights(N_EMBD, N_FF))
            writer.add_tensor(blk + "ffn_down.bias", zeros())
            writer.add_tensor(blk + "layer_output_norm.weight", ones())
            writer.add_tensor(blk + "layer_output_norm.bias", zeros())
        # The classification head: dense + tanh, then the one-label projection.
        writer.add_tensor("cls.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor("cls.bias", zeros())
        writer.add_tensor("cls.output.weight", weights(1, N_EMBD))
        writer.add_tensor("cls.output.bias", zeros(1))
    return path
