"""LoRA adapters as models of the pool (docs/adapters.md), through `llm-pool serve` and real
llama-server on the tiny GGUF with the tiny LoRA that `llm-pool setup` writes beside it: the adapter's
id answers otherwise than its base, the base answers as a model without adapters does, a hundred
swaps between them load nothing, and a tenant's globs judge the adapter's id itself."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from helpers import ProxyProcess, http

pytestmark = pytest.mark.integration

UI_KEY, ALL_KEY, ADMIN_TOKEN = "sk-ui-SECRET-7c7c", "sk-all-SECRET-8d8d", "admin-SECRET-9e9e"
ALL = {"Authorization": f"Bearer {ALL_KEY}"}
UI = {"Authorization": f"Bearer {UI_KEY}"}
QUESTION = [{"role": "user", "content": "hello there, how is the weather in the park"}]


@pytest.fixture(scope="module")
def proxy(tiny_gguf: Path, tiny_lora_gguf: Path, llama_server_bin: Path) -> Iterator[ProxyProcess]:
    def model(**fields: Any) -> dict[str, Any]:
        return {"backend": "llama_server", "model_path": str(tiny_gguf), "llama_server_binary": str(llama_server_bin),
                "llama_server_n_ctx": 2048, "target_inflight": 2, "enabled": True, **fields}
    # "plain" is the same GGUF without adapters: what the base must still answer.
    p = ProxyProcess({"demo": model(lora_adapters={"tiny": {"path": str(tiny_lora_gguf)}}),
                      "plain": model()}).with_tenants(
        {"ui": {"key_env": ["UI_KEY"], "fairness_key": "ui", "models": ["demo:*"]},
         "all": {"key_env": ["ALL_KEY"], "fairness_key": "all"}},
        {"UI_KEY": UI_KEY, "ALL_KEY": ALL_KEY}, ADMIN_TOKEN)
    p.start_loaded("demo", "plain")
    yield p
    assert not p.cleanup()


def answer(proxy: ProxyProcess, model: str, headers: dict[str, str] = ALL, stream: bool = False, **fields: Any) -> str:
    """The answer's text at temperature 0. (A stream's text can be shorter than the whole answer's:
    llama-server leaves out a last piece that is no whole UTF-8 character, so streams are compared
    with streams.)"""
    status, _, body = http("POST", proxy.url + "/v1/chat/completions", headers=headers,
                           body={"model": model, "messages": QUESTION, "max_tokens": 12, "temperature": 0,
                                 "stream": stream, **fields})
    assert status == 200, body
    if not stream:
        return str(body["choices"][0]["message"]["content"])
    text = body.decode() if isinstance(body, bytes) else str(body)
    pieces = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces if p["choices"])


def metric(proxy: ProxyProcess, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when none)."""
    status, _, raw = http("GET", proxy.url + "/metrics")
    assert status == 200
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    total = 0.0
    for line in text.splitlines():
        found = re.match(rf"^{re.escape(name)}(?:{{(.*)}})? (\S+)$", line)
        if found and all(f'{k}="{v}"' in (found.group(1) or "") for k, v in labels.items()):
            total += float(found.group(2))
    return total


def test_the_adapter_answers_otherwise_and_the_base_as_without_it(proxy: ProxyProcess) -> None:
    base, tuned, plain = answer(proxy, "demo"), answer(proxy, "demo:tiny"), answer(proxy, "plain")
    assert tuned != base
    assert base == plain   # the adapter loaded beside it changes nothing of the base's answers
    # A client's own `lora` list never reaches the engine: the base stays the base.
    assert answer(proxy, "demo", lora=[{"id": 0, "scale": 1.0}]) == base
    # A stream of the adapter is the adapter's too, and says so.
    assert answer(proxy, "demo:tiny", stream=True) != answer(proxy, "demo", stream=True)
    assert answer(proxy, "demo:tiny", stream=True) == answer(proxy, "demo:tiny", stream=True)
    status, headers, _ = http("POST", proxy.url + "/v1/chat/completions", headers=ALL,
                              body={"model": "demo:tiny", "messages": QUESTION, "max_tokens": 2, "stream": True})
    assert status == 200 and headers["X-LLM-Pool-Model"] == "demo:tiny"


def test_a_hundred_swaps_between_base_and_adapter_load_nothing(proxy: ProxyProcess) -> None:
    base, tuned = answer(proxy, "demo"), answer(proxy, "demo:tiny")
    loads = metric(proxy, "llm_pool_model_loads_total")
    waited = metric(proxy, "llm_pool_model_load_wait_seconds_count")
    before = metric(proxy, "llm_pool_adapter_requests_total", model="demo", adapter="tiny", status="200")
    for i in range(100):
        model = "demo:tiny" if i % 2 else "demo"
        assert answer(proxy, model) == (tuned if i % 2 else base), f"swap {i}"
    assert metric(proxy, "llm_pool_model_loads_total") == loads
    assert metric(proxy, "llm_pool_model_load_wait_seconds_count") == waited   # none waited on a load
    assert metric(proxy, "llm_pool_adapter_requests_total", model="demo", adapter="tiny", status="200") == before + 50
    assert metric(proxy, "llm_pool_replica_adapter", model="demo", adapter="tiny") == 1


