"""`openai_remote` end to end: a real `llm-pool serve` in front of the FAKE provider of tests/fakes.py.

One proxy serves every remote model these tests need, each pointing at the same fake under its own
upstream model name, so a fault scripted for one model never reaches another.
"""
from __future__ import annotations

import base64
import json
import socket
from http.client import HTTPConnection
from pathlib import Path
from typing import Any, Iterator

import anthropic
import pytest

from fakes import FakeProvider
from helpers import ProxyProcess, free_port, http, wait_for

pytestmark = pytest.mark.integration

KEY = "sk-fake-SECRET-7f3a91c2d4"
WRONG = "sk-wrong-SECRET-000000"
PDF = "data:application/pdf;base64," + base64.b64encode(b"%PDF-1.4 the annual report").decode()
FILE_ITEM = {"type": "file", "file": {"filename": "report.pdf", "file_data": PDF}}
# A user and password in remote_base_url (a provider behind Basic auth).
USER, PASSWORD = "pool-user", "pw-SECRET-51b7e0c3"


def remote(upstream: str, **fields: Any) -> dict[str, Any]:
    """The seed's remote example, pointed at the fake (base URL filled in by the fixture)."""
    return {"backend": "openai_remote", "model_path": None, "remote_api_kind": "chat_completions",
            "remote_api_key_env": "FAKE_PROVIDER_KEY", "remote_model": upstream, "remote_timeout_s": 120,
            "remote_health_check": "config_only", "remote_max_retries": 0, "remote_thinking": "disabled",
            "target_inflight": 1, "enabled": True, **fields}


MODELS = {
    # Moonshot-like: cache key opt-in, files through the Files API.
    "frontier-large": remote("moonshot-kimi", remote_prompt_cache_key_enabled=True,
                             remote_file_mode="files_extract", remote_file_purpose="file-extract"),
    # OpenAI-like: files inline, retries, the provider's model list checked at load.
    "openai-like": remote("gpt-fake", remote_file_mode="chat_completions_inline", remote_max_retries=2,
                          remote_health_check="models", remote_thinking=None, target_inflight=4),
    "no-retry": remote("gpt-no-retry"),
    "impatient": remote("gpt-impatient", remote_timeout_s=1, remote_max_retries=2),
    "wrong-key": remote("gpt-wrong-key", remote_api_key_env="WRONG_PROVIDER_KEY"),
    "keyless": remote("gpt-keyless", remote_api_key_env="UNSET_PROVIDER_KEY", enabled=False),
    "unlisted": remote("not-offered", remote_health_check="models", enabled=False),
    # Credentials in the URL, no key: at the fake (which wants its key) or where nothing listens.
    "basic-auth": remote("gpt-basic", remote_api_key_env=None),
    "basic-closed": remote("gpt-closed", remote_api_key_env=None),
    "basic-unreachable": remote("gpt-closed", remote_api_key_env=None, remote_health_check="models", enabled=False),
}
# Where each credentialed model points; the fixture fills in the host.
IN_URL = {"basic-auth": "fake", "basic-closed": "closed", "basic-unreachable": "closed"}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(KEY, models=("moonshot-kimi", "gpt-fake")).start()
    yield provider
    provider.stop()


@pytest.fixture(scope="module")
def proxy(fake: FakeProvider) -> Iterator[ProxyProcess]:
    hosts = {"fake": f"127.0.0.1:{fake.port}", "closed": f"127.0.0.1:{free_port()}"}
    models = {name: {**cfg, "remote_base_url": f"http://{USER}:{PASSWORD}@{hosts[IN_URL[name]]}/v1"
                     if name in IN_URL else fake.url} for name, cfg in MODELS.items()}
    proc = ProxyProcess(models, service={"log_level": "debug"})
    proc.env = {"FAKE_PROVIDER_KEY": KEY, "WRONG_PROVIDER_KEY": WRONG, "UNSET_PROVIDER_KEY": ""}
    try:
        proc.start()
        for name, cfg in MODELS.items():
            if cfg["enabled"]:
                proc.wait_state(name, "loaded")
        yield proc
    finally:
        survivors = proc.cleanup()
        assert not survivors, f"processes outlived the tests: {survivors}"


@pytest.fixture(autouse=True)
def clean(fake: FakeProvider) -> None:
    fake.clear()


def chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "allow_remote": True, **fields}


def sse_events(raw: bytes) -> list[tuple[str, Any]]:
    events = []
    for block in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            data = lines["data"]
            events.append((lines.get("event", "message"), data if data == "[DONE]" else json.loads(data)))
    return events


def upstream_chats(fake: FakeProvider) -> list[dict[str, Any]]:
    return [r["body"] for r in fake.received("/v1/chat/completions")]  # type: ignore[misc]


# -- the gate ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/embeddings"])
def test_without_allow_remote_nothing_goes_upstream(proxy: ProxyProcess, fake: FakeProvider, path: str) -> None:
    body = {"model": "frontier-large", "input": "Hi"} if path == "/v1/responses" else chat("frontier-large")
    body.pop("allow_remote", None)
    for extra in ({}, {"allow_remote": False}):
        status, _, answer = http("POST", proxy.url + path, {**body, **extra})
        assert status == 403
        assert answer["error"]["code"] == "remote_not_allowed" and answer["error"]["param"] == "allow_remote"
        assert "allow_remote" in answer["error"]["message"]
    assert fake.received() == []


def test_the_header_opens_the_gate_for_plain_openai_clients(proxy: ProxyProcess, fake: FakeProvider) -> None:
    body = chat("frontier-large")
    del body["allow_remote"]
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", body, headers={"X-Allow-Remote": "true"})
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == "Hello from the fake provider"


def test_local_only_fields_never_reach_the_provider(proxy: ProxyProcess, fake: FakeProvider) -> None:
    status, _, _ = http("POST", proxy.url + "/v1/chat/completions", chat("frontier-large", fairness_key="batch"))
    assert status == 200
    status, _, _ = http("POST", proxy.url + "/v1/responses", {"model": "frontier-large", "input": "Hi",
                                                              "allow_remote": True, "fairness_key": "batch"})
    assert status == 200
    for sent in upstream_chats(fake):
        assert "fairness_key" not in sent and "allow_remote" not in sent
        assert sent["model"] == "moonshot-kimi"


# -- the key ---------------------------------------------------------------------------------------

def test_the_key_goes_to_the_provider_as_a_bearer_token(proxy: ProxyProcess, fake: FakeProvider) -> None:
    assert http("POST", proxy.url + "/v1/chat/completions", chat("frontier-large"))[0] == 200
    assert {r["authorization"] for r in fake.received()} == {f"Bearer {KEY}"}


def test_admin_view_names_the_variable_and_says_whether_it_is_set(proxy: ProxyProcess) -> None:
    model = proxy.admin_model("frontier-large")
    assert model["remote"]["api_key_env"] == "FAKE_PROVIDER_KEY" and model["remote"]["api_key_set"] is True
    assert model["capabilities"]["file_inputs"] is True
    assert model["replicas"][0]["program"] is None and model["replicas"][0]["endpoint"] == proxy.config[
        "engine"]["models"]["frontier-large"]["remote_base_url"]
    keyless = proxy.admin_model("keyless")["remote"]
    assert keyless["api_key_env"] == "UNSET_PROVIDER_KEY" and keyless["api_key_set"] is False
    assert proxy.admin_model("no-retry")["capabilities"]["file_inputs"] is False


def test_a_missing_key_variable_fails_the_load_naming_it(proxy: ProxyProcess, fake: FakeProvider) -> None:
    status, _, answer = http("POST", proxy.url + "/v1/admin/models/keyless/load")
    assert status == 409 and answer["error"]["code"] == "model_not_loadable"
    assert "UNSET_PROVIDER_KEY" in answer["error"]["message"]
    assert fake.received() == []


def test_a_refused_key_is_the_pools_fault_not_the_clients(proxy: ProxyProcess, fake: FakeProvider) -> None:
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat("wrong-key"))
    assert status == 502 and answer["error"]["code"] == "remote_auth_failed"
    assert "WRONG_PROVIDER_KEY" in answer["error"]["message"] and WRONG not in json.dumps(answer)
    fake.script("moonshot-kimi", "401")
    status, _, answer = http("POST", proxy.url + "/v1/responses", {"model": "frontier-large", "input": "Hi",
                                                                   "allow_remote": True})
    assert status == 502 and answer["error"]["code"] == "remote_auth_failed"


