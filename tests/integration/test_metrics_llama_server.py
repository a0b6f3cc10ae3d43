"""/metrics against a real llama-server: token counters (cached prompt tokens included) equal the
usage its answers reported, streamed ones too; warm-up reaches the engine before the model is loaded."""
from __future__ import annotations

import urllib.request
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import ProxyProcess

pytestmark = pytest.mark.integration

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea. " * 8}]


def scrape(url: str, prefix: str = "") -> dict[str, float]:
    """{sample name with sorted labels: value}, as prometheus-client's parser reads it."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                out[s.name + str(sorted(s.labels.items()))] = s.value
    return out


def total(samples: dict[str, float], name: str, *labels: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(name + "[") and all(lab in k for lab in labels))


def test_token_counters_equal_the_usage_llama_server_reported(start_proxy, llama_model) -> None:
    proxy: ProxyProcess = start_proxy({"tiny": llama_model(warmup=True)})
    replica = proxy.wait_state("tiny", "loaded")["replicas"][0]
    # The warm-up generation reached llama-server before the model was reported loaded.
    engine = scrape(f"http://127.0.0.1:{replica['port']}/metrics", "llamacpp:")
    assert total(engine, "llamacpp:tokens_predicted_total") >= 1
    oai = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    sums: dict[str, int] = {"prompt": 0, "cached": 0, "output": 0}

    def add(usage: Any) -> None:
        sums["prompt"] += usage.prompt_tokens
        details = getattr(usage, "prompt_tokens_details", None)
        sums["cached"] += (details.cached_tokens or 0) if details else 0
        sums["output"] += usage.completion_tokens

    for _ in range(2):  # the same prompt twice: the second is served from llama-server's prompt cache
        add(oai.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=4, temperature=0).usage)
    chunks = list(oai.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=6, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    (usage,) = [c.usage for c in chunks if c.usage]
    add(usage)
    metrics = scrape(proxy.url + "/metrics", "llm_pool_")
    assert total(metrics, "llm_pool_prompt_tokens_total", "'tiny'") == sums["prompt"]
    assert total(metrics, "llm_pool_cached_prompt_tokens_total", "'tiny'") == sums["cached"] > 0
    assert total(metrics, "llm_pool_output_tokens_total", "'tiny'") == sums["output"] == 4 + 4 + 6
    assert total(metrics, "llm_pool_requests_total", "('status', '200')", "'tiny'") == 3
    assert total(metrics, "llm_pool_time_to_first_token_seconds_count", "'tiny'") == 1
    assert total(metrics, "llm_pool_replica_warmup_seconds", "'tiny'") > 0
