"""A prompt too long for a model goes to its fallback with the longer context (docs/routing.md:
Aliases and fallbacks), on two real llama-servers over the tiny GGUF: llama-server's own refusal is
what the pool reads, and the answer says which model gave it."""
from __future__ import annotations

import pytest

from helpers import http

pytestmark = pytest.mark.integration

LONG = [{"role": "user", "content": "lighthouse keeper " * 60}]   # about 1,100 tokens: far more than 256


def test_a_prompt_too_long_for_its_model_is_answered_by_the_longer_fallback(start_proxy, llama_model) -> None:
    proxy = start_proxy({
        "short": llama_model(llama_server_n_ctx=256, target_inflight=1,
                             fallbacks=[{"model": "long", "on": ["context_length_exceeded"]}]),
        "long": llama_model(llama_server_n_ctx=4096, target_inflight=1),
        # The same short model without the fallback: llama-server's refusal is the client's 400.
        "short-alone": llama_model(llama_server_n_ctx=256, target_inflight=1),
    })
    for name in ("short", "long", "short-alone"):
        proxy.wait_state(name, "loaded")
    status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                           {"model": "short-alone", "messages": LONG, "max_tokens": 4})
    assert (status, body["error"]["code"]) == (400, "context_length_exceeded"), body

    status, headers, body = http("POST", proxy.url + "/v1/chat/completions",
                                 {"model": "short", "messages": LONG, "max_tokens": 4})
    assert status == 200, body
    assert headers["X-LLM-Pool-Model"] == "long"
    assert body["usage"]["prompt_tokens"] > 256
    status, headers, body = http("POST", proxy.url + "/v1/chat/completions",
                                 {"model": "short", "messages": LONG, "max_tokens": 4, "stream": True})
    assert (status, headers["X-LLM-Pool-Model"]) == (200, "long"), body
    assert b"data: [DONE]" in body

    # A prompt that fits is the model's own; unavailable is not a reason this fallback names.
    status, headers, body = http("POST", proxy.url + "/v1/chat/completions",
                                 {"model": "short", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert (status, headers["X-LLM-Pool-Model"]) == (200, "short"), body
    # The refused try is no failure of the short model's replica.
    replica = proxy.admin_model("short")["replicas"][0]
    assert (replica["state"], replica["consecutive_failures"]) == ("ready", 0)
