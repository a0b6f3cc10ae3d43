"""The tiny test GGUFs: the same bytes from the same seed, small, and declaring what llama-server
reads (the reranker's rank pooling; the demo model's FIM tokens only when asked for)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from gguf import GGUFReader

from launchers.gguf_header import declared_pooling
from proxy.setup.demo_model import FIM_TOKENS, write_tiny_gguf
from proxy.setup.tiny_reranker import CLS, SEP, write_tiny_reranker


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def field(reader: GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def test_the_reranker_is_the_same_small_file_every_time_and_pools_by_rank(tmp_path: Path) -> None:
    a = write_tiny_reranker(tmp_path / "a.gguf")
    assert digest(a) == digest(write_tiny_reranker(tmp_path / "b.gguf"))
    assert digest(a) != digest(write_tiny_reranker(tmp_path / "c.gguf", seed=1))
    assert a.stat().st_size < 400_000
    assert declared_pooling(a) == "rank"
    reader = GGUFReader(a)
    assert field(reader, "general.architecture") == "bert"
    assert field(reader, "tokenizer.ggml.model") == "bert"
    # llama-server builds each rerank prompt as [CLS] query [SEP] document from these.
    assert (field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.seperator_token_id")) == \
        (CLS, SEP)
    assert {t.name for t in reader.tensors} >= {"cls.weight", "cls.output.weight", "token_types.weight"}
    assert not list(tmp_path.glob("*.tmp*"))


def test_the_demo_models_fim_tokens_come_after_its_vocabulary_and_change_nothing_else(tmp_path: Path) -> None:
    plain = GGUFReader(write_tiny_gguf(tmp_path / "plain.gguf", fim=False))
    fim = GGUFReader(write_tiny_gguf(tmp_path / "fim.gguf", fim=True))
    tokens = field(plain, "tokenizer.ggml.tokens")
    assert isinstance(tokens, list)
    assert field(fim, "tokenizer.ggml.tokens") == tokens + [text for text, _ in FIM_TOKENS]
    assert [field(fim, key) for _, key in FIM_TOKENS] == [len(tokens) + i for i in range(len(FIM_TOKENS))]
    assert not any(key in plain.fields for _, key in FIM_TOKENS)
    before = {t.name: t.data for t in plain.tensors}
    for t in fim.tensors:
        assert (t.data[:len(before[t.name])] == before[t.name]).all(), t.name
