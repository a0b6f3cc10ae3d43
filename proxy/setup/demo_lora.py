"""A tiny random LoRA adapter for the demo model: what llama-server loads with `--lora`.

It adapts attn_q and attn_v of every block at rank R, with halves large enough that greedy output
changes visibly when it is applied, which is what a test of adapter routing needs to see. Like the
demo model it is F32 and seeded, so the file is the same on every machine; it means nothing.
"""
from __future__ import annotations

from pathlib import Path

from proxy.setup.demo_model import N_EMBD, N_LAYER
from proxy.setup.gguf_file import gguf_writer

R = 4
TARGETS = ("attn_q", "attn_v")


def write_tiny_lora(path: Path, seed: int = 0) -> Path:
    """Write the demo model's LoRA adapter to `path` atomically and return it."""
    import numpy as np

    path = Path(path)
    rng = np.random.default_rng(seed)
    with gguf_writer(path, "llama") as writer:
        # The keys llama.cpp's adapter loader requires; alpha == rank makes the scale exactly 1.
        writer.add_string("general.type", "adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", float(R))
        for i in range(N_LAYER):
            for name in TARGETS:
                # numpy's (rows, cols) is ggml's ne reversed: lora_a is ne [N_EMBD, R], lora_b [R, N_EMBD].
                weight = f"blk.{i}.{name}.weight"
                writer.add_tensor(weight + ".lora_a", (rng.standard_normal((R, N_EMBD)) * 0.5).astype(np.float32))
                writer.add_tensor(weight + ".lora_b", (rng.standard_normal((N_EMBD, R)) * 0.5).astype(np.float32))
    return path
