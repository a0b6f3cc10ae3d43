"""Every API the engines speak, through the one endpoint, with clients nobody here wrote: the
Anthropic SDK (create, stream, count_tokens, the pool's own 429 as its RateLimitError) and the
OpenAI SDK against real llama-server replicas of the tiny GGUF through a real `llm-pool serve`;
rerank on the tiny reranker GGUF, infill and tokenize on the demo model; Messages translated onto
chat for a shim (the sim) that does not speak it; and GET /v1/models listing a cold model that loads
on demand, which the next request then loads.
"""
from __future__ import annotations

import base64
import json
import threading
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import anthropic
import openai
import pytest

from helpers import ProxyProcess, http, tiny_png, wait_for

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def proxy(tiny_gguf: Path, tiny_reranker_gguf: Path, tiny_mmproj_gguf: Path,
          llama_server_bin: Path) -> Iterator[ProxyProcess]:
    llama = {"backend": "llama_server", "model_path": str(tiny_gguf), "llama_server_binary": str(llama_server_bin),
             "llama_server_n_ctx": 8192, "target_inflight": 1, "enabled": True,
             # A stream that must keep its slot (the 429 below) would end at the training context without it.
             "llama_server_extra_args": ["--context-shift"]}
    started = ProxyProcess({
        "tiny": llama,
        "cold": {**llama, "enabled": False, "load_on_demand": True},
        "hidden": {**llama, "enabled": False},
        "reranker": {**llama, "model_path": str(tiny_reranker_gguf), "llama_server_reranking": True,
                     "llama_server_n_ctx": 512, "llama_server_extra_args": []},
        "shim": {"backend": "sim", "enabled": True, "target_inflight": 2},
        "vision": {**llama, "llama_server_mmproj_path": str(tiny_mmproj_gguf), "modalities": ["text", "image"],
                   "llama_server_extra_args": []},
    }, engine={"fairness": {"max_pending_per_key": 1}})
    try:
        started.start()
        for name in ("tiny", "reranker", "shim", "vision"):
            started.wait_state(name, "loaded")
        yield started
    finally:
        survivors = started.cleanup()
        assert not survivors, survivors


@pytest.fixture(scope="module")
def claude(proxy: ProxyProcess) -> anthropic.Anthropic:
    # No key is checked by the pool (yet); the SDK wants one. No retries: a 429 is what the test reads.
    return anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)


def metrics_lines(proxy: ProxyProcess) -> list[str]:
    status, _, text = http("GET", proxy.url + "/metrics")
    assert status == 200
    return list(text.decode().splitlines())


def output_tokens(proxy: ProxyProcess, model: str) -> float:
    line = next((line for line in metrics_lines(proxy)
                 if line.startswith(f'llm_pool_output_tokens_total{{key="other",model="{model}"}}')), None)
    return float(line.split()[1]) if line else 0.0


# -- Anthropic Messages, natively at llama-server ------------------------------------------------

def test_the_anthropic_sdk_creates_a_message_that_llama_server_answered(proxy: ProxyProcess,
                                                                        claude: anthropic.Anthropic) -> None:
    before = output_tokens(proxy, "tiny")
    raw = claude.messages.with_raw_response.create(model="tiny", max_tokens=6, system="Be brief.", messages=CHAT)
    message = raw.parse()
    assert raw.headers["X-Replica"] == "0"
    assert (message.type, message.role, message.model) == ("message", "assistant", "tiny")
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    assert message.usage.input_tokens > 0
    # The pool read Anthropic's usage: its token counters moved by what the answer says.
    assert output_tokens(proxy, "tiny") - before == 6
    counted = [line for line in metrics_lines(proxy) if line.startswith("llm_pool_requests_total{")
               and 'model="tiny"' in line and 'endpoint="/v1/messages"' in line and 'status="200"' in line]
    assert counted and float(counted[0].split()[1]) >= 1


