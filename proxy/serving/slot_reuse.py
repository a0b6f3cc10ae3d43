"""Whether a restored llama-server slot was reused (docs/lifecycle.md: KV cache across swaps): the
answer of the first request of its conversation there must say it read prompt tokens from the
cache. Every route that counts an answer's usage hands it here as well; the KV store decides."""
from __future__ import annotations

from typing import Any, Mapping

from aiohttp import web

from proxy.edge.response_metrics import checked_usage
from proxy.lifecycle.state.replicas import Replica
from proxy.serving.keys import ADAPTER, ENGINE_SLOT, POOL


def note_reuse(request: web.Request, replica: Replica | None, usage: Mapping[str, Any] | None) -> None:
    """The answer's `usage` to the KV store's check of the slot the request ran in, if it ran in one."""
    slot = request.get(ENGINE_SLOT)
    if slot is None or replica is None or replica.slots is None:
        return
    if request.get(ADAPTER) is not None:
        # A request with an explicit `lora` list never reuses a restored slot in llama-server (it
        # resets the slot's cache when the list differs from the slot's, and a restore leaves the
        # slot with none: measured): no evidence either way of the restore itself.
        return
    request.app[POOL].kv.checked(replica, slot, stated_cached(usage))


def stated_cached(usage: Mapping[str, Any] | None) -> int | None:
    """The prompt tokens `usage` says were read from the cache; None where it says nothing of them
    (OpenAI's shape without prompt_tokens_details, Anthropic's without cache_read_input_tokens, which
    checked_usage counts as 0): an answer that is silent is no evidence of a restore that failed."""
    if not isinstance(usage, Mapping):
        return None
    if "prompt_tokens" not in usage and "input_tokens" in usage and "cache_read_input_tokens" not in usage:
        return None
    return checked_usage(usage)[0][1]
