"""What a model accepts, derived from its backend and config; advertised in /v1/admin/models."""
from __future__ import annotations

from dataclasses import dataclass

from proxy.config import ModelConfig
from shims.prompts import MULTI_TURN_FORMATS

THINKING_MODES = ("default", "enabled", "disabled")
# Backends that take multi-turn `messages` (chat endpoints); CT2 and ExLlamaV3 are single-turn.
MULTI_TURN_BACKENDS = {"llama_server", "vllm", "vllm_serve", "openai_remote", "sim"}
# Backends whose chat template can switch thinking on or off per request.
THINKING_BACKENDS = {"llama_server", "vllm", "vllm_serve", "openai_remote"}
# The field that makes a model of each backend serve /v1/embeddings (its server must be started so).
EMBEDDINGS_FIELDS = {"llama_server": "llama_server_embeddings"}


@dataclass(frozen=True)
class Capabilities:
    modalities: tuple[str, ...]
    multi_turn: bool
    file_inputs: bool
    thinking_modes: tuple[str, ...]
    embeddings: bool = False

    def as_dict(self) -> dict[str, object]:
        return {"modalities": list(self.modalities), "multi_turn": self.multi_turn,
                "file_inputs": self.file_inputs, "thinking_modes": list(self.thinking_modes),
                "embeddings": self.embeddings}


def capabilities(model: ModelConfig) -> Capabilities:
    backend = model.backend
    multi_turn = backend in MULTI_TURN_BACKENDS or (
        backend == "llama_cpp" and (model.get("prompt_format") or "generic") in MULTI_TURN_FORMATS)
    modalities = model.modalities if backend != "llama_cpp" else ("text",)  # in-process GGUF is text-only
    if model.get("thinking_modes"):
        thinking = tuple(model.get("thinking_modes"))
    elif backend in THINKING_BACKENDS:
        thinking = THINKING_MODES
    else:
        thinking = ("default",)
    return Capabilities(modalities=tuple(modalities), multi_turn=multi_turn,
                        file_inputs=backend == "openai_remote" and bool(model.get("remote_file_mode")),
                        thinking_modes=thinking,
                        embeddings=backend in EMBEDDINGS_FIELDS and bool(model.get(EMBEDDINGS_FIELDS[backend])))
