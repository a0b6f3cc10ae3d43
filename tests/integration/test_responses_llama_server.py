"""/v1/responses end to end on real llama-server: the seed's request examples, metrics that match
what llama-server counted, live streaming, and the validation rules over HTTP."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from helpers import ProxyProcess, http, wait_for
from proxy.setup.demo_model import write_tiny_gguf
from proxy.edge.response_metrics import METRIC_KEYS

pytestmark = pytest.mark.integration

# A chat template that renders TranslateGemma's structured content (and plain strings) on the tiny model.
TRANSLATE_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{{ item['text'] }}{% endfor %}{% endif %}{% endfor %}"
    "<start_of_turn>model\n")

INFERENCE_EXAMPLE = {
    "model": "tiny",
    "input": "The weather is pleasant today, and I would like to take a walk in the park after lunch.",
    "instructions": "Translate to Dutch. Return only the translation.",
    "fairness_key": "workbench",
    "stream": False,
    "decoding": {"beam_size": 1, "top_k": 1, "top_p": 1.0, "temperature": 0.1, "repetition_penalty": 1.0,
                 "max_tokens": 256},
}
MULTI_TURN_EXAMPLE = {
    "model": "tiny",
    "instructions": "You are concise.",
    "messages": [{"role": "user", "content": "My favorite color is teal."},
                 {"role": "assistant", "content": "Got it."},
                 {"role": "user", "content": "What is my favorite color?"}],
    "stream": False,
    "decoding": {"temperature": 0, "max_tokens": 32},
}
MULTIMODAL_EXAMPLE = {
    "model": "tiny",
    "instructions": "Describe the image briefly.",
    "input": [{"type": "text", "text": "What does this menu say?"},
              {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQSkZJRg..."}}],
    "stream": False,
    "decoding": {"temperature": 0, "max_tokens": 512},
}
TRANSLATE_KNOWN = {"model": "translate", "input": "Ach, hij is gewoon een ouwe brombeer, maar hij bedoelt het goed.",
                   "source_lang_code": "nl", "target_lang_code": "en"}
TRANSLATE_MIXED = {"model": "translate", "target_lang_code": "en",
                   "input": "1. De vergadering is verplaatst.\n2. La réunion a été déplacée.\n"
                            "3. Die Besprechung wurde verschoben."}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path, llama_server_bin: Path) -> Iterator[ProxyProcess]:
    translate = write_tiny_gguf(tmp_path_factory.mktemp("tg") / "translate.gguf", chat_template=TRANSLATE_TEMPLATE)
    common = {"backend": "llama_server", "llama_server_binary": str(llama_server_bin), "llama_server_n_ctx": 8192,
              "target_inflight": 2, "enabled": True}
    proxy = ProxyProcess({
        # --ignore-eos: an answer runs to its max_tokens. Where the random-weight model meets its end
        # token depends on the CPU's float rounding, and the streaming test below needs an answer
        # that is still being generated after its first delta, on every machine.
        # --context-shift: an answer goes on past its slot's context (2,048 tokens, the tiny model's
        # own), which under load one ran out before the streaming test looked.
        "tiny": {**common, "model_path": str(tiny_gguf), "llama_server_extra_args": ["--ignore-eos", "--context-shift"]},
        "translate": {**common, "model_path": str(translate), "prompt_format": "translategemma_template"},
        "single": {"backend": "sim", "enabled": True, "thinking_modes": ["default"]},
    }, engine={"decoding": {"temperature": 0.7, "max_tokens": 64}})
    try:
        proxy.start()
        for name in ("tiny", "translate", "single"):
            proxy.wait_state(name, "loaded")
        yield proxy
    finally:
        survivors = proxy.cleanup()
        assert not survivors, survivors


def counters(proxy: ProxyProcess, model: str) -> dict[str, float]:
    port = proxy.admin_model(model)["replicas"][0]["port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return {line.split()[0].split(":")[1]: float(line.split()[1]) for line in lines if line.startswith("llamacpp:")}


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            events.append((lines["event"], json.loads(lines["data"])))
    return events


def assert_envelope(body: dict[str, Any], model: str) -> None:
    assert set(body) == {"id", "object", "model", "output", "output_text", "metrics"}
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["model"] == model
    assert body["output"] == [{"type": "output_text", "text": body["output_text"]}]
    assert tuple(body["metrics"]) == METRIC_KEYS
    m = body["metrics"]
    for key in ("backend_inference_wall_ms", "engine_total_wall_ms", "pool_total_wall_ms", "engine_queue_wait_ms",
                "engine_outside_backend_wall_ms", "gpu_time_to_first_token_ms", "gpu_generate_total_ms",
                "engine_prompt_tokens", "engine_output_tokens", "engine_tokens_per_second"):
        assert m[key] is not None, key
    assert m["backend_inference_wall_ms"] <= m["engine_total_wall_ms"] <= m["pool_total_wall_ms"]


@pytest.mark.parametrize("example", [INFERENCE_EXAMPLE, MULTI_TURN_EXAMPLE, TRANSLATE_KNOWN, TRANSLATE_MIXED],
                         ids=["inference", "multi-turn", "translategemma-known", "translategemma-mixed"])
def test_seed_examples_return_the_documented_envelope(proxy: ProxyProcess, example: dict[str, Any]) -> None:
    before = counters(proxy, example["model"])
    status, _, body = http("POST", proxy.url + "/v1/responses", body=example)
    assert status == 200, body
    assert_envelope(body, example["model"])
    after = counters(proxy, example["model"])
    m = body["metrics"]
    assert m["engine_output_tokens"] == after["tokens_predicted_total"] - before["tokens_predicted_total"]
    assert m["engine_prompt_tokens"] - m["engine_cached_prompt_tokens"] == \
        after["prompt_tokens_total"] - before["prompt_tokens_total"]


def test_streamed_inference_example_sends_every_event(proxy: ProxyProcess) -> None:
    before = counters(proxy, "tiny")
    req = urllib.request.Request(proxy.url + "/v1/responses", headers={"Content-Type": "application/json"},
                                 data=json.dumps({**INFERENCE_EXAMPLE, "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(resp.read())
    names = [name for name, _ in events]
    assert names[0] == "response.created" and names[-2:] == ["response.metrics", "response.completed"]
    deltas = [data["delta"] for name, data in events if name == "response.output_text.delta"]
    assert len(deltas) == len(names) - 3 and deltas
    completed = events[-1][1]["response"]
    assert_envelope(completed, "tiny")
    assert completed["output_text"] == "".join(deltas)
    assert events[-2][1]["metrics"] == completed["metrics"]
    after = counters(proxy, "tiny")
    assert completed["metrics"]["engine_output_tokens"] == after["tokens_predicted_total"] - before["tokens_predicted_total"]


def test_first_delta_arrives_while_the_backend_still_generates(proxy: ProxyProcess) -> None:
    port = proxy.admin_model("tiny")["replicas"][0]["port"]

    def processing() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/slots", timeout=10) as slots:
            return any(s["is_processing"] for s in json.load(slots))

    # All of its tokens (the model runs with --ignore-eos and --context-shift): the answer is far from
    # over at the check below, however busy the machine.
    body = {"model": "tiny", "input": "Go on.", "stream": True, "decoding": {"max_tokens": 10 ** 6, "temperature": 0}}
    req = urllib.request.Request(proxy.url + "/v1/responses", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        while True:
            line = resp.readline()
            assert line, "stream ended before any delta"
            if line.startswith(b"event: response.output_text.delta"):
                break
        assert processing()
    # The client left: the proxy closes the replica's connection, and llama-server stops.
    wait_for(lambda: not processing(), timeout=60, what="llama-server to stop the abandoned answer")


def test_multimodal_example_on_a_text_only_model_is_modality_unsupported(proxy: ProxyProcess) -> None:
    status, _, body = http("POST", proxy.url + "/v1/responses", body=MULTIMODAL_EXAMPLE)
    assert (status, body["error"]["code"]) == (400, "modality_unsupported")


@pytest.mark.parametrize("body, status, code", [
    ({"input": "x"}, 400, "missing_model"),
    ({"model": "nope", "input": "x"}, 404, "model_not_found"),
    ({"model": "tiny"}, 400, "invalid_input"),
    ({"model": "tiny", "input": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_input"),
    ({"model": "tiny", "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     400, "invalid_messages"),
    ({"model": "single", "input": "x", "thinking": "enabled"}, 400, "thinking_unsupported"),
    ({"model": "tiny", "input": [{"type": "file", "file": {"file_data": "data:application/pdf;base64,AA=="}}]},
     400, "modality_unsupported"),
    ({"model": "translate", "input": "x"}, 400, "target_lang_required"),
    ({"model": "translate", "input": "x", "target_lang_code": "en", "instructions": "x"}, 400,
     "instructions_not_allowed"),
    ({"model": "tiny", "input": "x", "decoding": {"temperature": -1}}, 400, "invalid_request"),
    ({"model": "tiny", "input": "x", "fairness_key": 7}, 400, "invalid_request"),
])
def test_validation_rules_over_http(proxy: ProxyProcess, body: dict[str, Any], status: int, code: str) -> None:
    got, _, answer = http("POST", proxy.url + "/v1/responses", body=body)
    assert (got, answer["error"]["code"]) == (status, code), answer


def test_capabilities_are_advertised(proxy: ProxyProcess) -> None:
    assert proxy.admin_model("tiny")["capabilities"] == {
        "modalities": ["text"], "multi_turn": True, "file_inputs": False,
        "thinking_modes": ["default", "enabled", "disabled"], "embeddings": False,
        "endpoints": ["/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/messages",
                      "/v1/messages/count_tokens", "/infill", "/tokenize", "/detokenize"]}
    assert proxy.admin_model("single")["capabilities"]["thinking_modes"] == ["default"]


def test_prometheus_counts_requests_per_model_endpoint_and_status(proxy: ProxyProcess) -> None:
    http("POST", proxy.url + "/v1/responses", body={"model": "tiny", "input": "x", "decoding": {"max_tokens": 2}})
    http("POST", proxy.url + "/v1/responses", body={"model": "tiny"})
    http("POST", proxy.url + "/v1/responses", body={"model": "no-such-model", "input": "x"})
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'llm_pool_requests_total{code="",endpoint="/v1/responses",key="other",model="tiny",status="200"}' in text
    assert re.search(r'llm_pool_requests_total\{code="[a-z_]+",endpoint="/v1/responses",key="other",model="tiny",'
                     r'status="400"\}', text)
    assert "no-such-model" not in text  # labels hold configured model ids only
    assert 'llm_pool_replicas_ready{model="tiny"} 1.0' in text


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_fields_are_ignored_and_named_at_both_levels(proxy: ProxyProcess, stream: bool) -> None:
    # Before: `decoding.min_p` was a 400 while an unknown top-level field passed silently.
    body = {"model": "tiny", "input": "x", "stream": stream, "seed_hint": 1,
            "decoding": {"min_p": 0.05, "max_tokens": 4}}
    status, headers, answer = http("POST", proxy.url + "/v1/responses", body=body)
    assert status == 200, answer
    assert headers["X-Ignored-Fields"] == "seed_hint, decoding.min_p"
    events = sse_events(answer) if stream else []
    envelope = events[-1][1]["response"] if stream else answer
    assert envelope["object"] == "response" and isinstance(envelope["output_text"], str)
