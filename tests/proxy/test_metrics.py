"""The proxy's metric helpers: reading `usage` cheaply from answers and stream tails, counting it
per model and bounded fairness-key label."""
from __future__ import annotations

import json

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import OTHER_KEY, ProxyMetrics, usage_in

USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17, "prompt_tokens_details": {"cached_tokens": 8}}


def sample(metrics: ProxyMetrics, name: str, **labels: str) -> float:
    text = generate_latest(metrics.registry).decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_usage_of_a_json_answer_with_fields_after_it() -> None:
    answer = {"id": "x", "choices": [{"message": {"content": 'he said "usage": {"prompt_tokens": 99}'}}],
              "usage": USAGE, "timings": {"prompt_ms": 1.5}}
    assert usage_in(json.dumps(answer).encode()) == USAGE


def test_usage_of_a_stream_tail_is_the_last_chunk_that_carries_one() -> None:
    tail = (b'data: {"choices": [{"delta": {"content": "x"}}], "usage": null}\n\n'
            b'data: {"choices": [], "usage": ' + json.dumps(USAGE).encode() + b'}\n\ndata: [DONE]\n\n')
    assert usage_in(tail) == USAGE


def test_no_usage_a_null_one_or_one_cut_off_is_none() -> None:
    assert usage_in(b'{"choices": []}') is None
    assert usage_in(b'data: {"usage": null}\n\n') is None
    assert usage_in(b'data: {"usage": {"prompt_tokens": 1') is None
    assert usage_in(b'"usage"') is None


def test_only_keys_named_in_the_weights_are_labels() -> None:
    metrics = ProxyMetrics()
    metrics.named_keys = frozenset({"gold"})
    assert metrics.key_label("gold") == "gold"
    assert [metrics.key_label(k) for k in ("silver", "", None)] == [OTHER_KEY] * 3


def test_usage_counts_prompt_cached_and_output_tokens() -> None:
    metrics = ProxyMetrics()
    metrics.count_usage("m", "gold", USAGE)
    metrics.count_usage("m", "gold", USAGE)
    metrics.count_usage("m", "gold", None)
    metrics.count_usage("m", "other", {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 2})  # Moonshot
    assert sample(metrics, "llm_pool_prompt_tokens_total", model="m", key="gold") == 24
    assert sample(metrics, "llm_pool_cached_prompt_tokens_total", model="m", key="gold") == 16
    assert sample(metrics, "llm_pool_output_tokens_total", model="m", key="gold") == 10
    assert sample(metrics, "llm_pool_cached_prompt_tokens_total", model="m", key="other") == 2


def test_a_responses_answer_counts_its_measured_metrics() -> None:
    metrics = ProxyMetrics()
    measured = {"engine_prompt_tokens": 7, "engine_cached_prompt_tokens": None, "engine_output_tokens": 3,
                "engine_queue_wait_ms": 250.0, "backend_time_to_first_token_ms": 40.0}
    metrics.count_response("m", "other", measured, streamed=True)
    metrics.count_response("m", "other", measured, streamed=False)
    assert sample(metrics, "llm_pool_prompt_tokens_total", model="m") == 14
    assert sample(metrics, "llm_pool_queue_wait_seconds_count", model="m") == 2
    assert sample(metrics, "llm_pool_queue_wait_seconds_sum", model="m") == 0.5
    assert sample(metrics, "llm_pool_time_to_first_token_seconds_count", model="m", endpoint="/v1/responses") == 1
