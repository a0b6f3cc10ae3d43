"""The tiny demo model's designed trait: under greedy decoding its answers never hold a control token
(its FIM tokens, for /infill) that text would not show; and what `llm-pool setup` writes of it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from gguf import GGUFReader

from launchers.gguf_header import lora_problem
from proxy.cli import main
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


def test_setup_writes_the_demo_and_its_tiny_lora_where_the_settings_serve_them(
        tmp_path: Path, llama_server_bin: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`llm-pool setup`: the demo model, and its LoRA at the path of the demo's `tiny` adapter
    (conf/pool.yaml serves it as demo:tiny); both fit, and a second run keeps them."""
    demo, lora = tmp_path / "models" / "demo.gguf", tmp_path / "models" / "demo-lora.gguf"
    config = tmp_path / "pool.yaml"
    config.write_text(yaml.safe_dump({"service": {"state_dir": str(tmp_path / "state")}, "engine": {"models": {
        "demo": {"backend": "llama_server", "model_path": str(demo), "lora_adapters": {"tiny": {"path": str(lora)}}}}}}))
    assert main(["--config", str(config), "setup"]) == 0
    assert f"demo LoRA adapter: wrote {lora}" in capsys.readouterr().out
    assert lora_problem(demo, lora) is None
    written = lora.stat().st_mtime_ns
    assert main(["--config", str(config), "setup"]) == 0
    assert f"demo LoRA adapter: present at {lora}" in capsys.readouterr().out and lora.stat().st_mtime_ns == written
