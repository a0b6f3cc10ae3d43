"""End to end with a real vLLM: `llm-pool serve`, real supervisord, `vllm serve` of the tiny HF Llama.

The vLLM is the CPU build `llm-pool setup --all-engines` caches (proxy/setup/vllm_env.py); tests/gpu/
runs this module against a CUDA build by setting LLM_POOL_TEST_VLLM to its `vllm` command. One
proxy serves the whole module, because every `vllm serve` start costs tens of seconds on a CPU.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import anthropic
import openai
import pytest

from helpers import ProxyProcess, http, pid_alive, wait_for
from seed_vllm_examples import CPU_OVERRIDES, SEED_EXAMPLES, cpu_variant
from tiny_hf_model import write_tiny_hf_llama
from vllm_test_env import NEEDS_VLLM, START_S, process_group, vllm_command, vllm_env

pytestmark = [pytest.mark.integration, NEEDS_VLLM]

MODEL = "tiny-vllm"
API_KEY = "sk-test-vllm-replica-key"
CHAT = [{"role": "user", "content": "Hello there, tiny model."}]
# Tokens: far more than a request makes between its first line and a pause. vLLM's engine core runs
# in its own process, and on a busy machine it made 3,000 before its API server, sharing the cores,
# had sent the first few (5 tries of 5 in a loaded suite run): the context is stretched for this.
LONG = 30000
CONTEXT = 32768
TOKENS_BEFORE_PAUSE = 3   # streamed tokens read before the pause: engine steps that set the gauges



@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="module")
def proxy(tiny_hf: Path) -> Iterator[ProxyProcess]:
    models: dict[str, dict[str, Any]] = {
        MODEL: {"backend": "vllm_serve", "enabled": True, "target_inflight": 2, "vllm_model": str(tiny_hf),
                "vllm_serve_binary": vllm_command(), "vllm_dtype": "float32", "vllm_max_model_len": CONTEXT,
                # Two sequences of CONTEXT tokens: 2 layers x K and V x 128 float32s a token each.
                "vllm_kv_cache_memory_bytes": 2 * CONTEXT * 2 * 2 * 128 * 4 + 16 * 1024 * 1024,
                # Dev mode serves /pause and /resume, with which a test holds a request in flight.
                # VLLM_ALLOW_LONG_MAX_MODEL_LEN: a context past the tiny model's 4,096 positions (its rope
                # extends; its weights are random anyway).
                "vllm_serve_env": {**vllm_env(), "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
                "vllm_serve_api_key": API_KEY, "vllm_serve_start_timeout_s": START_S,
                # A prefill chunk, and the start's profiling batch, far below the context.
                "vllm_serve_extra_args": ["--enforce-eager", "--max-num-seqs", "2", "--max-num-batched-tokens", "2048"]},
    }
    for name, example in SEED_EXAMPLES.items():
        models[name] = cpu_variant(example, str(tiny_hf), vllm_command(), vllm_env())
    started = ProxyProcess(models)
    group_pids: set[int] = set()
    started.group_pids = group_pids  # type: ignore[attr-defined]
    try:
        yield started.start()
    finally:
        survivors = started.cleanup() + [p for p in group_pids if pid_alive(p)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        assert not survivors, f"processes outlived the module and were killed: {survivors}"


def client(proxy: ProxyProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def ready_replica(proxy: ProxyProcess, name: str = MODEL) -> dict[str, Any]:
    model = proxy.wait_replicas_ready(name, 1, timeout=START_S)
    replica = model["replicas"][0]
    proxy.group_pids.update(process_group(replica["pid"]))  # type: ignore[attr-defined]
    return replica



def vllm_metric(replica: dict[str, Any], name: str) -> float:
    """A sample summed over labels, read straight from the replica's own /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{replica['port']}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(f"vllm:{name}{{") or line.startswith(f"vllm:{name} ")]
    assert values, f"vllm:{name} not in the replica's metrics"
    return sum(values)


@contextlib.contextmanager
def paused(replica: dict[str, Any]) -> Iterator[None]:
    """The replica's engine paused in vLLM's "keep" mode: its requests stay running, holding their
    cache, and make no token until it resumes; an abort still ends one."""
    def call(path: str) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{replica['port']}{path}", data=b"", method="POST",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200

    call("/pause?mode=keep")
    try:
        yield
    finally:
        call("/resume")


