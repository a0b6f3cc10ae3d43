"""What a model accepts: its backend's traits (declared once, by the backend) applied to its config.

Every backend says what it can do in one `Traits` record: a launcher as its module's `TRAITS`, the
remote kind beside its options (proxy/lifecycle/kinds/remote_options.py). Nothing here or in the serving wing
names a backend: they read the traits. `Capabilities` is what /v1/admin/models advertises.
"""
from __future__ import annotations

from dataclasses import dataclass

from proxy.config.model import ModelConfig

THINKING_MODES = ("default", "enabled", "disabled")

# The public routes, each with the API a replica must speak for it (a name in Traits.apis).
# /v1/responses is translated onto chat; /v1/messages is too where the replica does not speak it.
ROUTES: dict[str, str] = {
    "/v1/chat/completions": "chat", "/v1/responses": "chat", "/v1/completions": "completions",
    "/v1/embeddings": "embeddings", "/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens",
    "/v1/rerank": "rerank", "/infill": "infill", "/tokenize": "tokenize", "/detokenize": "tokenize",
}
# What an engine of ours serves unless its traits say more: the shims implement these two.
CHAT_AND_COMPLETIONS = frozenset({"chat", "completions"})


@dataclass(frozen=True)
class Traits:
    multi_turn: bool = False                          # takes multi-turn `messages` (a chat endpoint)
    # Multi-turn only with one of these `prompt_format`s (an engine that formats prompts itself).
    multi_turn_formats: frozenset[str] = frozenset()
    text_only: bool = False                           # serves text whatever `modalities` says
    # How a request switches thinking: "template" (the chat template's enable_thinking),
    # "provider" (the provider's `thinking: {"type": ...}`), None (it cannot).
    thinking: str | None = None
    embeddings_field: str | None = None              # the field that makes it serve /v1/embeddings
    repetition_field: str = "repetition_penalty"     # its name for the repetition knob
    beam_search: bool = False                         # takes `beam_size`
    # The decoding fields it takes besides stop (None: all); the others are accepted and ignored.
    decoding_only: tuple[str, ...] | None = None
    file_inputs_field: str | None = None             # the field that lets it take file items
    model_field: str = "model_path"                  # the field that names the model it serves
    apis: frozenset[str] = CHAT_AND_COMPLETIONS       # what its servers speak natively (ROUTES' names)
    rerank_field: str | None = None                  # the field that makes it serve /v1/rerank
    remote: bool = False                              # a provider's model: behind allow_remote, paid
    # It sends a stream's usage only when `stream_options.include_usage` asks, as OpenAI's API does
    # (llama-server's chat, vLLM, providers): the proxy asks on every pass-through stream, so that
    # each one is counted, and keeps the usage chunk from a client that did not ask.
    usage_on_request: bool = False


@dataclass(frozen=True)
class Capabilities:
    modalities: tuple[str, ...]
    multi_turn: bool
    file_inputs: bool
    thinking_modes: tuple[str, ...]
    embeddings: bool = False
    endpoints: tuple[str, ...] = ()                   # the public routes it serves (ROUTES' paths)

    def as_dict(self) -> dict[str, object]:
        return {"modalities": list(self.modalities), "multi_turn": self.multi_turn,
                "file_inputs": self.file_inputs, "thinking_modes": list(self.thinking_modes),
                "embeddings": self.embeddings, "endpoints": list(self.endpoints)}


def capabilities(model: ModelConfig, traits: Traits) -> Capabilities:
    multi_turn = traits.multi_turn or (model.get("prompt_format") or "generic") in traits.multi_turn_formats
    if model.get("thinking_modes"):
        thinking = tuple(model.get("thinking_modes"))
    elif traits.thinking is not None:
        thinking = THINKING_MODES
    else:
        thinking = ("default",)
    embeddings = traits.embeddings_field is not None and bool(model.get(traits.embeddings_field))
    apis = served_apis(model, traits)
    return Capabilities(modalities=("text",) if traits.text_only else tuple(model.modalities),
                        multi_turn=multi_turn,
                        file_inputs=traits.file_inputs_field is not None and bool(model.get(traits.file_inputs_field)),
                        thinking_modes=thinking, embeddings=embeddings,
                        endpoints=tuple(path for path, api in ROUTES.items() if api in apis))


def served_apis(model: ModelConfig, traits: Traits) -> frozenset[str]:
    """The APIs a model is served with: what its replicas speak, less what its settings switch off
    (embeddings, rerank), and Messages wherever it chats (translated: proxy/edge/anthropic.py)."""
    apis = set(traits.apis)
    for api, switch in (("embeddings", traits.embeddings_field), ("rerank", traits.rerank_field)):
        if switch is None or not model.get(switch):
            apis.discard(api)
    if "chat" in apis:
        apis.add("messages")
    return frozenset(apis)