def test_the_anthropic_sdk_streams_event_by_event(proxy: ProxyProcess, claude: anthropic.Anthropic) -> None:
    # llama-server leaves its first write out of a short stream now and then (measured straight to it:
    # 20 of 150, 12 of 200 without message_start), and the SDK then has no message: the proxy sends
    # one. Forty streams meet that almost surely. Where that lost write held every text event (1 of
    # 300 through the proxy, measured), the message has no text: what streamed is still all it has.
    for _ in range(40):
        with claude.messages.stream(model="tiny", max_tokens=5, messages=CHAT) as stream:
            pieces = list(stream.text_stream)
            final = stream.get_final_message()
        assert "".join(pieces) == "".join(b.text for b in final.content if b.type == "text") and final.model == "tiny"
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                 "input": {"city": "Paris"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]


def test_an_agents_tools_reach_llama_server_as_they_are(proxy: ProxyProcess, claude: anthropic.Anthropic) -> None:
    port = proxy.wait_state("tiny", "loaded")["replicas"][0]["port"]
    direct = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0)
    greedy = {"temperature": 0}
    for turns, choice in ((TOOL_TURNS[:1], {"type": "auto"}), (TOOL_TURNS, {"type": "any"})):
        shapes = []
        for client in (direct, claude):
            message = client.messages.create(model="tiny", max_tokens=6, tools=[WEATHER], tool_choice=choice,  # type: ignore[list-item,arg-type]
                                             messages=turns, extra_body=greedy)  # type: ignore[arg-type]
            shapes.append(([b.type for b in message.content], message.stop_reason, message.usage.output_tokens))
        # Streamed through the pool only: straight to llama-server a stream now and then lacks its
        # message_start (test_the_anthropic_sdk_streams_event_by_event), which the pool puts back.
        with claude.messages.stream(model="tiny", max_tokens=6, tools=[WEATHER], messages=turns,  # type: ignore[list-item,arg-type]
                                    extra_body=greedy) as stream:
            final = stream.get_final_message()
        shapes.append(([b.type for b in final.content], final.stop_reason, final.usage.output_tokens))
        assert shapes[0][0] and shapes[0] == shapes[1] == shapes[2], shapes   # as straight to llama-server


def test_an_image_block_reaches_a_model_with_a_projector(claude: anthropic.Anthropic) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(tiny_png()).decode()}}
    question = {"type": "text", "text": "what is in the picture?"}

    def prompt_tokens(content: list[dict[str, Any]]) -> int:
        message = claude.messages.create(model="vision", max_tokens=2, messages=[{"role": "user", "content": content}])
        assert message.usage.output_tokens == 2
        return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)

    # The projector turned the image into tokens of the prompt.
    assert prompt_tokens([question, image]) > prompt_tokens([question])
    with pytest.raises(anthropic.BadRequestError, match="image_url|url"):
        # A URL the model's image rules refuse (data: only by default), checked as chat's are.
        claude.messages.create(model="vision", max_tokens=2, messages=[{"role": "user", "content": [
            question, {"type": "image", "source": {"type": "url", "url": "http://169.254.169.254/x.png"}}]}])


def test_count_tokens_passes_through(claude: anthropic.Anthropic) -> None:
    short = claude.messages.count_tokens(model="tiny", messages=CHAT)
    longer = claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hi " * 20}])
    assert 0 < short.input_tokens < longer.input_tokens