def test_loads_and_serves_chat_streaming_and_responses(proxy: ProxyProcess) -> None:
    replica = ready_replica(proxy)
    oai = client(proxy)
    reply = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert reply.model == MODEL and reply.usage.completion_tokens > 0
    assert reply.choices[0].message.content is not None

    chunks = list(oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    # Events as vLLM makes them, not one blob (a token holding half a UTF-8 character adds no text).
    assert len(deltas) > 1
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 32

    status, _, body = http("POST", proxy.url + "/v1/responses",
                           {"model": MODEL, "input": "Say something.", "max_output_tokens": 16})
    assert status == 200, body
    assert body["object"] == "response" and body["model"] == MODEL
    assert body["output"] == [{"type": "output_text", "text": body["output_text"]}]
    assert body["metrics"]["engine_output_tokens"] > 0   # vLLM's usage, carried into the metrics
    assert [m.id for m in oai.models.list().data].count(MODEL) == 1

    # The replica demands its key; the proxy sent it on every call above and never logged it.
    direct = urllib.request.Request(f"http://127.0.0.1:{replica['port']}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(direct, timeout=30)
    assert refused.value.code == 401
    assert API_KEY not in proxy.log_path.read_text()


def test_the_anthropic_sdk_is_answered_by_vllm_itself(proxy: ProxyProcess) -> None:
    claude = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=MODEL, max_tokens=8, messages=CHAT)
    assert message.type == "message" and message.content[0].type == "text"
    assert 0 < message.usage.output_tokens <= 8 and message.usage.input_tokens > 0
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=CHAT) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text and 0 < final.usage.output_tokens <= 8
    assert claude.messages.count_tokens(model=MODEL, messages=CHAT).input_tokens > 0


