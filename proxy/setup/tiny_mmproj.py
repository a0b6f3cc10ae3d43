"""A tiny random-weight multimodal projector GGUF (an "mmproj") for the demo model.

llama-server reads images through such a file, given with `--mmproj` beside the text model: a
vision encoder turns the picture into patch embeddings and a projector maps them into the text
model's embedding space, where they stand in the prompt for the image. This one is the simplest
kind the pinned llama.cpp loads (tools/mtmd/clip.cpp): llava's, projector type `mlp`, a CLIP ViT
(`v.*`) followed by two linear layers (`mm.0`, `mm.2`) whose output width is the demo model's
n_embd. Images are resized to IMAGE_SIZE square and cut into (IMAGE_SIZE / PATCH_SIZE)**2 patches,
each of which costs the prompt one token. Everything is F32 and seeded, so the file is
byte-identical on every machine; what the model "sees" means nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from proxy.setup import demo_model
from proxy.setup.gguf_file import gguf_writer

if TYPE_CHECKING:
    import numpy as np

IMAGE_SIZE = 16
PATCH_SIZE = 8
N_PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2   # the prompt tokens one image takes
N_EMBD = 32
N_FF = 64
N_HEAD = 2
# llava reads the features of the second to last block, so the last one is loaded but never run;
# two blocks keep one in the graph.
N_LAYER = 2
PROJECTION_DIM = demo_model.N_EMBD   # must equal the text model's n_embd or llama-server refuses it


def write_tiny_mmproj(path: Path, seed: int = 0) -> Path:
    """Write the tiny projector to `path` atomically (a half-written file never loads) and return it."""
    import numpy as np

    path = Path(path)
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> "np.ndarray":
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def ones(n: int) -> "np.ndarray":
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> "np.ndarray":
        return np.zeros(n, dtype=np.float32)

    with gguf_writer(path, "clip") as writer:
        writer.add_name("llm-pool tiny mmproj")
        writer.add_file_type(0)  # all F32
        writer.add_clip_has_vision_encoder(True)
        writer.add_clip_projector_type("mlp")
        writer.add_vision_image_size(IMAGE_SIZE)
        writer.add_vision_patch_size(PATCH_SIZE)
        writer.add_vision_embedding_length(N_EMBD)
        writer.add_vision_feed_forward_length(N_FF)
        writer.add_vision_block_count(N_LAYER)
        writer.add_vision_head_count(N_HEAD)
        writer.add_vision_projection_dim(PROJECTION_DIM)
        writer.add_vision_attention_layernorm_eps(1e-5)
        # Required: the loader refuses a vision encoder without three of each.
        writer.add_vision_image_mean([0.5, 0.5, 0.5])
        writer.add_vision_image_std([0.5, 0.5, 0.5])
        writer.add_vision_use_gelu(True)

        # Shapes are numpy's, the reverse of ggml's ne: the patch embedding is a conv kernel of
        # ne [PATCH_SIZE, PATCH_SIZE, 3, N_EMBD], the position embedding one row per patch.
        writer.add_tensor("v.patch_embd.weight", weights(N_EMBD, 3, PATCH_SIZE, PATCH_SIZE))
        writer.add_tensor("v.position_embd.weight", weights(N_PATCHES, N_EMBD))
        writer.add_tensor("v.pre_ln.weight", ones(N_EMBD))
        writer.add_tensor("v.pre_ln.bias", zeros(N_EMBD))
        for i in range(N_LAYER):
            blk = f"v.blk.{i}."
            for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
                writer.add_tensor(blk + name + ".weight", weights(N_EMBD, N_EMBD))
                writer.add_tensor(blk + name + ".bias", zeros(N_EMBD))
            for norm in ("ln1", "ln2"):
                writer.add_tensor(blk + norm + ".weight", ones(N_EMBD))
                writer.add_tensor(blk + norm + ".bias", zeros(N_EMBD))
            writer.add_tensor(blk + "ffn_up.weight", weights(N_FF, N_EMBD))
            writer.add_tensor(blk + "ffn_up.bias", zeros(N_FF))
            writer.add_tensor(blk + "ffn_down.weight", weights(N_EMBD, N_FF))
            writer.add_tensor(blk + "ffn_down.bias", zeros(N_EMBD))
        writer.add_tensor("mm.0.weight", weights(PROJECTION_DIM, N_EMBD))
        writer.add_tensor("mm.0.bias", zeros(PROJECTION_DIM))
        writer.add_tensor("mm.2.weight", weights(PROJECTION_DIM, PROJECTION_DIM))
        writer.add_tensor("mm.2.bias", zeros(PROJECTION_DIM))
    return path
