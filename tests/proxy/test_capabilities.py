"""Capabilities come from each backend's own traits; nothing outside a backend keeps tables of names."""
from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from launchers import LAUNCHERS
from proxy.capabilities import THINKING_MODES, capabilities
from proxy.config.files import SCHEMA_PATH
from proxy.config.model import ModelConfig
from proxy.lifecycle.kinds.kind import ENDPOINT_BACKENDS, traits_for

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = json.loads(SCHEMA_PATH.read_text())["$defs"]["model"]["properties"]["backend"]["enum"]


def model(backend: str, **options: Any) -> ModelConfig:
    return ModelConfig(name="m", backend=backend, enabled=True, replicas=1, replica_max=1, target_inflight=1,
                       modalities=("text", "image"), gpus=(), options={"backend": backend, **options})


def caps(backend: str, **options: Any) -> dict[str, object]:
    return capabilities(model(backend, **options), traits_for(backend)).as_dict()


def test_every_configurable_backend_is_a_launcher_or_an_endpoint() -> None:
    assert set(BACKENDS) == set(LAUNCHERS) | ENDPOINT_BACKENDS


@pytest.mark.parametrize("backend, multi_turn, thinking", [
    ("llama_server", True, list(THINKING_MODES)), ("vllm_serve", True, list(THINKING_MODES)),
    ("vllm", True, list(THINKING_MODES)), ("openai_remote", True, list(THINKING_MODES)),
    ("sim", True, ["default"]), ("ct2", False, ["default"]), ("exllamav3", False, ["default"]),
])
def test_what_each_backend_declares(backend: str, multi_turn: bool, thinking: list[str]) -> None:
    got = caps(backend)
    assert (got["multi_turn"], got["thinking_modes"], got["modalities"]) == (multi_turn, thinking, ["text", "image"])


def test_llama_cpp_is_text_only_and_multi_turn_by_prompt_format() -> None:
    assert caps("llama_cpp")["modalities"] == ["text"]
    assert caps("llama_cpp")["multi_turn"]                       # the generic format takes turns
    assert caps("llama_cpp", prompt_format="qwen3_template")["multi_turn"]
    assert not caps("llama_cpp", prompt_format="translategemma_template")["multi_turn"]


def test_fields_that_switch_a_capability_on() -> None:
    assert caps("llama_server", llama_server_embeddings=True)["embeddings"]
    assert not caps("llama_server")["embeddings"] and not caps("vllm_serve", llama_server_embeddings=True)["embeddings"]
    assert caps("openai_remote", remote_file_mode="chat_completions_inline")["file_inputs"]
    assert not caps("llama_server", remote_file_mode="chat_completions_inline")["file_inputs"]
    assert caps("ct2", thinking_modes=["default", "disabled"])["thinking_modes"] == ["default", "disabled"]


CHAT_ROUTES = ["/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/messages"]


@pytest.mark.parametrize("backend", ["sim", "ct2", "exllamav3", "llama_cpp", "openai_remote"])
def test_a_backend_that_chats_is_served_messages_translated_and_nothing_it_does_not_speak(backend: str) -> None:
    assert caps(backend)["endpoints"] == CHAT_ROUTES


def test_vllm_serves_messages_and_count_tokens_itself() -> None:
    assert caps("vllm_serve")["endpoints"] == [*CHAT_ROUTES, "/v1/messages/count_tokens"]


def test_llama_server_serves_every_api_it_speaks_and_what_its_settings_switch_on() -> None:
    native = [*CHAT_ROUTES, "/v1/messages/count_tokens", "/infill", "/tokenize", "/detokenize"]
    assert sorted(caps("llama_server")["endpoints"]) == sorted(native)  # type: ignore[arg-type]
    both = caps("llama_server", llama_server_embeddings=True, llama_server_reranking=True)["endpoints"]
    assert sorted(both) == sorted([*native, "/v1/embeddings", "/v1/rerank"])  # type: ignore[arg-type]


def _string_literals(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_no_backend_name_is_spelled_in_serving_or_the_capabilities() -> None:
    # What a backend can do is its traits' business; a table of names elsewhere would drift.
    sources = [*sorted((ROOT / "proxy" / "serving").glob("*.py")), ROOT / "proxy" / "capabilities.py"]
    found = {(p.name, s) for p in sources for s in _string_literals(p) if s in BACKENDS}
    assert found == set()
