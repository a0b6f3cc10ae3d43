"""The `openai_remote` kind's pure parts: gate, key handling, request mapping, error mapping, config
rules; and that the supervisord monitor leaves endpoint replicas alone."""
from __future__ import annotations

import asyncio
import base64
import email.utils
import json
import time
from pathlib import Path
from typing import Any

import pytest

from fakes import FakeSupervisor
from proxy.capabilities import capabilities
from proxy.lifecycle.kinds.kind import traits_for
from proxy.config.loading import ConfigError, load_settings
from proxy.config.model import ModelConfig
from proxy.errors import BackendError, Forbidden, TooManyRequests
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.kinds.provider import retry_after_s
from proxy.lifecycle.kinds.remote import EndpointKind, RemoteReach
from proxy.lifecycle.kinds.remote_options import Secret
from proxy.lifecycle.kinds.rules import allowed
from proxy.lifecycle.state.replicas import ModelState, ReplicaState
from proxy.serving.responses import backend_request, parse, validate_for_model

KEY = "sk-unit-SECRET-1234"


def config(**options: Any) -> ModelConfig:
    options = {"backend": "openai_remote", "remote_base_url": "https://api.example.com/v1",
               "remote_api_key_env": "EXAMPLE_API_KEY", "remote_model": "provider-model", **options}
    return ModelConfig(name="frontier-large", backend="openai_remote", enabled=True, replicas=1, replica_max=1,
                       target_inflight=1, modalities=("text",), gpus=(), options=options)


def reach(**options: Any) -> RemoteReach:
    return RemoteReach(config(**options), Secret(KEY))


def test_the_secret_never_shows_itself() -> None:
    secret = Secret(KEY)
    assert KEY not in repr(secret) and KEY not in str(secret) and KEY not in f"{secret}"
    assert secret.reveal() == KEY
    assert secret.scrub(f"bad key {KEY}!") == "bad key ***!"


@pytest.mark.parametrize("headers, body, expected", [
    ({}, {}, False),
    ({}, {"allow_remote": True}, True),
    ({}, {"allow_remote": "true"}, False),           # only the JSON boolean opens the gate
    ({"X-Allow-Remote": "true"}, {}, True),
    ({"X-Allow-Remote": "TRUE "}, {}, True),
    ({"X-Allow-Remote": "1"}, {}, False),
    ({"X-Allow-Remote": "true"}, {"allow_remote": False}, False),   # the body's explicit no wins
])
def test_the_gate(headers: dict[str, str], body: dict[str, Any], expected: bool) -> None:
    assert allowed(headers, body) is expected
    kind = EndpointKind(http=None, environ={})  # type: ignore[arg-type]
    if expected:
        kind.gate(config(), headers, body)
    else:
        with pytest.raises(Forbidden) as info:
            kind.gate(config(), headers, body)
        assert info.value.status == 403 and info.value.code == "remote_not_allowed"
        assert info.value.param == "allow_remote"


def test_retry_after_as_seconds_or_date() -> None:
    assert retry_after_s({"Retry-After": "7"}) == 7.0
    assert retry_after_s({}) is None and retry_after_s({"Retry-After": "soon"}) is None
    later = email.utils.formatdate(time.time() + 60, usegmt=True)
    assert 55 <= retry_after_s({"Retry-After": later}) <= 60  # type: ignore[operator]


def test_mapping_renames_the_model_and_drops_what_is_ours() -> None:
    body = {"model": "frontier-large", "messages": [], "fairness_key": "k", "allow_remote": True,
            "prompt_cache_key": "c", "temperature": 0.1}
    assert reach().map_body(body) == {"model": "provider-model", "messages": [], "temperature": 0.1}
    assert reach(remote_prompt_cache_key_enabled=True).map_body(body)["prompt_cache_key"] == "c"


def test_remote_thinking_sets_moonshots_field_unless_the_request_has_one() -> None:
    assert reach(remote_thinking="disabled").map_body({})["thinking"] == {"type": "disabled"}
    assert reach(remote_thinking="disabled").map_body({"thinking": {"type": "enabled"}})["thinking"] == \
        {"type": "enabled"}
    assert "thinking" not in reach(remote_thinking="default").map_body({})
    assert "thinking" not in reach().map_body({})


