"""Every llama_server field does what it says, read back from the running llama-server; and a model
that cannot start costs that model, not the service. Real `llm-pool serve`, supervisord, llama-server."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from helpers import ProxyProcess, http, wait_for

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "Hello there, tiny model."}]


def client(proxy: ProxyProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)


def slots(replica: dict[str, Any]) -> list[dict[str, Any]]:
    """The running server's own view of its slots."""
    with urllib.request.urlopen(f"http://127.0.0.1:{replica['port']}/slots", timeout=10) as resp:
        return json.load(resp)


def token_count(replica: dict[str, Any], text: str) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{replica['port']}/tokenize",
                                 data=json.dumps({"content": text}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return len(json.load(resp)["tokens"])


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_n_ctx_is_each_requests_context_and_a_load_override_changes_it(start_proxy, llama_model) -> None:
    # The tiny model is trained on 2048 tokens, which caps a slot; both sizes stay under it.
    proxy = start_proxy({"tiny": llama_model(llama_server_n_ctx=1024, target_inflight=4)})
    replica = proxy.wait_state("tiny", "loaded")["replicas"][0]
    got = slots(replica)
    assert [s["n_ctx"] for s in got] == [1024] * 4  # before: 1024 split over 4 slots, 256 each

    status, _, body = http("POST", proxy.url + "/v1/admin/models/tiny/unload")
    assert status == 200, body
    status, _, body = http("POST", proxy.url + "/v1/admin/models/tiny/load",
                           body={"overrides": {"llama_server_n_ctx": 2048}})
    assert status == 200, body
    assert body["overrides"] == {"llama_server_n_ctx": 2048}
    proxy.seen_pids.add(body["replicas"][0]["pid"])
    assert [s["n_ctx"] for s in slots(body["replicas"][0])] == [2048] * 4

    # A prompt of about 1500 tokens fits one request's context (it would not fit 2048 / 4 slots).
    prompt = "a " * int(1000 * 1500 / token_count(body["replicas"][0], "a " * 1000))
    reply = client(proxy).completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                             extra_body={"ignore_eos": True})
    assert 1024 < reply.usage.prompt_tokens < 2000 and reply.usage.completion_tokens == 4


def test_completions_and_embeddings_through_the_proxy_with_the_openai_client(start_proxy, llama_model) -> None:
    proxy = start_proxy({"tiny": llama_model(),
                         "embed": llama_model(llama_server_embeddings=True, llama_server_pooling="mean")})
    proxy.wait_state("tiny", "loaded")
    proxy.wait_state("embed", "loaded")
    oai = client(proxy)

    reply = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                   extra_body={"ignore_eos": True})
    assert reply.model == "tiny" and reply.usage.completion_tokens == 12
    assert isinstance(reply.choices[0].text, str) and reply.choices[0].text

    vectors = oai.embeddings.create(model="embed", input=["first text", "second text"])
    assert [d.index for d in vectors.data] == [0, 1]
    assert all(len(d.embedding) == 64 for d in vectors.data)  # the tiny model's embedding length
    assert vectors.data[0].embedding != vectors.data[1].embedding

    with pytest.raises(openai.BadRequestError) as info:
        oai.embeddings.create(model="tiny", input="x")
    assert info.value.status_code == 400 and info.value.code == "embeddings_unsupported"
    assert proxy.admin_model("embed")["capabilities"]["embeddings"] is True
    assert proxy.admin_model("tiny")["capabilities"]["embeddings"] is False


def test_embeddings_on_a_model_that_declares_no_pooling_answer_200(start_proxy, llama_model) -> None:
    # Before: the tiny GGUF declares no pooling, llama-server pooled with `none` and answered every
    # /v1/embeddings 400 "Pooling type 'none' is not OAI compatible".
    proxy = start_proxy({"embed": llama_model(llama_server_embeddings=True)})
    replica = proxy.wait_state("embed", "loaded")["replicas"][0]
    vectors = client(proxy).embeddings.create(model="embed", input=["first text", "second text"])
    assert [d.index for d in vectors.data] == [0, 1]
    assert all(len(d.embedding) == 64 for d in vectors.data)
    argv = cmdline(replica["pid"])
    assert argv[argv.index("--pooling") + 1] == "mean"


def test_the_seeds_spec_type_draft_starts_the_pinned_build(start_proxy, llama_model, tiny_gguf) -> None:
    # Before: `--spec-type draft` made llama-server exit ("unknown speculative type") and the load 502.
    proxy = start_proxy({"spec": llama_model(llama_server_spec_type="draft",
                                             llama_server_draft_model_path=str(tiny_gguf),
                                             llama_server_spec_draft_n_max=4, llama_server_spec_draft_p_min=0.1)})
    replica = proxy.wait_state("spec", "loaded")["replicas"][0]
    argv = cmdline(replica["pid"])
    assert argv[argv.index("--spec-type") + 1] == "draft-simple"
    reply = client(proxy).chat.completions.create(model="spec", messages=CHAT, max_tokens=8,
                                                  extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 8 and reply.choices[0].message.content


def test_media_path_reaches_llama_server(start_proxy, llama_model, tmp_path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    proxy = start_proxy({"tiny": llama_model(llama_server_media_path=str(media))})
    replica = proxy.wait_state("tiny", "loaded")["replicas"][0]
    argv = cmdline(replica["pid"])
    assert argv[argv.index("--media-path") + 1] == str(media)


def test_a_model_that_cannot_start_costs_that_model_not_the_service(start_proxy, llama_model, tmp_path) -> None:
    proxy = start_proxy({
        "tiny": llama_model(),
        "vl": {"backend": "vllm", "model_path": None, "vllm_model": "Qwen/Qwen2.5-VL-3B-Instruct", "enabled": True,
               "vllm_serve_binary": str(tmp_path / "no-vllm")},
        "gone": llama_model(model_path=str(tmp_path / "missing.gguf")),
        "picky": llama_model(llama_server_spec_type="draft-turbo"),
    }, engine={"backend": "llama_server"})
    proxy.wait_state("tiny", "loaded")
    for name, reason in (("vl", "no-vllm does not exist or is not executable"),
                         ("gone", "missing.gguf does not exist"),
                         ("picky", "'draft-turbo' is not accepted by")):
        model = proxy.wait_state(name, "failed")
        assert reason in model["last_error"], model["last_error"]
    status, _, health = http("GET", proxy.url + "/health")
    assert status == 200
    assert health["models"] == {"tiny": "loaded", "vl": "failed", "gone": "failed", "picky": "failed"}
    assert set(health["errors"]) == {"vl", "gone", "picky"}
    assert "it accepts:" in health["errors"]["picky"] and "draft-simple" in health["errors"]["picky"]
    reply = client(proxy).chat.completions.create(model="tiny", messages=CHAT, max_tokens=8,
                                                  extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 8 and reply.choices[0].message.content
    log = wait_for(lambda: (t := proxy.log_path.read_text()) and "missing.gguf" in t and t,
                   what="the reasons in the proxy log")
    assert "no-vllm does not exist or is not executable" in log


def test_serve_starts_with_unknown_keys_and_logs_them(start_proxy, llama_model) -> None:
    proxy = start_proxy({"tiny": llama_model(llama_server_nctx=2048)})
    proxy.wait_state("tiny", "loaded")
    log = proxy.log_path.read_text()
    assert "engine.models.tiny.llama_server_nctx: unknown field, ignored; did you mean `llama_server_n_ctx`?" in log
