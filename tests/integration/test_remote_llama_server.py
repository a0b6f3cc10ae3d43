"""`openai_remote` against a real OpenAI-compatible upstream: llama-server on the tiny GGUF, started
with an API key, used through llm-pool with the openai client, streamed and not."""
from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import openai
import pytest

from helpers import ProxyProcess, free_port, http, wait_for

pytestmark = pytest.mark.integration

KEY = "sk-llama-SECRET-55aa01"
ALIAS = "tiny-upstream"


@pytest.fixture(scope="module")
def upstream(tiny_gguf: Path, llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server's OpenAI endpoint, its key required on every call; stopped by PID after."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("upstream") / "llama-server.log", "wb")
    proc = subprocess.Popen([str(llama_server_bin), "--model", str(tiny_gguf), "--host", "127.0.0.1",
                             "--port", str(port), "--alias", ALIAS, "--api-key", KEY, "--ctx-size", "2048",
                             "--parallel", "2", "--no-webui"], stdout=log, stderr=subprocess.STDOUT)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, "llama-server exited"
            try:
                return http("GET", f"http://127.0.0.1:{port}/health")[0] == 200
            except OSError:
                return False
        wait_for(healthy, what="llama-server")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def proxy(upstream: str) -> Iterator[ProxyProcess]:
    common = {"backend": "openai_remote", "remote_base_url": upstream, "remote_model": ALIAS,
              "remote_api_kind": "chat_completions", "remote_timeout_s": 60, "target_inflight": 2, "enabled": True}
    proc = ProxyProcess({"frontier": {**common, "remote_api_key_env": "UPSTREAM_KEY", "remote_health_check": "models"},
                         "wrong-key": {**common, "remote_api_key_env": "WRONG_KEY"}})
    proc.env = {"UPSTREAM_KEY": KEY, "WRONG_KEY": "sk-not-it"}
    try:
        proc.start()
        proc.wait_state("frontier", "loaded")   # the models check passed: llama-server listed the alias
        proc.wait_state("wrong-key", "loaded")  # config_only: not called at load
        yield proc
    finally:
        survivors = proc.cleanup()
        assert not survivors, f"processes outlived the tests: {survivors}"


def client(proxy: ProxyProcess, allow: bool = True) -> openai.OpenAI:
    headers = {"X-Allow-Remote": "true"} if allow else {}
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, default_headers=headers)


MESSAGES = [{"role": "user", "content": "Say something."}]


def test_chat_through_llm_pool_to_llama_server(proxy: ProxyProcess) -> None:
    answer = client(proxy).chat.completions.create(model="frontier", messages=MESSAGES, max_tokens=8,  # type: ignore[arg-type]
                                                   temperature=0)
    assert answer.model == ALIAS   # llama-server answered under its own name
    assert answer.usage is not None and answer.usage.completion_tokens >= 1


def test_streamed_chat_through_llm_pool_to_llama_server(proxy: ProxyProcess) -> None:
    stream = client(proxy).chat.completions.create(model="frontier", messages=MESSAGES, max_tokens=8,  # type: ignore[arg-type]
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_without_the_gate_the_client_gets_403(proxy: ProxyProcess) -> None:
    with pytest.raises(openai.PermissionDeniedError) as info:
        client(proxy, allow=False).chat.completions.create(model="frontier", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert info.value.code == "remote_not_allowed"


def test_llama_servers_401_becomes_remote_auth_failed(proxy: ProxyProcess) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        client(proxy).chat.completions.create(model="wrong-key", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert info.value.status_code == 502 and info.value.code == "remote_auth_failed"


def test_responses_api_on_a_remote_llama_server(proxy: ProxyProcess) -> None:
    body = {"model": "frontier", "input": "Hi", "allow_remote": True, "decoding": {"max_tokens": 8}}
    status, _, answer = http("POST", proxy.url + "/v1/responses", body)
    assert status == 200, answer
    metrics = answer["metrics"]
    assert metrics["engine_output_tokens"] >= 1 and metrics["engine_prompt_tokens"] >= 1
    # llama-server sends its own timings, but for a remote model nobody here measured a GPU.
    assert metrics["gpu_generate_total_ms"] is None and metrics["gpu_time_to_first_token_ms"] is None
    status, _, raw = http("POST", proxy.url + "/v1/responses", {**body, "stream": True})
    assert status == 200
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["metrics"]["engine_output_tokens"] >= 1   # the stream asked for usage
    assert events[-1]["response"]["metrics"]["backend_time_to_first_token_ms"] is not None
