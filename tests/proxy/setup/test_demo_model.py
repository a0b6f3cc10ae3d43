"""The tiny demo model's designed trait: under greedy decoding its answers never hold a control token
(its FIM tokens, for /infill) that text would not show."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader

from proxy.setup.demo_model import FIM_TOKENS, write_tiny_gguf


def test_the_fim_tokens_never_have_the_top_logit(tmp_path: Path) -> None:
    reader = GGUFReader(write_tiny_gguf(tmp_path / "tiny.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    output = np.asarray(tensors["output.weight"].data)
    # Any hidden state the final norm can give: random ones stand for them.
    hidden = np.random.default_rng(1).standard_normal((256, output.shape[1])).astype(np.float32)
    logits = hidden @ output.T
    assert logits.shape[1] == len(reader.fields["tokenizer.ggml.tokens"].data)
    never = [int(reader.fields[key].parts[-1][0]) for _, key in FIM_TOKENS]
    assert len(never) == 3 and not np.isin(logits.argmax(axis=1), never).any()
    assert (logits[:, never] == 0).all()
