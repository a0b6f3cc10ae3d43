from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from proxy.setup.demo_lora import write_tiny_lora
from proxy.setup.demo_model import write_tiny_gguf
from proxy.setup.llama_build import build_llama_server
from proxy.setup.tiny_mmproj import write_tiny_mmproj
from proxy.setup.tiny_reranker import write_tiny_reranker


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_lora_gguf(tiny_gguf: Path) -> Path:
    """A tiny LoRA adapter for the demo model, beside it: llama-server with `--lora` it answers otherwise."""
    return write_tiny_lora(tiny_gguf.parent / "tiny-lora.gguf")


@pytest.fixture(scope="session")
def tiny_mmproj_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny vision projector for the demo model: llama-server with `--mmproj` it reads images."""
    return write_tiny_mmproj(tmp_path_factory.mktemp("models") / "tiny-mmproj.gguf")


@pytest.fixture(scope="session")
def tiny_reranker_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT cross-encoder that llama-server serves /v1/rerank from (llama_server_reranking)."""
    return write_tiny_reranker(tmp_path_factory.mktemp("models") / "tiny-reranker.gguf")


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    # Returns at once when `llm-pool setup` (part of the test command) has built it.
    return build_llama_server()


@pytest.fixture(scope="session")
def tiny_ct2() -> dict[str, Path]:
    """{"decoder": folder, "seq2seq": folder}; written once into the cache by `llm-pool setup --all-engines`."""
    from proxy.setup.tiny_ct2 import cached_tiny_ct2

    return cached_tiny_ct2()


@pytest.fixture(scope="session")
def llama_cpp_python() -> None:
    """llama-cpp-python importable here; returns at once when `llm-pool setup --all-engines` installed it."""
    from proxy.setup.llama_cpp_wheel import ensure_llama_cpp_python

    ensure_llama_cpp_python()


@pytest.fixture
def proxies() -> Iterator[list]:
    """Proxies a test starts go in this list; each is stopped, and its processes checked gone, after."""
    started: list = []
    yield started
    survivors = [pid for p in started for pid in p.cleanup()]
    assert not survivors, f"processes outlived their test and were killed: {survivors}"