def test_models_list_the_adapter_with_its_parent_and_tenants_judge_its_id(proxy: ProxyProcess) -> None:
    status, _, listed = http("GET", proxy.url + "/v1/models", headers=ALL)
    assert status == 200
    entries = {m["id"]: m for m in listed["data"]}
    assert entries["demo:tiny"]["parent"] == "demo" and "parent" not in entries["demo"]
    # The ui tenant may use demo:* and not demo: the adapter only.
    status, _, listed = http("GET", proxy.url + "/v1/models", headers=UI)
    assert [m["id"] for m in listed["data"]] == ["demo:tiny"]
    assert answer(proxy, "demo:tiny", headers=UI)
    status, _, body = http("POST", proxy.url + "/v1/chat/completions", headers=UI,
                           body={"model": "demo", "messages": QUESTION, "max_tokens": 4})
    assert status == 403 and body["error"]["code"] == "model_not_allowed", body
    # Its ledger rows name the model id it asked for.
    status, _, usage = http("GET", proxy.url + "/v1/admin/usage?group_by=tenant,model", headers=proxy.admin_headers)
    assert status == 200, usage
    rows = {r["model"]: (r["requests"], r["errors"]) for r in usage["data"] if r["tenant"] == "ui"}
    assert rows == {"demo:tiny": (1, 0), "demo": (1, 1)}   # the refused request is the base's


def test_the_admin_sees_the_adapters_and_llama_server_keeps_them(proxy: ProxyProcess) -> None:
    view = proxy.admin_model("demo")
    assert view["adapters"] == [{"name": "tiny", "id": "demo:tiny", "scale": 1.0}]
    assert [r["adapters"] for r in view["replicas"]] == [["tiny"]]
    url = proxy.url + "/v1/admin/models/demo/adapters"
    status, _, body = http("POST", url + "/tiny/unload", headers=proxy.admin_headers)
    assert status == 409 and body["error"]["code"] == "adapter_not_unloadable", body
    status, _, body = http("POST", url + "/tiny/load", headers=proxy.admin_headers)
    assert status == 200 and body["replicas"][0]["adapters"] == ["tiny"], body
    status, _, body = http("POST", url + "/other/load", headers=proxy.admin_headers)
    assert status == 404 and body["error"]["code"] == "adapter_not_found", body
    status, _, body = http("POST", url + "/tiny/load", headers=UI)   # a tenant's key is no admin's
    assert status in (401, 403), body


def test_with_two_workers_the_adapter_is_chosen_as_with_one(proxy: ProxyProcess, tiny_gguf: Path,
                                                           tiny_lora_gguf: Path, llama_server_bin: Path) -> None:
    """The controller decides (the adapter's base, its fields), a worker relays the stream."""
    expected = {(model, stream): answer(proxy, model, stream=stream)
                for model in ("demo", "demo:tiny") for stream in (False, True)}
    two = ProxyProcess({"demo": {"backend": "llama_server", "model_path": str(tiny_gguf),
                                 "llama_server_binary": str(llama_server_bin), "llama_server_n_ctx": 2048,
                                 "enabled": True, "lora_adapters": {"tiny": {"path": str(tiny_lora_gguf)}}}},
                       service={"workers": 2})
    try:
        two.start_loaded("demo")
        got = {(model, stream): answer(two, model, headers={}, stream=stream) for model, stream in expected}
        assert got == expected
        assert expected[("demo", False)] != expected[("demo:tiny", False)]
    finally:
        assert not two.cleanup()


def test_a_base_request_after_the_adapters_reuses_none_of_its_cache(proxy: ProxyProcess, tiny_gguf: Path,
                                                                     tiny_lora_gguf: Path, llama_server_bin: Path) -> None:
    """llama-server keeps a slot's cache when a request names no adapter after one that named some:
    in one slot, without tenants or a store, a base request after the adapter's would have reused the
    prompt computed under the adapter. The pool picks the slot and knows whose cache it holds."""
    expected = {model: answer(proxy, model) for model in ("demo", "demo:tiny")}
    one = ProxyProcess({"demo": {"backend": "llama_server", "model_path": str(tiny_gguf),
                                 "llama_server_binary": str(llama_server_bin), "llama_server_n_ctx": 2048,
                                 "target_inflight": 1, "enabled": True,
                                 "lora_adapters": {"tiny": {"path": str(tiny_lora_gguf)}}}})
    try:
        one.start_loaded("demo")
        got = [(model, answer(one, model, headers={})) for model in ("demo:tiny", "demo", "demo:tiny", "demo:tiny",
                                                                     "demo", "demo")]
        assert got == [(model, expected[model]) for model, _ in got]
    finally:
        assert not one.cleanup()


@pytest.mark.parametrize("path, body, text", [
    ("/v1/completions", {"prompt": "hello there, how is the weather", "max_tokens": 12, "temperature": 0},
     lambda a: a["choices"][0]["text"]),
    ("/v1/responses", {"input": QUESTION[0]["content"], "decoding": {"max_tokens": 12, "temperature": 0}},
     lambda a: a["output_text"]),
    ("/v1/messages", {"messages": QUESTION, "max_tokens": 12, "temperature": 0},
     lambda a: "".join(b.get("text", "") for b in a["content"])),
    ("/api/chat", {"messages": QUESTION, "stream": False, "options": {"num_predict": 12, "temperature": 0}},
     lambda a: a["message"]["content"]),
])
def test_every_route_runs_the_adapter_its_model_id_names(proxy: ProxyProcess, path: str, body: dict[str, Any],
                                                          text: Any) -> None:
    answers = {}
    for model in ("demo", "demo:tiny", "plain"):
        status, _, got = http("POST", proxy.url + path, headers=ALL, body={"model": model, **body})
        assert status == 200, got
        answers[model] = text(got)
    assert answers["demo:tiny"] != answers["demo"] and answers["demo"] == answers["plain"], answers
