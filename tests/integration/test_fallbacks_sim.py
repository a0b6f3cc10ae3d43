"""Aliases and fallbacks (docs/routing.md) on a real `llm-pool serve`: real supervisord, sim replicas,
the FAKE provider of tests/fakes.py as a paid remote model, and tenants. An alias is its model to a
client; a model that cannot answer (not loaded, its queue full) hands the request to the next of its
`fallbacks` for that reason, on every generation route, streamed or not, with one and two workers;
the answer names the model that served it; a remote fallback needs the request's allow_remote; a
tenant's request is one request however many models it tried."""
from __future__ import annotations

import json
from http.client import HTTPConnection
from typing import Any, Iterator

import pytest
import yaml

from fakes import FakeProvider
from helpers import ProxyProcess, http, wait_for

pytestmark = pytest.mark.integration

PROVIDER_KEY = "sk-fake-SECRET-a81c44"
KEYS = {"APP_KEY": "sk-app-SECRET-51d0", "ONCE_KEY": "sk-once-SECRET-7e2b"}
SIM = {"max_seqs": 8, "decode_tokens_per_s": 2000, "ttft_ms": 1}


def sim(enabled: bool = True, **fields: Any) -> dict[str, Any]:
    return {"backend": "sim", "enabled": enabled, "target_inflight": 4, "sim": SIM, **fields}


MODELS = {
    "up": sim(),
    "up-two": sim(),
    # Not loaded, and not loaded on demand: unavailable. Its fallback is named by an alias.
    "down": sim(enabled=False, fallbacks=["assistant"]),
    # Loaded; its one replica is stopped by the test (supervisorctl): no healthy replica.
    "fragile": sim(fallbacks=["up-two"]),
    # Falls back only for a prompt too long for it: not loaded is its own answer.
    "picky": sim(enabled=False, fallbacks=[{"model": "up", "on": ["context_length_exceeded"]}]),
    # One slot and slow: a second request finds it busy (engine.fairness: no request waits).
    "busy": sim(target_inflight=1, sim={"max_seqs": 1, "decode_tokens_per_s": 5, "ttft_ms": 1}, fallbacks=["up"]),
    # Tried in order: a fallback's own fallbacks are not followed, a paid one needs allow_remote.
    "chain": sim(enabled=False, fallbacks=["down", "paid", "up-two"]),
    "paid": {"backend": "openai_remote", "model_path": None, "remote_api_kind": "chat_completions",
             "remote_api_key_env": "FAKE_PROVIDER_KEY", "remote_model": "gpt-fake", "remote_max_retries": 0,
             "remote_health_check": "config_only", "target_inflight": 4, "enabled": True},
}
TENANTS = {
    "app": {"key_env": ["APP_KEY"], "fairness_key": "app", "allow_remote": True},
    "once": {"key_env": ["ONCE_KEY"], "fairness_key": "once", "limits": {"requests_per_minute": 1}},
}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(PROVIDER_KEY, models=("gpt-fake",)).start()
    yield provider
    provider.stop()


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def proxy(request: pytest.FixtureRequest, fake: FakeProvider) -> Iterator[ProxyProcess]:
    models = {**MODELS, "paid": {**MODELS["paid"], "remote_base_url": fake.url}}
    proc = ProxyProcess(models, service={"workers": request.param},
                        engine={"aliases": {"assistant": "up"}, "fairness": {"max_pending_per_executor": 0}})
    proc.config["tenants"] = TENANTS
    proc.config_path.write_text(yaml.safe_dump(proc.config))
    proc.env = {**KEYS, "FAKE_PROVIDER_KEY": PROVIDER_KEY}
    try:
        proc.start()
        for name in ("up", "up-two", "fragile", "busy", "paid"):
            proc.wait_state(name, "loaded")
        yield proc
    finally:
        survivors = proc.cleanup()
        assert not survivors, f"processes outlived their test and were killed: {survivors}"