def test_the_key_never_shows_in_the_log_admin_metrics_or_errors(proxy: ProxyProcess, fake: FakeProvider) -> None:
    # Exercise every path that could leak it: success, upstream errors, a failed load, streams.
    fake.script("gpt-no-retry", "500", "401")
    seen = [http("POST", proxy.url + "/v1/chat/completions", chat("no-retry"))[2] for _ in range(2)]
    seen.append(http("POST", proxy.url + "/v1/chat/completions", chat("wrong-key"))[2])
    seen.append(http("POST", proxy.url + "/v1/responses", {"model": "frontier-large", "input": "Hi",
                                                          "allow_remote": True, "stream": True})[2])
    seen.append(http("POST", proxy.url + "/v1/admin/models/unlisted/load")[2])
    for path in ("/v1/admin/models", "/v1/admin/gpu-memory", "/metrics", "/health", "/v1/models"):
        seen.append(http("GET", proxy.url + path)[2])
    text = "".join(s if isinstance(s, str) else s.decode(errors="replace") if isinstance(s, bytes)
                   else json.dumps(s) for s in seen)
    log = proxy.log_path.read_text(errors="replace")
    assert "remote_auth_failed" in text and "FAKE_PROVIDER_KEY" in text   # the paths really ran
    for secret in (KEY, WRONG):
        assert secret not in text
        assert secret not in log


def key_parts(secret: str, text: str) -> list[str]:
    """Every run of 8 characters of `secret` that `text` holds."""
    return [secret[i:i + 8] for i in range(len(secret) - 7) if secret[i:i + 8] in text]


def test_no_part_of_the_key_a_provider_echoes_reaches_the_client(proxy: ProxyProcess, fake: FakeProvider) -> None:
    fake.script("gpt-no-retry", "400:parts")
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat("no-retry"))
    assert status == 400 and "may not ask for this many tokens" in answer["error"]["message"]
    assert "key ***... (...***...)" in answer["error"]["message"]
    assert key_parts(KEY, json.dumps(answer)) == []
    assert key_parts(KEY, proxy.log_path.read_text(errors="replace")) == []


def test_credentials_in_the_base_url_never_show(proxy: ProxyProcess, fake: FakeProvider) -> None:
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat("basic-closed"))
    assert status == 502 and "could not be reached: connection refused" in answer["error"]["message"]
    status, _, load = http("POST", proxy.url + "/v1/admin/models/basic-unreachable/load")
    assert status == 502 and load["error"]["code"] == "model_load_failed"
    assert "/v1/models failed: connection refused" in load["error"]["message"]
    model = proxy.admin_model("basic-closed")
    assert model["remote"]["base_url"] == model["replicas"][0]["endpoint"] == \
        proxy.config["engine"]["models"]["basic-closed"]["remote_base_url"].replace(f"{USER}:{PASSWORD}@", "")
    health = http("GET", proxy.url + "/health")[2]
    assert "basic-unreachable" in health["errors"]   # the failed load's reason, with the URL it tried
    seen = [answer, load, health] + [http("GET", proxy.url + path)[2] for path in ("/v1/admin/models", "/ready")]
    for text in (json.dumps(seen), proxy.log_path.read_text(errors="replace")):
        assert key_parts(PASSWORD, text) == [] and f"{USER}:" not in text


def test_credentials_in_the_base_url_go_as_basic_auth(proxy: ProxyProcess, fake: FakeProvider) -> None:
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat("basic-auth"))
    # The fake wants its Bearer key, so it refuses; what matters is what it was sent.
    assert status == 502 and answer["error"]["code"] == "remote_auth_failed"
    assert "remote_base_url" in answer["error"]["message"]
    basic = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    assert [r["authorization"] for r in fake.received()] == [basic]


def test_supervisord_and_its_programs_never_get_the_keys(proxy: ProxyProcess) -> None:
    pid = int((proxy.state_dir / "supervisord.pid").read_text())
    environ = (Path("/proc") / str(pid) / "environ").read_bytes()
    assert b"PATH=" in environ   # the minimal environment model servers get is there
    for secret in (KEY, WRONG):
        assert secret.encode() not in environ


def test_a_remote_model_is_no_supervisord_program(proxy: ProxyProcess) -> None:
    status = proxy.supervisorctl("status")
    assert "moonshot" not in status.stdout and "frontier" not in status.stdout
    programs = list((proxy.state_dir / "programs").glob("*.conf"))
    assert programs == []



