"""A client's mistake is the client's: OpenAI's error and codes, counted as a client error, against a
real llama-server (which answers such requests with its own words and an engine-internal code)."""
from __future__ import annotations

import urllib.request

import pytest
from gguf import GGUFReader
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


def test_a_client_cannot_eject_a_replica_with_token_ids(start_proxy, llama_model, tiny_gguf) -> None:
    # Issue 39, item 6. Before: llama-server answered each /detokenize id past its vocabulary with a
    # 500 (`vector::_M_range_check`); each counted against the replica, and a dozen ejected it from
    # everyone.
    proxy = start_proxy({"tiny": llama_model(target_inflight=1)})
    proxy.wait_state("tiny", "loaded")
    vocabulary = len(GGUFReader(str(tiny_gguf)).fields["tokenizer.ggml.tokens"].data)
    status, _, body = http("POST", proxy.url + "/detokenize", {"model": "tiny", "tokens": [1, vocabulary - 1]})
    assert status == 200, body
    status, _, body = http("POST", proxy.url + "/detokenize", {"model": "tiny", "tokens": [vocabulary]})
    assert (status, body["error"]["code"], body["error"]["param"]) == (400, "invalid_token_id", "tokens.0"), body
    assert f"its vocabulary has {vocabulary} tokens" in body["error"]["message"]
    for i in range(20):
        status, _, body = http("POST", proxy.url + "/detokenize", {"model": "tiny", "tokens": [1, vocabulary + i]})
        assert (status, body["error"]["type"], body["error"]["param"]) == (400, "invalid_request_error", "tokens.1")
    for bad in ([vocabulary], [-1], [[1, 2], [3, 10**9]]):
        status, _, body = http("POST", proxy.url + "/v1/completions", {"model": "tiny", "prompt": bad, "max_tokens": 1})
        assert (status, body["error"]["code"]) == (400, "invalid_token_id"), body
    status, _, body = http("POST", proxy.url + "/v1/completions",
                           {"model": "tiny", "prompt": [1, vocabulary - 1], "max_tokens": 1})
    assert status == 200, body

    assert requests_with_code(proxy.url, "backend_error") == 0
    replica = proxy.admin_model("tiny")["replicas"][0]
    assert (replica["state"], replica["consecutive_failures"]) == ("ready", 0)


def test_infill_without_its_suffix_is_the_clients_400(start_proxy, llama_model) -> None:
    # Before: llama-server's 500 (`key 'input_suffix' not found`: its own check does not return),
    # passed on as backend_error and counted against the replica.
    proxy = start_proxy({"tiny": llama_model(target_inflight=1)})
    proxy.wait_state("tiny", "loaded")
    for _ in range(6):
        status, _, body = http("POST", proxy.url + "/infill", {"model": "tiny", "input_prefix": "def f(", "n_predict": 2})
        assert (status, body["error"]["code"], body["error"]["param"]) == (400, "missing_required_parameter",
                                                                           "input_suffix"), body
    status, _, body = http("POST", proxy.url + "/infill",
                           {"model": "tiny", "input_prefix": "def f(", "input_suffix": "", "n_predict": 2})
    assert status == 200, body
    replica = proxy.admin_model("tiny")["replicas"][0]
    assert (replica["state"], replica["consecutive_failures"]) == ("ready", 0)