def test_urls_hang_off_the_base_url_with_its_version() -> None:
    assert reach().url("/v1/chat/completions") == "https://api.example.com/v1/chat/completions"
    assert reach(remote_base_url="http://h:1/api/v1/").url("/v1/files/x/content") == "http://h:1/api/v1/files/x/content"


def test_provider_errors_as_the_client_sees_them() -> None:
    r = reach()
    limited = r.error(429, b'{"error": {"message": "slow down"}}', {"Retry-After": "9"}, "the request")
    assert isinstance(limited, TooManyRequests) and limited.headers() == {"Retry-After": "9"}
    assert r.error(429, b"", {}, "the request").headers() == {"Retry-After": "1"}
    auth = r.error(401, f'{{"error": {{"message": "key {KEY} is invalid"}}}}'.encode(), {}, "the request")
    assert isinstance(auth, BackendError) and (auth.status, auth.code) == (502, "remote_auth_failed")
    assert "EXAMPLE_API_KEY" in auth.message and KEY not in auth.message
    failed = r.error(503, f'{{"error": {{"message": "down, {KEY}"}}}}'.encode(), {}, "the request")
    assert (failed.status, failed.code) == (502, "backend_error") and "down, ***" in failed.message
    bad = r.error(400, b'{"error": {"message": "max_tokens too large"}}', {}, "the request")
    assert bad.status == 400 and "max_tokens too large" in bad.message


def test_a_provider_echoing_parts_of_the_key_shows_none_of_them() -> None:
    # KEY is 19 characters: its first 10 and 9 from its middle, as providers that show a prefix do.
    raw = json.dumps({"error": {"message": f"key {KEY[:10]}... ({KEY[5:14]}) may not use max_tokens 9999"}})
    message = reach().error(400, raw.encode(), {}, "the request").message
    assert "key ***... (***) may not use max_tokens 9999" in message
    assert not any(KEY[i:i + 8] in message for i in range(len(KEY) - 7))


def test_credentials_in_the_base_url_become_basic_auth_and_show_nowhere() -> None:
    cfg = config(remote_base_url="https://pool-user:p%40ss-SECRET-42@api.example.com/v1/", remote_api_key_env=None)
    r = RemoteReach(cfg, None)
    assert r.base_url == "https://api.example.com/v1" and r.describe() == {"endpoint": "https://api.example.com/v1"}
    assert r.url("/v1/chat/completions") == "https://api.example.com/v1/chat/completions"
    basic = "Basic " + base64.b64encode(b"pool-user:p@ss-SECRET-42").decode()
    assert r.headers()["Authorization"] == basic and "pool-user" not in repr(vars(r))
    kind = EndpointKind(http=None, environ={})  # type: ignore[arg-type]
    assert kind.describe(cfg)["remote"]["base_url"] == "https://api.example.com/v1/"  # type: ignore[index]
    assert kind.check(cfg) == []
    # A provider echoing the password, as written or decoded, or a part of it.
    raw = b'{"error": {"message": "no user pool-user:p@ss-SECRET-42 (p%40ss-SECR)"}}'
    assert r.error(400, raw, {}, "the request").message.endswith("no user ***:*** (***)")


def test_a_key_and_credentials_in_the_url_are_refused_together() -> None:
    # One Authorization header carries either the Bearer key or the URL's Basic auth, never both.
    kind = EndpointKind(http=None, environ={"EXAMPLE_API_KEY": KEY})  # type: ignore[arg-type]
    (problem,) = kind.check(config(remote_base_url="https://u:p@api.example.com/v1"))
    assert "remote_base_url" in problem and "remote_api_key_env" in problem and "u:p" not in problem