def test_streamed_responses_api(proxy: ProxyProcess) -> None:
    ready_replica(proxy)
    body = {"model": MODEL, "input": "Count.", "max_output_tokens": 24, "stream": True}
    req = urllib.request.Request(proxy.url + "/v1/responses", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        events = [line.split(b" ", 1)[1].decode() for line in resp.read().splitlines()
                  if line.startswith(b"event: ")]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert "response.output_text.delta" in events


def _long_stream(proxy: ProxyProcess) -> Any:
    """A streamed request of LONG tokens, read up to its TOKENS_BEFORE_PAUSE-th token: vLLM sends its
    first (role) chunk before its engine has run a step, and its gauges are set after each step, so
    a pause right then would freeze running at 0."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=300)
    tokens = 0
    while tokens < TOKENS_BEFORE_PAUSE:
        line = resp.readline()
        assert line, "the stream ended before the pause"
        if line.startswith(b"data: {"):
            delta = json.loads(line[6:])["choices"][0]["delta"]
            tokens += bool(delta.get("content"))
    return resp


def test_gauges_route_and_a_disconnect_stops_generation(proxy: ProxyProcess) -> None:
    replica = ready_replica(proxy)
    # vLLM generates whether or not its client reads, so left alone the request ends within
    # seconds, maybe before one of the proxy's scrapes (every 0.5 s) sees it. Paused, it stays
    # running for as long as the checks take, with the few tokens it made before the pause. A warm
    # engine can make all LONG tokens while a busy machine runs the test's few lines to the pause
    # (seen: 3,000 made before it): such a try is over before it began, and is made again.
    tries = []
    for _ in range(5):
        # From an idle engine: a request still generating (an earlier test's, or a try's whose abort
        # is on its way) would count its tokens toward this one's and hold the gauge up.
        wait_for(lambda: vllm_metric(replica, "num_requests_running") == 0
                 and vllm_metric(replica, "num_requests_waiting") == 0, timeout=300, what="vLLM to be idle")
        generated = vllm_metric(replica, "generation_tokens_total")
        resp = _long_stream(proxy)
        read_at = time.monotonic()
        try:
            with paused(replica):
                pause_s = time.monotonic() - read_at
                wait_for(lambda since=generated: vllm_metric(replica, "num_requests_running") == 1
                         or vllm_metric(replica, "generation_tokens_total") - since >= LONG,
                         timeout=120, what="vLLM's gauge to show the request running, or the request to end")
                if vllm_metric(replica, "num_requests_running") != 1:
                    tries.append({"pause_s": round(pause_s, 2), "made": vllm_metric(replica, "generation_tokens_total") - generated,
                                  "waiting": vllm_metric(replica, "num_requests_waiting")})
                    continue   # it ended before the pause
                # Routing reads vLLM's own gauges from /metrics: the proxy sees the request running there.
                wait_for(lambda: proxy.admin_model(MODEL)["replicas"][0]["reported"].get("running", 0) >= 1,
                         timeout=120, what="the proxy to read vllm:num_requests_running >= 1")
                reported = proxy.admin_model(MODEL)["replicas"][0]["reported"]
                assert set(reported) == {"running", "waiting", "kv_cache"} and 0 < reported["kv_cache"] <= 1
                resp.close()   # the client goes away mid-stream
                # Still paused, so the request cannot end by itself: only the disconnect, carried
                # through the proxy, aborts it.
                wait_for(lambda: vllm_metric(replica, "num_requests_running") == 0, timeout=120,
                         what="vLLM to stop the abandoned request")
                break
        finally:
            resp.close()
    else:
        pytest.fail(f"vLLM had no request running once paused, 5 times in a row: {tries}")
    assert vllm_metric(replica, "generation_tokens_total") - generated < LONG - 1
    wait_for(lambda: proxy.admin_model(MODEL)["replicas"][0]["reported"].get("running") == 0, timeout=120,
             what="the proxy to read the running count back at 0")


def test_bad_overrides_are_rejected_before_anything_starts(proxy: ProxyProcess) -> None:
    name = "gemma4-nvfp4-vllm-serve"
    # Valid values one by one, but draft_model without its checkpoint: caught before anything starts.
    status, _, body = http("POST", proxy.url + f"/v1/admin/models/{name}/load",
                           {"overrides": {"vllm_speculative_method": "draft_model", "vllm_speculative_model": None}})
    assert status == 400 and body["error"]["code"] == "invalid_load_request"
    assert "vllm_speculative_model" in body["error"]["message"]
    status, _, body = http("POST", proxy.url + f"/v1/admin/models/{name}/load",
                           {"overrides": {"vllm_dtype": "float32"}})
    assert status == 400 and "not a live override" in body["error"]["message"]
    status, _, body = http("POST", proxy.url + f"/v1/admin/models/{name}/load",
                           {"overrides": {"vllm_kv_cache_dtype": "fp7"}})
    assert status == 400 and "vllm_kv_cache_dtype" in body["error"]["message"]
    assert proxy.admin_model(name)["state"] == "unloaded"


def test_a_crash_is_restarted_and_served_again(proxy: ProxyProcess) -> None:
    replica = ready_replica(proxy)
    old_group = process_group(replica["pid"])
    os.killpg(replica["pid"], signal.SIGKILL)   # the whole server dies, engine core included
    wait_for(lambda: not any(pid_alive(p) for p in old_group), timeout=60, what="the killed group to be gone")
    wait_for(lambda: proxy.admin_model(MODEL)["replicas"][0]["restarts"] >= 1, timeout=120,
             what="supervisord to restart the replica")
    restarted = ready_replica(proxy)
    assert restarted["pid"] != replica["pid"]
    reply = client(proxy).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8)
    assert reply.usage.completion_tokens > 0


@pytest.mark.parametrize("name", sorted(SEED_EXAMPLES))
def test_seed_example_loads_and_serves(proxy: ProxyProcess, name: str) -> None:
    """The seed's example, paths pointed at the tiny model and CPU settings in its fields and extra args
    (see seed_vllm_examples.cpu_variant), loaded with overrides that drop the GPU-only knobs."""
    status, _, body = http("POST", proxy.url + f"/v1/admin/models/{name}/load", {"overrides": CPU_OVERRIDES},
                           timeout=START_S)
    assert status == 200, body
    replica = ready_replica(proxy, name)
    assert replica["state"] == "ready"
    reply = client(proxy).chat.completions.create(model=name, messages=CHAT, max_tokens=8)
    assert reply.model == name and reply.usage.completion_tokens > 0
    group = process_group(replica["pid"])
    status, _, body = http("POST", proxy.url + f"/v1/admin/models/{name}/unload", timeout=120)
    assert status == 200 and body["state"] == "unloaded", body
    wait_for(lambda: not any(pid_alive(p) for p in group), timeout=60, what=f"{name}'s processes to exit")


def test_unload_ends_every_process_of_the_replica(proxy: ProxyProcess) -> None:
    replica = ready_replica(proxy)
    group = process_group(replica["pid"])
    assert len(group) >= 2   # the API server and its engine core
    status, _, body = http("POST", proxy.url + f"/v1/admin/models/{MODEL}/unload", timeout=120)
    assert status == 200 and body["state"] == "unloaded", body
    wait_for(lambda: not any(pid_alive(p) for p in group), timeout=60, what="the vLLM processes to exit")
    assert "RUNNING" not in proxy.supervisorctl("status").stdout