def test_a_remote_model_has_no_process_log_and_says_so(proxy: ProxyProcess) -> None:
    status, _, answer = http("GET", proxy.url + "/v1/admin/models/no-retry/logs")
    assert status == 409, answer
    assert answer["error"]["code"] == "no_process_log"
    assert "remote endpoint" in answer["error"]["message"] and "no process log" in answer["error"]["message"]

# -- mapping ---------------------------------------------------------------------------------------

def test_responses_maps_model_decoding_and_thinking(proxy: ProxyProcess, fake: FakeProvider) -> None:
    status, _, answer = http("POST", proxy.url + "/v1/responses", {
        "model": "frontier-large", "input": "Hi", "instructions": "Be brief.", "allow_remote": True,
        "decoding": {"temperature": 0.2, "top_p": 0.9, "max_tokens": 12, "stop": ["END"], "top_k": 5,
                     "repetition_penalty": 1.1, "beam_size": 2}})
    assert status == 200, answer
    (sent,) = upstream_chats(fake)
    assert sent["model"] == "moonshot-kimi"
    assert {k: sent[k] for k in ("temperature", "top_p", "max_tokens", "stop")} == {
        "temperature": 0.2, "top_p": 0.9, "max_tokens": 12, "stop": ["END"]}
    for ignored in ("top_k", "repetition_penalty", "repeat_penalty", "beam_size", "chat_template_kwargs"):
        assert ignored not in sent
    assert sent["thinking"] == {"type": "disabled"}   # remote_thinking
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_a_requests_thinking_wins_over_remote_thinking(proxy: ProxyProcess, fake: FakeProvider) -> None:
    assert http("POST", proxy.url + "/v1/responses", {"model": "frontier-large", "input": "Hi",
                                                      "allow_remote": True, "thinking": "enabled"})[0] == 200
    assert upstream_chats(fake)[0]["thinking"] == {"type": "enabled"}
    assert http("POST", proxy.url + "/v1/responses", {"model": "openai-like", "input": "Hi",
                                                      "allow_remote": True})[0] == 200
    assert "thinking" not in upstream_chats(fake)[1]   # no remote_thinking configured: none sent


def test_prompt_cache_key_goes_only_to_models_that_opted_in(proxy: ProxyProcess, fake: FakeProvider) -> None:
    for model in ("frontier-large", "openai-like"):
        assert http("POST", proxy.url + "/v1/responses", {"model": model, "input": "Hi", "allow_remote": True,
                                                          "prompt_cache_key": "chat-7f24c8"})[0] == 200
        assert http("POST", proxy.url + "/v1/chat/completions",
                    chat(model, prompt_cache_key="chat-7f24c8"))[0] == 200
    sent = upstream_chats(fake)
    assert [s.get("prompt_cache_key") for s in sent] == ["chat-7f24c8", "chat-7f24c8", None, None]


# -- usage and metrics -------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["frontier-large", "openai-like"])   # Moonshot's and OpenAI's usage shape
def test_cached_tokens_are_reported_in_either_usage_shape(proxy: ProxyProcess, fake: FakeProvider,
                                                          model: str) -> None:
    status, _, answer = http("POST", proxy.url + "/v1/responses", {"model": model, "input": "Hi",
                                                                   "allow_remote": True})
    assert status == 200
    metrics = answer["metrics"]
    assert metrics["engine_cached_prompt_tokens"] == FakeProvider.CACHED_TOKENS
    assert metrics["engine_output_tokens"] == 5 and metrics["backend_inference_wall_ms"] is not None
    assert metrics["gpu_time_to_first_token_ms"] is None and metrics["gpu_generate_total_ms"] is None
    assert metrics["backend_time_to_first_token_ms"] is None   # measured for streams only