def test_a_full_queue_is_the_sdks_rate_limit_error(proxy: ProxyProcess, claude: anthropic.Anthropic) -> None:
    # The one slot held by a long stream, one request of key "k" waiting: the next of "k" is refused.
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 100000, "stream": True, "ignore_eos": True}
    hog = urllib.request.urlopen(urllib.request.Request(
        proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Fairness-Key": "hog"}), timeout=300)
    waited: list[Any] = []
    try:
        assert hog.readline().startswith(b"data: ")
        waiter = threading.Thread(target=lambda: waited.append(claude.messages.create(
            model="tiny", max_tokens=2, messages=CHAT, extra_headers={"X-Fairness-Key": "k"})), daemon=True)
        waiter.start()
        wait_for(lambda: proxy.admin_model("tiny")["waiting"] == 1, what="the first request of k to wait")
        with pytest.raises(anthropic.RateLimitError) as refused:
            claude.messages.create(model="tiny", max_tokens=2, messages=CHAT, extra_headers={"X-Fairness-Key": "k"})
    finally:
        hog.close()   # the slot frees: the waiting request is served
    assert refused.value.status_code == 429 and refused.value.response.headers["Retry-After"].isdigit()
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "rate_limit_error"
    waiter.join(timeout=120)
    assert waited and waited[0].usage.output_tokens == 2


def test_the_pools_own_errors_on_messages_are_anthropics_shape(proxy: ProxyProcess,
                                                              claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=2, messages=CHAT)
    status, _, body = http("POST", proxy.url + "/v1/messages", {"model": "tiny", "messages": CHAT})
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="does not serve /v1/messages/count_tokens"):
        claude.messages.count_tokens(model="shim", messages=CHAT)


# -- Anthropic Messages translated for a shim ----------------------------------------------------

def test_messages_are_translated_onto_chat_for_a_shim(claude: anthropic.Anthropic) -> None:
    raw = claude.messages.with_raw_response.create(model="shim", max_tokens=4, system="Be brief.", messages=CHAT)
    message = raw.parse()
    assert raw.headers["X-Replica"] == "0"
    assert message.id.startswith("msg_") and message.model == "shim" and message.content[0].text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4
    with claude.messages.stream(model="shim", max_tokens=4, messages=CHAT) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert pieces and "".join(pieces) == final.content[0].text and final.usage.output_tokens == 4


# -- rerank, infill, tokenize ----------------------------------------------------------------------

def test_rerank_scores_each_document(proxy: ProxyProcess) -> None:
    documents = ["the weather today", "a walk in the park", "lunch"]
    status, _, body = http("POST", proxy.url + "/v1/rerank",
                           {"model": "reranker", "query": "weather", "documents": documents})
    assert status == 200, body
    assert sorted(r["index"] for r in body["results"]) == [0, 1, 2]
    assert all(isinstance(r["relevance_score"], float) for r in body["results"])


def test_rerank_on_a_model_that_does_not_rerank_says_how_to_turn_it_on(proxy: ProxyProcess) -> None:
    status, _, body = http("POST", proxy.url + "/v1/rerank", {"model": "tiny", "query": "q", "documents": ["d"]})
    assert (status, body["error"]["code"]) == (400, "endpoint_unsupported")
    assert "llama_server_reranking: true" in body["error"]["message"]
    status, _, body = http("POST", proxy.url + "/infill", {"model": "shim", "input_prefix": "def f("})
    assert (status, body["error"]["code"]) == (400, "endpoint_unsupported")
    served = body["error"]["message"].split("it serves ")[1]
    assert "/v1/chat/completions" in served and "/infill" not in served


def test_infill_on_the_demo_model(proxy: ProxyProcess) -> None:
    status, _, body = http("POST", proxy.url + "/infill",
                           {"model": "tiny", "input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 4})
    assert status == 200, body
    assert body["tokens_predicted"] == 4 and isinstance(body["content"], str)


def test_tokenize_and_detokenize_round_trip(proxy: ProxyProcess) -> None:
    status, _, tokens = http("POST", proxy.url + "/tokenize", {"model": "tiny", "content": "hello world"})
    assert status == 200, tokens
    assert tokens["tokens"] and all(isinstance(t, int) for t in tokens["tokens"])
    status, _, text = http("POST", proxy.url + "/detokenize", {"model": "tiny", "tokens": tokens["tokens"]})
    assert status == 200 and text["content"].strip() == "hello world"
    status, _, body = http("POST", proxy.url + "/detokenize", {"model": "tiny", "tokens": ["x"]})
    assert (status, body["error"]["param"]) == (400, "tokens.0")


# -- the model list --------------------------------------------------------------------------------

def test_the_model_list_shows_a_cold_model_that_the_next_request_loads(proxy: ProxyProcess) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    listed = {m.id: m.model_dump() for m in client.models.list()}
    # `hidden` neither runs nor loads on demand: a request for it would be refused, so it is not offered.
    assert set(listed) == {"tiny", "cold", "reranker", "shim", "vision"}
    assert (listed["cold"]["status"], listed["cold"]["load_on_demand"]) == ("cold", True)
    assert listed["tiny"]["status"] == "loaded"
    assert "/v1/messages" in listed["shim"]["capabilities"]["endpoints"]
    assert "/infill" in listed["tiny"]["capabilities"]["endpoints"]
    answer = client.chat.completions.create(model="cold", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert answer.usage is not None and answer.usage.completion_tokens == 2
    assert {m.id: m.model_dump()["status"] for m in client.models.list()}["cold"] == "loaded"
