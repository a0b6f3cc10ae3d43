"""Token ids are checked at the edge against the model's vocabulary (issue 39, item 6): the size read
from the GGUF's own header (checked against the `gguf` package's reader), cached per file; ids that
are no token of the model are a 400 naming the first, before any engine sees them."""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader

from proxy.config.model import ModelConfig
from proxy.errors import BadRequest
from proxy.serving.body import check_required
from proxy.serving.token_ids import MAX_TOKEN_ID, check_token_ids
from proxy.serving.vocabulary import Vocabularies, gguf_vocabulary_size


def model(path: Path | str) -> ModelConfig:
    return ModelConfig(name="m", backend="llama_server", enabled=True, replicas=1, replica_max=1, target_inflight=1,
                       modalities=("text",), gpus=(), options={"model_path": str(path)})


def test_the_vocabulary_size_is_the_ggufs_token_count(tiny_gguf: Path) -> None:
    tokens = GGUFReader(str(tiny_gguf)).fields["tokenizer.ggml.tokens"]
    assert gguf_vocabulary_size(tiny_gguf) == len(tokens.data) > 256


def test_what_is_not_a_readable_gguf_has_no_known_vocabulary(tmp_path: Path, tiny_gguf: Path) -> None:
    (tmp_path / "text.gguf").write_text("not a model")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:200])
    future = tmp_path / "v9.gguf"
    future.write_bytes(b"GGUF" + struct.pack("<IQQ", 9, 0, 0))
    assert [gguf_vocabulary_size(p) for p in (tmp_path / "text.gguf", truncated, future)] == [None, None, None]
    vocabularies = Vocabularies()
    # A remote model's name, a folder, a file that is not there: unknown, and no error.
    for value in ("gpt-4o", str(tmp_path), str(tmp_path / "missing.gguf")):
        assert vocabularies.size(model(value), "model_path") is None


def test_a_file_is_read_once_and_again_when_it_changes(tmp_path: Path, tiny_gguf: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(tiny_gguf.read_bytes())
    reads: list[Path] = []
    real = gguf_vocabulary_size

    def counting(p: Path) -> int | None:
        reads.append(p)
        return real(p)

    monkeypatch.setattr("proxy.serving.vocabulary.gguf_vocabulary_size", counting)
    vocabularies = Vocabularies()
    size = vocabularies.size(model(path), "model_path")
    assert size == real(tiny_gguf)
    assert vocabularies.size(model(path), "model_path") == size and len(reads) == 1
    path.write_text("replaced by something else")
    os.utime(path, ns=(1, 1))
    assert vocabularies.size(model(path), "model_path") is None and len(reads) == 2


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, 2, 300]}, "tokens.2"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/v1/completions", {"prompt": [5, 299, 300]}, "prompt.2"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 1000]]}, "prompt.1.1"),
    ("/v1/completions", {"prompt": ["text", 7, 4000]}, "prompt.2"),   # llama-server's mixed prompt
    ("/v1/embeddings", {"input": [[1], [2, -5]]}, "input.1.1"),
])
def test_an_id_past_the_vocabulary_is_a_400_naming_it(path: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        check_token_ids(path, body, lambda: 300)
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "invalid_token_id", param)
    assert "vocabulary has 300 tokens" in refused.value.message


def test_ids_within_the_vocabulary_pass_and_the_size_is_asked_only_for_ids() -> None:
    asked: list[int] = []

    def vocabulary() -> int:
        asked.append(1)
        return 300

    assert check_token_ids("/v1/completions", {"prompt": [0, 299]}, vocabulary) is False
    assert check_token_ids("/v1/completions", {"prompt": "text"}, vocabulary) is False
    assert check_token_ids("/v1/completions", {"prompt": ["a", "b"]}, vocabulary) is False
    assert check_token_ids("/v1/chat/completions", {"messages": []}, vocabulary) is False
    assert len(asked) == 1


def test_without_a_known_vocabulary_only_what_no_model_has_is_refused_and_the_engine_judges() -> None:
    with pytest.raises(BadRequest, match="ids are from 0 to"):
        check_token_ids("/v1/completions", {"prompt": [MAX_TOKEN_ID + 1]}, lambda: None)
    # The engine alone can judge ids of a vocabulary the proxy could not read, and the pure endpoints.
    assert check_token_ids("/v1/completions", {"prompt": [10**6]}, lambda: None) is True
    assert check_token_ids("/tokenize", {"content": "x"}, lambda: 300) is True
    assert check_token_ids("/detokenize", {"tokens": [1]}, lambda: 300) is True


def test_infill_needs_its_suffix() -> None:
    # llama-server answered its absence with a 500 (`key 'input_suffix' not found`), a backend error.
    with pytest.raises(BadRequest) as refused:
        check_required("/infill", {"model": "m", "input_prefix": "def f("})
    assert (refused.value.code, refused.value.param) == ("missing_required_parameter", "input_suffix")
    with pytest.raises(BadRequest, match="'input_suffix' must be a string"):
        check_required("/infill", {"model": "m", "input_prefix": "def f(", "input_suffix": [1, 2]})
    assert check_required("/infill", {"model": "m", "input_prefix": "def f(", "input_suffix": ""}) is False
