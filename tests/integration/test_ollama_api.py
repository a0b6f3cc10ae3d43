"""The Ollama API (docs/api.md: The Ollama API) through a real `llm-pool serve`: the `ollama` Python
client against the demo llama-server (the tiny GGUF) and a second one serving embeddings, every call
parsed by the client's own types; each answer's fields compared with what Ollama documents; options,
format and tools as the engine receives them (the FAKE provider of tests/fakes.py, which records
every request and calls a tool when told); errors in Ollama's shape; tenants' keys."""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Iterator

import ollama
import pytest
import yaml

from fakes import FakeProvider
from helpers import ProxyProcess, http

pytestmark = pytest.mark.integration

PROVIDER_KEY = "sk-fake-SECRET-0c11a9"
TENANT_KEY = "sk-ollama-SECRET-5e7f"
CHAT = [{"role": "user", "content": "Why is the sky blue?"}]
# The fields of each answer, as Ollama's API reference (docs.ollama.com/api) lists them. `context`
# of /api/generate is left out on purpose: the pool keeps no token context (its 400 says so).
DONE = {"model", "created_at", "done", "done_reason", "total_duration", "load_duration", "prompt_eval_count",
        "prompt_eval_duration", "eval_count", "eval_duration"}
DOCUMENTED = {
    "tags": {"name", "model", "modified_at", "size", "digest", "details"},
    "details": {"parent_model", "format", "family", "families", "parameter_size", "quantization_level"},
    "ps": {"name", "model", "size", "digest", "details", "expires_at", "size_vram", "context_length"},
    "show": {"modelfile", "parameters", "template", "details", "model_info", "capabilities", "modified_at"},
    "chat": DONE | {"message"},
    "chat_part": {"model", "created_at", "message", "done"},
    "generate": DONE | {"response"},
    "generate_part": {"model", "created_at", "response", "done"},
    "embed": {"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"},
}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(PROVIDER_KEY, models=("gpt-fake",)).start()
    yield provider
    provider.stop()


@pytest.fixture(scope="module")
def proxy(tiny_gguf: Path, llama_server_bin: Path, fake: FakeProvider) -> Iterator[ProxyProcess]:
    llama = {"backend": "llama_server", "model_path": str(tiny_gguf), "llama_server_binary": str(llama_server_bin),
             "llama_server_n_ctx": 2048, "target_inflight": 2, "enabled": True}
    models = {"demo": llama, "demo-embed": {**llama, "llama_server_embeddings": True, "llama_server_pooling": "mean"},
              "stand-in": {"backend": "openai_remote", "model_path": None, "remote_api_kind": "chat_completions",
                           "remote_base_url": fake.url, "remote_api_key_env": "FAKE_PROVIDER_KEY",
                           "remote_model": "gpt-fake", "remote_max_retries": 0,
                           "remote_health_check": "config_only", "target_inflight": 4, "enabled": True}}
    proc = ProxyProcess(models, engine={"aliases": {"assistant": "demo"}})
    proc.env = {"FAKE_PROVIDER_KEY": PROVIDER_KEY}
    try:
        proc.start()
        for name in models:
            proc.wait_state(name, "loaded")
        yield proc
    finally:
        survivors = proc.cleanup()
        assert not survivors, f"processes outlived their test and were killed: {survivors}"


@pytest.fixture
def client(proxy: ProxyProcess) -> ollama.Client:
    return ollama.Client(host=proxy.url)


@pytest.fixture
def remote(proxy: ProxyProcess, fake: FakeProvider) -> Iterator[ollama.Client]:
    """A client whose requests allow remote models (the stand-in is one), as a header the SDK sends."""
    fake.clear()
    yield ollama.Client(host=proxy.url, headers={"X-Allow-Remote": "true"})
    fake.clear()


def upstream(fake: FakeProvider) -> dict[str, Any]:
    (request,) = fake.received("/v1/chat/completions")
    return request["body"]  # type: ignore[return-value]


# -- the ollama client, against llama-server ----------------------------------------------------------

def test_the_client_lists_the_models_and_what_runs(client: ollama.Client) -> None:
    listed = {m.model: m for m in client.list().models}
    assert {"demo", "demo-embed", "stand-in", "assistant"} <= set(listed)
    assert listed["demo"].details is not None and listed["demo"].details.format == "gguf"
    assert listed["demo"].size and listed["demo"].size > 0 and len(listed["demo"].digest or "") == 64
    running = {m.model: m for m in client.ps().models}
    assert running["demo"].context_length == 2048
    shown = client.show("demo:latest")
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.modelinfo is not None and shown.modelinfo["llama_server.context_length"] == 2048
    assert "embedding" in (client.show("demo-embed").capabilities or [])