def test_a_stream_asks_for_usage_and_measures_first_token_here(proxy: ProxyProcess, fake: FakeProvider) -> None:
    status, _, raw = http("POST", proxy.url + "/v1/responses", {"model": "frontier-large", "input": "Hi",
                                                                "allow_remote": True, "stream": True})
    assert status == 200
    events = sse_events(raw)
    assert [e for e, _ in events][-2:] == ["response.metrics", "response.completed"]
    metrics = events[-1][1]["response"]["metrics"]
    assert events[-1][1]["response"]["output_text"] == "Hello from the fake provider"
    assert metrics["engine_cached_prompt_tokens"] == FakeProvider.CACHED_TOKENS
    assert metrics["backend_time_to_first_token_ms"] is not None
    assert metrics["gpu_time_to_first_token_ms"] is None
    assert upstream_chats(fake)[0]["stream_options"] == {"include_usage": True}


# -- files -------------------------------------------------------------------------------------------

def test_inline_mode_sends_file_items_as_they_are(proxy: ProxyProcess, fake: FakeProvider) -> None:
    status, _, answer = http("POST", proxy.url + "/v1/responses", {
        "model": "openai-like", "allow_remote": True,
        "input": [{"type": "text", "text": "Summarise"}, FILE_ITEM]})
    assert status == 200, answer
    (sent,) = upstream_chats(fake)
    assert sent["messages"][-1]["content"] == [{"type": "text", "text": "Summarise"}, FILE_ITEM]
    assert fake.received("/v1/files") == []


def test_extract_mode_uploads_extracts_and_deletes(proxy: ProxyProcess, fake: FakeProvider) -> None:
    status, _, answer = http("POST", proxy.url + "/v1/responses", {
        "model": "frontier-large", "allow_remote": True,
        "input": [{"type": "text", "text": "Summarise"}, FILE_ITEM]})
    assert status == 200, answer
    (upload,) = fake.received("/v1/files")
    assert upload["body"] == {"purpose": "file-extract", "filename": "report.pdf"}
    (sent,) = upstream_chats(fake)
    system, user = sent["messages"]
    assert system["role"] == "system" and json.loads(system["content"])["content"] == \
        "EXTRACTED %PDF-1.4 the annual report"
    assert user == {"role": "user", "content": [{"type": "text", "text": "Summarise"}]}
    assert [r["method"] for r in fake.received() if r["path"].startswith("/v1/files")] == ["POST", "GET", "DELETE"]
    assert fake.files == {}


def test_extract_mode_deletes_the_upload_when_extraction_fails(proxy: ProxyProcess, fake: FakeProvider) -> None:
    fake.script("files", "ok", "500")   # the upload works, the extraction fails
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat(
        "frontier-large", messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, FILE_ITEM]}]))
    assert status == 502 and "overloaded" in answer["error"]["message"]
    assert upstream_chats(fake) == []   # no silent fallback: the question was never sent without its file
    assert len(fake.received("/v1/files")) == 1 and fake.files == {}


def test_extract_mode_deletes_the_upload_when_the_client_leaves(proxy: ProxyProcess, fake: FakeProvider) -> None:
    fake.script("files", "ok", "slow")  # the extraction hangs; the client gives up meanwhile
    conn = HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    conn.request("POST", "/v1/responses", json.dumps({
        "model": "frontier-large", "allow_remote": True, "stream": True,
        "input": [{"type": "text", "text": "Hi"}, FILE_ITEM]}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    wait_for(lambda: [r for r in fake.received() if r["path"].endswith("/content")],
             what="the extraction to start")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_for(lambda: fake.files == {}, what="the upload to be deleted after the client left")
    assert upstream_chats(fake) == []


def test_a_model_without_file_mode_refuses_files(proxy: ProxyProcess, fake: FakeProvider) -> None:
    status, _, answer = http("POST", proxy.url + "/v1/responses", {
        "model": "no-retry", "allow_remote": True, "input": [{"type": "text", "text": "Hi"}, FILE_ITEM]})
    assert status == 400 and answer["error"]["code"] == "modality_unsupported"
    assert fake.received() == []


# -- time and failure --------------------------------------------------------------------------------

def test_a_providers_429_reaches_the_client_with_retry_after(proxy: ProxyProcess, fake: FakeProvider) -> None:
    fake.script("gpt-no-retry", "429:7")
    status, headers, answer = http("POST", proxy.url + "/v1/chat/completions", chat("no-retry"))
    assert status == 429 and headers["Retry-After"] == "7"
    assert answer["error"]["code"] == "remote_rate_limited"


def test_429_and_5xx_are_retried_honouring_retry_after(proxy: ProxyProcess, fake: FakeProvider) -> None:
    fake.script("gpt-fake", "429:1", "500")
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat("openai-like"))
    assert status == 200, answer
    attempts = fake.received("/v1/chat/completions")
    assert len(attempts) == 3
    assert attempts[1]["at"] - attempts[0]["at"] >= 1.0   # waited what Retry-After asked


def test_a_broken_connection_is_retried(proxy: ProxyProcess, fake: FakeProvider) -> None:
    fake.script("gpt-fake", "drop")
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat("openai-like"))
    assert status == 200, answer
    assert len(fake.received("/v1/chat/completions")) == 2
    fake.script("gpt-no-retry", "drop")
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat("no-retry"))
    assert status == 502 and "could not be reached" in answer["error"]["message"]
    assert proxy.admin_model("no-retry")["replicas"][0]["state"] == "ready"   # an endpoint is not ejected