def post(proxy: ProxyProcess, path: str, body: dict[str, Any], key: str = "APP_KEY") -> tuple[int, dict[str, str], Any]:
    return http("POST", proxy.url + path, body, headers={"Authorization": f"Bearer {KEYS[key]}"})


def chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def fallbacks_counted(proxy: ProxyProcess, model: str, to: str, reason: str) -> float:
    _, _, text = http("GET", proxy.url + "/metrics")
    want = f'llm_pool_fallbacks_total{{model="{model}",reason="{reason}",to="{to}"}} '
    return next((float(line[len(want):]) for line in text.decode().splitlines() if line.startswith(want)), 0.0)


def test_models_lists_an_alias_with_what_it_stands_for(proxy: ProxyProcess) -> None:
    status, _, body = http("GET", proxy.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['APP_KEY']}"})
    assert status == 200, body
    entries = {m["id"]: m for m in body["data"]}
    assert entries["assistant"]["alias_of"] == "up"
    assert "alias_of" not in entries["up"]


def test_a_request_to_an_alias_is_served_by_its_model_and_says_so(proxy: ProxyProcess) -> None:
    status, headers, body = post(proxy, "/v1/chat/completions", chat("assistant"))
    assert status == 200, body
    assert headers["X-LLM-Pool-Model"] == "up"
    assert body["model"] == "up"
    status, headers, body = post(proxy, "/v1/chat/completions", chat("up"))
    assert (status, headers["X-LLM-Pool-Model"]) == (200, "up")
    # The model's own metrics count it, never a name a client typed.
    _, _, text = http("GET", proxy.url + "/metrics")
    assert 'model="assistant"' not in text.decode()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat("down")),
    ("/v1/completions", {"model": "down", "prompt": "hi", "max_tokens": 4}),
    ("/v1/responses", {"model": "down", "input": "hi", "max_output_tokens": 16}),
    ("/v1/messages", {"model": "down", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_model_not_loaded_hands_each_generation_route_to_its_fallback(proxy: ProxyProcess, path: str,
                                                                         body: dict[str, Any]) -> None:
    before = fallbacks_counted(proxy, "down", "up", "unavailable")
    status, headers, answer = post(proxy, path, body)
    assert status == 200, answer
    assert headers["X-LLM-Pool-Model"] == "up"
    assert answer["model"] == "up"
    assert fallbacks_counted(proxy, "down", "up", "unavailable") == before + 1


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat("down", stream=True)),
    ("/v1/responses", {"model": "down", "input": "hi", "max_output_tokens": 16, "stream": True}),
    ("/v1/messages", {"model": "down", "max_tokens": 4, "stream": True,
                      "messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_stream_is_handed_over_before_its_first_byte(proxy: ProxyProcess, path: str, body: dict[str, Any]) -> None:
    status, headers, answer = post(proxy, path, body)
    assert status == 200, answer
    assert headers["X-LLM-Pool-Model"] == "up"
    text = answer.decode()
    models = {event.get("model") or event.get("response", event.get("message", {})).get("model")
              for event in (json.loads(line[5:]) for line in text.splitlines()
                            if line.startswith("data:") and line.strip() != "data: [DONE]")}
    assert models - {None} == {"up"}, text


def test_a_model_whose_replicas_are_stopped_is_answered_by_its_fallback(proxy: ProxyProcess) -> None:
    program = proxy.admin_model("fragile")["replicas"][0]["program"]
    try:
        assert "stopped" in proxy.supervisorctl("stop", program).stdout
        wait_for(lambda: proxy.admin_model("fragile")["replicas"][0]["state"] == "stopped", what="the stop seen")
        for stream in (False, True):
            status, headers, body = post(proxy, "/v1/chat/completions", chat("fragile", stream=stream))
            assert (status, headers["X-LLM-Pool-Model"]) == (200, "up-two"), body
        assert fallbacks_counted(proxy, "fragile", "up-two", "unavailable") == 2
    finally:
        proxy.supervisorctl("start", program)
    proxy.wait_replicas_ready("fragile", 1)
    status, headers, _ = post(proxy, "/v1/chat/completions", chat("fragile"))
    assert (status, headers["X-LLM-Pool-Model"]) == (200, "fragile")


def test_a_fallback_for_other_reasons_leaves_the_models_own_error(proxy: ProxyProcess) -> None:
    status, headers, body = post(proxy, "/v1/chat/completions", chat("picky"))
    assert (status, body["error"]["code"]) == (409, "model_not_loaded"), body
    assert "X-LLM-Pool-Model" not in headers or headers["X-LLM-Pool-Model"] == "picky"
    # A client's own mistake is never handed on: another model would refuse it the same.
    status, _, body = post(proxy, "/v1/chat/completions", {"model": "down", "max_tokens": 4})
    assert (status, body["error"]["param"]) == (400, "messages"), body
    assert fallbacks_counted(proxy, "picky", "up", "unavailable") == 0


def test_a_busy_model_hands_a_request_it_cannot_queue_to_its_fallback(proxy: ProxyProcess) -> None:
    conn = HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    try:
        # The one slot, held by a slow stream until this test closes it.
        conn.request("POST", "/v1/chat/completions", json.dumps(chat("busy", stream=True, max_tokens=200)),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS['APP_KEY']}"})
        held = conn.getresponse()
        assert held.status == 200 and held.getheader("X-LLM-Pool-Model") == "busy"
        held.fp.readline()   # its first event: it is running
        status, headers, body = post(proxy, "/v1/chat/completions", chat("busy"))
        assert (status, headers["X-LLM-Pool-Model"]) == (200, "up"), body
        assert fallbacks_counted(proxy, "busy", "up", "overloaded") >= 1
    finally:
        conn.close()


def test_a_remote_fallback_answers_only_a_request_that_allows_remote(proxy: ProxyProcess, fake: FakeProvider) -> None:
    fake.clear()
    # `down` is unavailable and its own fallbacks are not chain's; `paid` wants allow_remote: up-two.
    status, headers, body = post(proxy, "/v1/chat/completions", chat("chain"))
    assert (status, headers["X-LLM-Pool-Model"]) == (200, "up-two"), body
    assert fake.received("/v1/chat/completions") == []
    status, headers, body = post(proxy, "/v1/chat/completions", chat("chain", allow_remote=True))
    assert (status, headers["X-LLM-Pool-Model"]) == (200, "paid"), body
    assert len(fake.received("/v1/chat/completions")) == 1
    # A stream to a remote fallback is charged as any stream to it: its usage is asked for.
    status, headers, _ = post(proxy, "/v1/chat/completions", chat("chain", allow_remote=True, stream=True))
    assert (status, headers["X-LLM-Pool-Model"]) == (200, "paid")
    assert fake.received("/v1/chat/completions")[-1]["body"]["stream_options"] == {"include_usage": True}


def test_a_tenants_request_is_one_request_whichever_model_answers(proxy: ProxyProcess) -> None:
    # One request a minute: the fallback's run is the same request, so it is admitted; the next is not.
    status, headers, body = post(proxy, "/v1/chat/completions", chat("down"), key="ONCE_KEY")
    assert (status, headers["X-LLM-Pool-Model"]) == (200, "up"), body
    status, _, body = post(proxy, "/v1/chat/completions", chat("up-two"), key="ONCE_KEY")
    assert (status, body["error"]["code"]) == (429, "rate_limited"), body
    # Its ledger row is the model that answered (the refused one has its own), none the model asked.
    status, _, body = http("GET", proxy.url + "/v1/admin/usage?group_by=tenant,model")
    assert status == 200, body
    rows = {row["model"]: row["requests"] for row in body["data"] if row["tenant"] == "once"}
    assert rows == {"up": 1, "up-two": 1}, body
