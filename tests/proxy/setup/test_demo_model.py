"""The tiny demo model's one designed trait: under greedy decoding its answers never end by themselves."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader

from proxy.setup.demo_model import EOS_ID, write_tiny_gguf


def test_the_end_token_never_has_the_top_logit(tmp_path: Path) -> None:
    reader = GGUFReader(write_tiny_gguf(tmp_path / "tiny.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    output = np.asarray(tensors["output.weight"].data)
    # Any hidden state the final norm can give: random ones stand for them.
    hidden = np.random.default_rng(1).standard_normal((256, output.shape[1])).astype(np.float32)
    logits = hidden @ output.T
    assert logits.shape[1] == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert not (logits.argmax(axis=1) == EOS_ID).any()
    assert (logits[:, EOS_ID] == 0).all()
