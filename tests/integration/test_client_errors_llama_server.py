"""A client's mistake is the client's: OpenAI's error and codes, counted as a client error, against a
real llama-server (which answers such requests with its own words and an engine-internal code)."""
from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import http

pytestmark = pytest.mark.integration


def requests_with_code(url: str, code: str) -> float:
    """llm_pool_requests_total summed over every label but `code`."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        families = text_string_to_metric_families(resp.read().decode())
    return sum(s.value for f in families for s in f.samples
               if s.name == "llm_pool_requests_total" and s.labels.get("code") == code)


def test_missing_fields_and_an_overlong_prompt_are_invalid_requests(start_proxy, llama_model) -> None:
    proxy = start_proxy({"tiny": llama_model(llama_server_n_ctx=256, target_inflight=1)})
    proxy.wait_state("tiny", "loaded")
    for path, field in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        status, _, body = http("POST", proxy.url + path, {"model": "tiny"})
        assert status == 400, body
        assert (body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (
            "invalid_request_error", "missing_required_parameter", field)
    status, _, body = http("POST", proxy.url + "/v1/chat/completions", {"model": "tiny", "messages": "hi"})
    assert (status, body["error"]["code"], body["error"]["param"]) == (400, "invalid_type", "messages")

    # Far more than the 256 tokens of context each request has: llama-server refuses it.
    long = [{"role": "user", "content": "lighthouse keeper " * 400}]
    status, _, body = http("POST", proxy.url + "/v1/chat/completions", {"model": "tiny", "messages": long})
    assert status == 400, body
    assert (body["error"]["type"], body["error"]["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert "context" in body["error"]["message"]

    assert requests_with_code(proxy.url, "context_length_exceeded") == 1
    assert requests_with_code(proxy.url, "missing_required_parameter") == 2
    assert requests_with_code(proxy.url, "backend_error") == 0
    # A refused request is no failure of the replica: it stays in rotation with a clean record.
    replica = proxy.admin_model("tiny")["replicas"][0]
    assert (replica["state"], replica["consecutive_failures"]) == ("ready", 0)