def test_a_retry_after_beyond_the_timeout_is_not_waited_for(proxy: ProxyProcess, fake: FakeProvider) -> None:
    fake.script("gpt-impatient", "429:30")
    status, headers, _ = http("POST", proxy.url + "/v1/chat/completions", chat("impatient"))
    assert status == 429 and headers["Retry-After"] == "30"
    assert len(fake.received("/v1/chat/completions")) == 1


def test_a_5xx_becomes_502_with_the_providers_message(proxy: ProxyProcess, fake: FakeProvider) -> None:
    fake.script("gpt-no-retry", "500")
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat("no-retry"))
    assert status == 502 and answer["error"]["code"] == "backend_error"
    assert "the fake provider is overloaded" in answer["error"]["message"]


def test_remote_timeout_bounds_a_call(proxy: ProxyProcess, fake: FakeProvider) -> None:
    fake.script("gpt-impatient", "slow")
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat("impatient"))
    assert status == 504 and answer["error"]["code"] == "remote_timeout"


@pytest.mark.parametrize("fault", ["broken", "slow_stream"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_a_stream_that_breaks_ends_with_an_error_event_and_is_never_retried(
        proxy: ProxyProcess, fake: FakeProvider, fault: str, path: str) -> None:
    # impatient: remote_timeout_s 1 bounds the wait for each chunk; it has 2 retries it must not use.
    fake.script("gpt-impatient", fault)
    body = chat("impatient", stream=True) if path.endswith("completions") else \
        {"model": "impatient", "input": "Hi", "allow_remote": True, "stream": True}
    status, _, raw = http("POST", proxy.url + path, body)
    assert status == 200
    events = sse_events(raw)
    assert events[-1][0] == "error", events
    assert len(fake.received("/v1/chat/completions")) == 1


# -- health ------------------------------------------------------------------------------------------

def test_models_health_check_lists_the_model_at_load(proxy: ProxyProcess, fake: FakeProvider) -> None:
    status, _, answer = http("POST", proxy.url + "/v1/admin/models/unlisted/load")
    assert status == 502 and answer["error"]["code"] == "model_load_failed"
    assert "'not-offered' is not among the models" in answer["error"]["message"]
    assert [r["path"] for r in fake.received()] == ["/v1/models"]
    assert http("POST", proxy.url + "/v1/admin/models/openai-like/unload")[0] == 200
    fake.clear()
    assert http("POST", proxy.url + "/v1/admin/models/openai-like/load")[0] == 200
    assert [r["path"] for r in fake.received()] == ["/v1/models"]


def test_config_only_loads_without_calling_the_provider(proxy: ProxyProcess, fake: FakeProvider) -> None:
    assert http("POST", proxy.url + "/v1/admin/models/no-retry/unload")[0] == 200
    assert http("POST", proxy.url + "/v1/admin/models/no-retry/load")[0] == 200
    assert proxy.admin_model("no-retry")["state"] == "loaded"
    assert fake.received() == []


def test_a_providers_other_4xx_keeps_its_status_with_the_key_masked(proxy: ProxyProcess, fake: FakeProvider) -> None:
    fake.script("gpt-no-retry", "400")
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat("no-retry"))
    assert status == 400 and "max_tokens too large for key ***" in answer["error"]["message"]
    assert KEY not in json.dumps(answer)


def test_files_extract_needs_file_data(proxy: ProxyProcess, fake: FakeProvider) -> None:
    status, _, answer = http("POST", proxy.url + "/v1/chat/completions", chat(
        "frontier-large", messages=[{"role": "user", "content": [{"type": "file", "file": {"file_id": "x"}}]}]))
    assert status == 400 and answer["error"]["code"] == "invalid_file"
    assert fake.received() == []


# -- Anthropic Messages, translated onto the provider's chat completions ---------------------------

def claude(proxy: ProxyProcess, **headers: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key="not-the-providers-key", max_retries=0,
                               default_headers=headers)


def test_messages_to_a_remote_chat_provider_are_translated_both_ways(proxy: ProxyProcess, fake: FakeProvider) -> None:
    client = claude(proxy, **{"X-Allow-Remote": "true"})
    message = client.messages.create(
        model="openai-like", max_tokens=16, system="Be brief.", stop_sequences=["END"], extra_body={"temperature": 0.2},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert (message.content[0].text, message.stop_reason, message.model) == \
        ("Hello from the fake provider", "end_turn", "openai-like")
    assert message.usage.output_tokens == 5 and message.usage.input_tokens > 0
    sent = upstream_chats(fake)[-1]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert {k: sent[k] for k in ("model", "max_tokens", "temperature", "stop")} == \
        {"model": "gpt-fake", "max_tokens": 16, "temperature": 0.2, "stop": ["END"]}
    assert {r["authorization"] for r in fake.received()} == {f"Bearer {KEY}"}   # the provider's key, not the client's
    with client.messages.stream(model="openai-like", max_tokens=16, messages=[{"role": "user", "content": "Hi"}]) \
            as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert pieces == ["Hello", " from", " the", " fake", " provider"]
    assert final.content[0].text == "Hello from the fake provider" and final.usage.output_tokens == 5


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_an_anthropic_agents_tool_loop_runs_on_a_chat_provider(proxy: ProxyProcess, fake: FakeProvider) -> None:
    client = claude(proxy, **{"X-Allow-Remote": "true"})
    fake.tool_call = ("get_weather", {"city": "Paris", "days": [1, 2]})
    fake.words = []   # OpenAI's way: a call and no text
    try:
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        message = client.messages.create(model="openai-like", max_tokens=32, tools=[WEATHER],  # type: ignore[list-item]
                                         tool_choice={"type": "any"}, messages=ask)  # type: ignore[arg-type]
        with client.messages.stream(model="openai-like", max_tokens=32, tools=[WEATHER], messages=ask) as stream:  # type: ignore[list-item,arg-type]
            streamed = stream.get_final_message()
    finally:
        fake.words, fake.tool_call = ["Hello", " from", " the", " fake", " provider"], None
    for final in (message, streamed):
        assert [(b.type, b.name, b.input) for b in final.content] == [  # type: ignore[union-attr]
            ("tool_use", "get_weather", {"city": "Paris", "days": [1, 2]})]
        assert (final.content[0].id, final.stop_reason) == ("call_fake", "tool_use")  # type: ignore[union-attr]
    sent = upstream_chats(fake)
    assert sent[0]["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER["input_schema"]}}]
    assert sent[0]["tool_choice"] == "required" and "tool_choice" not in sent[1]
    # The agent answers the call; the provider gets chat's tool message, and the model's words come back.
    call = message.content[0]
    answer = client.messages.create(model="openai-like", max_tokens=32, tools=[WEATHER], messages=[  # type: ignore[list-item]
        *ask, {"role": "assistant", "content": message.content},  # type: ignore[typeddict-item]
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}])  # type: ignore[union-attr]
    assert answer.content[0].text == "Hello from the fake provider"  # type: ignore[union-attr]
    assert upstream_chats(fake)[-1]["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_fake", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}}]},
        {"role": "tool", "tool_call_id": "call_fake", "content": "sunny"}]


def test_messages_keep_the_remote_gate_and_a_providers_429(proxy: ProxyProcess, fake: FakeProvider) -> None:
    with pytest.raises(anthropic.PermissionDeniedError, match="allow_remote"):
        claude(proxy).messages.create(model="no-retry", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert fake.received() == []
    fake.script("gpt-no-retry", "429:7")
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude(proxy, **{"X-Allow-Remote": "true"}).messages.create(
            model="no-retry", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.response.headers["Retry-After"] == "7"
    assert refused.value.body["error"]["type"] == "rate_limit_error"