def test_the_client_chats_streamed_and_not(client: ollama.Client) -> None:
    answer = client.chat(model="demo", messages=CHAT, options={"num_predict": 8, "temperature": 0}, stream=False)
    assert answer.done and answer.done_reason in ("stop", "length")
    assert isinstance(answer.message.content, str) and answer.message.role == "assistant"
    assert answer.eval_count is not None and 0 < answer.eval_count <= 8
    assert answer.prompt_eval_count and answer.total_duration and answer.total_duration > 0
    parts = list(client.chat(model="demo:latest", messages=CHAT, options={"num_predict": 8, "temperature": 0},
                             stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == answer.message.content   # greedy: the same
    assert parts[-1].eval_count == answer.eval_count


def test_the_client_generates_loads_and_embeds(client: ollama.Client) -> None:
    made = client.generate(model="assistant", prompt="Once upon a time", options={"num_predict": 6, "seed": 1},
                           stream=False)
    assert made.done and isinstance(made.response, str) and made.eval_count and made.eval_count <= 6
    parts = list(client.generate(model="demo", prompt="Once upon a time", options={"num_predict": 6}, stream=True))
    assert parts[-1].done and parts[-1].eval_count
    raw = client.generate(model="demo", prompt="<s>Once", raw=True, options={"num_predict": 4}, stream=False)
    assert raw.done and raw.eval_count and raw.eval_count <= 4
    loaded = client.generate(model="demo")   # no prompt: Ollama's way to load a model
    assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
    vectors = client.embed(model="demo-embed", input=["a lighthouse", "a keeper"])
    assert len(vectors.embeddings) == 2 and len(vectors.embeddings[0]) == len(vectors.embeddings[1]) > 0
    assert vectors.prompt_eval_count and vectors.prompt_eval_count > 0
    alone = client.embed(model="demo-embed", input="a lighthouse").embeddings[0]
    assert client.embeddings(model="demo-embed", prompt="a lighthouse").embedding == list(alone)


def test_every_answer_has_the_fields_ollama_documents(proxy: ProxyProcess) -> None:
    _, _, tags = http("GET", proxy.url + "/api/tags")
    for model in tags["models"]:
        assert set(model) == DOCUMENTED["tags"] and set(model["details"]) == DOCUMENTED["details"], model
    _, _, ps = http("GET", proxy.url + "/api/ps")
    assert ps["models"] and all(set(m) == DOCUMENTED["ps"] for m in ps["models"]), ps
    _, _, shown = http("POST", proxy.url + "/api/show", {"model": "demo"})
    assert set(shown) == DOCUMENTED["show"], shown
    options = {"num_predict": 4}
    for route, body in (("chat", {"messages": CHAT}), ("generate", {"prompt": "hi"})):
        status, headers, answer = http("POST", proxy.url + f"/api/{route}",
                                       {"model": "demo", "stream": False, "options": options, **body})
        assert status == 200 and set(answer) == DOCUMENTED[route], answer
        assert headers["Content-Type"].startswith("application/json")
        # Ollama streams by default: NDJSON, one object a line, the last one `done` with the counts.
        status, headers, text = http("POST", proxy.url + f"/api/{route}", {"model": "demo", "options": options, **body})
        assert status == 200 and headers["Content-Type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in text.decode().splitlines()]
        assert all(set(line) == DOCUMENTED[f"{route}_part"] for line in lines[:-1]), lines
        assert set(lines[-1]) == DOCUMENTED[route] and lines[-1]["done"] is True
        assert all(isinstance(lines[-1][k], int) for k in DONE if k.endswith(("duration", "count")))
    _, _, embedded = http("POST", proxy.url + "/api/embed", {"model": "demo-embed", "input": "hi"})
    assert set(embedded) == DOCUMENTED["embed"] and len(embedded["embeddings"]) == 1
    assert http("GET", proxy.url + "/api/version")[2].keys() == {"version"}


# -- what reaches the engine ----------------------------------------------------------------------

def test_options_and_format_reach_the_engine_as_its_fields(remote: ollama.Client, fake: FakeProvider) -> None:
    remote.chat(model="stand-in", messages=CHAT, format="json",
                options={"temperature": 0.3, "top_p": 0.9, "num_predict": 12, "stop": ["\n\n"], "num_gpu": 99})
    sent = upstream(fake)
    assert (sent["temperature"], sent["top_p"], sent["max_tokens"], sent["response_format"]) == (
        0.3, 0.9, 12, {"type": "json_object"})
    assert sent["stop"] == ["\n\n"] and "num_gpu" not in sent
    fake.clear()
    schema = {"type": "object", "properties": {"sky": {"type": "string"}}, "required": ["sky"]}
    remote.chat(model="stand-in", messages=CHAT, format=schema)
    assert upstream(fake)["response_format"]["json_schema"]["schema"] == schema


def test_a_tool_call_comes_back_whole_streamed_and_not(remote: ollama.Client, fake: FakeProvider) -> None:
    fake.tool_call = ("get_weather", {"city": "Paris", "unit": "celsius"})
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    answer = remote.chat(model="stand-in", messages=CHAT, tools=tools)
    (call,) = answer.message.tool_calls or []
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris", "unit": "celsius"})
    calls = [c for part in remote.chat(model="stand-in", messages=CHAT, tools=tools, stream=True)
             for c in part.message.tool_calls or ()]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    # The agent's next turn: its call and the tool's answer reach the engine as chat's tool messages.
    fake.clear()
    remote.chat(model="stand-in", tools=tools, messages=[
        *CHAT, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                               "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 degrees", "tool_name": "get_weather"}])
    turns = upstream(fake)["messages"]
    assert turns[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert turns[2] == {"role": "tool", "content": "18 degrees", "tool_call_id": turns[1]["tool_calls"][0]["id"]}


# -- errors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("route, body, status, words", [
    ("chat", {"model": "nope", "messages": CHAT}, 404, "model 'nope' is not configured"),
    ("chat", {"model": "demo", "messages": CHAT, "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ("chat", {"model": "demo", "messages": CHAT, "options": {"num_ctx": 100000}}, 400,
     "more than this model's context (2048 tokens, llama_server_n_ctx)"),
    ("chat", {"model": "demo", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("chat", {"model": "demo", "messages": CHAT, "format": "xml"}, 400, "format"),
    ("chat", {"model": "demo", "messages": CHAT, "keep_alive": "soon"}, 400, "keep_alive"),
    ("generate", {"model": "demo", "prompt": "hi", "template": "{{ .Prompt }}"}, 400, "template"),
    ("generate", {"model": "demo", "prompt": "hi", "raw": True, "system": "be brief"}, 400, "system"),
    ("generate", {"model": "demo", "prompt": "hi", "context": [1, 2, 3]}, 400, "context"),
    ("generate", {"model": "demo", "prompt": "hi", "images": [base64.b64encode(b"\x89PNG....").decode()]}, 400,
     "does not accept images"),
    ("embed", {"model": "demo", "input": "hi"}, 400, "demo"),
    ("pull", {"model": "llama3"}, 501, "/v1/admin/models/{name}/load"),
])
def test_a_wrong_request_is_an_error_in_ollamas_shape(proxy: ProxyProcess, route: str, body: dict[str, Any],
                                                      status: int, words: str) -> None:
    got, _, answer = http("POST", proxy.url + f"/api/{route}", {"stream": False, **body})
    assert got == status and set(answer) == {"error"} and words in answer["error"], answer
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=proxy.url)._request_raw("POST", f"/api/{route}", json={"stream": False, **body})
    assert info.value.status_code == status


def test_a_tenants_key_is_asked_for_and_its_requests_are_in_its_ledger(proxies: list[ProxyProcess]) -> None:
    proxy = ProxyProcess({"sim": {"backend": "sim", "enabled": True, "sim": {"ttft_ms": 1}}})
    proxy.config["tenants"] = {"editor": {"key_env": ["EDITOR_KEY"], "fairness_key": "editor"}}
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.env = {"EDITOR_KEY": TENANT_KEY}
    proxies.append(proxy)
    proxy.start()
    proxy.wait_state("sim", "loaded")
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=proxy.url).chat(model="sim", messages=CHAT)
    assert info.value.status_code == 401 and "API key" in info.value.error
    client = ollama.Client(host=proxy.url, headers={"Authorization": f"Bearer {TENANT_KEY}"})
    assert [m.model for m in client.list().models] == ["sim"]
    assert client.chat(model="sim", messages=CHAT, options={"num_predict": 4}).done
    assert list(client.chat(model="sim", messages=CHAT, options={"num_predict": 4}, stream=True))[-1].done
    _, _, usage = http("GET", proxy.url + "/v1/admin/usage?group_by=tenant,model")
    (row,) = usage["data"]
    assert (row["tenant"], row["model"], row["requests"]) == ("editor", "sim", 2) and row["output_tokens"] > 0


def test_ignored_fields_are_named_back_whatever_their_names(proxy: ProxyProcess) -> None:
    # A key with a control character once dropped the connection: a header value holds visible ASCII.
    for path, body in (("/api/chat", {"messages": CHAT, "stream": False, "options": {"num_predict": 2}}),
                       ("/v1/responses", {"input": "hi", "decoding": {"max_tokens": 2}})):
        status, headers, answer = http("POST", proxy.url + path, {"model": "demo", "\u001f": 1, "é": 2, **body})
        assert status == 200, answer
        assert headers["X-Ignored-Fields"] == "\\u001f, \\u00e9", headers