def test_a_missing_key_variable_is_named_never_valued() -> None:
    kind = EndpointKind(http=None, environ={"OTHER": KEY})  # type: ignore[arg-type]
    (problem,) = kind.check(config())
    assert "remote_api_key_env" in problem and "EXAMPLE_API_KEY" in problem
    assert kind.check(config(remote_api_key_env=None)) == []   # a keyless endpoint (a local server)
    assert EndpointKind(http=None, environ={"EXAMPLE_API_KEY": KEY}).check(config()) == []  # type: ignore[arg-type]
    row = EndpointKind(http=None, environ={"EXAMPLE_API_KEY": KEY}).describe(config())  # type: ignore[arg-type]
    assert row["remote"]["api_key_set"] is True and KEY not in repr(row)  # type: ignore[index]


def test_responses_sends_a_provider_only_the_seeds_decoding_fields() -> None:
    cfg = config(remote_thinking="disabled")
    req = parse({"model": "frontier-large", "input": "Hi", "thinking": "enabled", "decoding": {
        "temperature": 0.3, "top_p": 0.8, "max_tokens": 9, "stop": ["x"], "top_k": 4, "repetition_penalty": 1.2,
        "beam_size": 3}})
    validate_for_model(req, cfg, capabilities(cfg, traits_for(cfg.backend)))
    out = backend_request(req, cfg, traits_for(cfg.backend), {"temperature": 0.7})
    assert {k: v for k, v in out.items() if k != "messages"} == {
        "temperature": 0.3, "top_p": 0.8, "max_tokens": 9, "stop": ["x"], "thinking": {"type": "enabled"}}


def test_file_inputs_follow_remote_file_mode() -> None:
    assert capabilities(config(remote_file_mode="files_extract"), traits_for("openai_remote")).file_inputs
    assert not capabilities(config(), traits_for("openai_remote")).file_inputs


def write_settings(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(f"service: {{state_dir: {tmp_path}}}\nengine: {{models: {{r: {model}}}}}\n")
    return path


@pytest.mark.parametrize("fields, expected", [
    ({"remote_file_mode": "files_extract"}, "engine.models.r.remote_file_purpose: required"),
    ({"remote_model": None}, "engine.models.r.remote_model: None is not of type 'string'"),
    ({"remote_thinking": "maybe"}, "engine.models.r.remote_thinking: 'maybe' is not one of"),
    ({"remote_health_check": "ping"}, "engine.models.r.remote_health_check: 'ping' is not one of"),
    ({"remote_api_key_env": "sk-live-123"}, "engine.models.r.remote_api_key_env: 'sk-live-123' does not match"),
])
def test_config_rules(tmp_path: Path, fields: dict[str, Any], expected: str) -> None:
    model = {"backend": "openai_remote", "remote_base_url": "https://x/v1", "remote_model": "m", **fields}
    with pytest.raises(ConfigError) as info:
        load_settings(write_settings(tmp_path, json.dumps(model)))
    assert any(p.startswith(expected) for p in info.value.problems), info.value.problems


async def test_the_monitor_leaves_endpoint_replicas_alone(tmp_path: Path) -> None:
    """supervisord knows no program for a remote model; the monitor must neither judge nor stop it."""
    path = write_settings(tmp_path, '{backend: openai_remote, remote_base_url: "https://x/v1", '
                                    'remote_model: m, remote_api_key_env: null}')
    fake = FakeSupervisor()
    pool = Pool(load_settings(path), fake, http=None, environ={})  # type: ignore[arg-type]
    runtime = await pool.load("r")
    assert runtime.state == ModelState.LOADED and [r.state for r in runtime.replicas] == [ReplicaState.READY]
    polled = 0
    real = fake.all_process_info

    async def counting() -> list[Any]:
        nonlocal polled
        polled += 1
        return await real()
    fake.all_process_info = counting  # type: ignore[method-assign]
    await pool.start()
    try:
        deadline = time.monotonic() + 10
        while polled < 3:   # a few monitor rounds with an empty process table
            assert time.monotonic() < deadline, "the monitor did not run"
            await asyncio.sleep(0.01)
        assert [r.state for r in runtime.replicas] == [ReplicaState.READY]
        assert fake.calls == []
        await pool.unload("r")
        assert fake.calls == [] and runtime.state == ModelState.UNLOADED
    finally:
        await pool.close(stop_models=False)
