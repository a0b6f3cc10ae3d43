"""LoRA adapters of a vLLM model (docs/adapters.md), through `llm-pool serve`, real supervisord and
`vllm serve` of the tiny HF Llama with a tiny PEFT adapter: the adapter's id answers otherwise than
its base, an admin's unload frees it in the engine, and the next request for it loads it again.

The vLLM is the CPU build `llm-pool setup --all-engines` caches (proxy/setup/vllm_env.py), or the
`vllm` command LLM_POOL_TEST_VLLM names, as in test_serve_vllm.py. One `vllm serve` start serves
the whole module: each costs tens of seconds on a CPU.
"""
from __future__ import annotations

import os
import signal
from typing import Iterator

import pytest

from helpers import ProxyProcess, http, pid_alive
from tiny_hf_model import LORA_RANK, write_tiny_hf_llama, write_tiny_peft_adapter
from vllm_test_env import NEEDS_VLLM, START_S, process_group, vllm_command, vllm_env

pytestmark = [pytest.mark.integration, NEEDS_VLLM]

BASE = "tiny-vllm"
TUNED = f"{BASE}:tiny"
CONTEXT = 2048
QUESTION = [{"role": "user", "content": "hello there, how is the weather in the park"}]



@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    folder = tmp_path_factory.mktemp("hf")
    tiny_hf = write_tiny_hf_llama(folder / "tiny-llama")
    adapter = write_tiny_peft_adapter(folder / "tiny-lora", tiny_hf)
    started = ProxyProcess({BASE: {
        "backend": "vllm_serve", "enabled": True, "target_inflight": 2, "vllm_model": str(tiny_hf),
        "vllm_serve_binary": vllm_command(), "vllm_dtype": "float32",
        "vllm_max_model_len": CONTEXT, "vllm_max_lora_rank": LORA_RANK,
        # Two sequences of CONTEXT tokens: 2 layers x K and V x 128 float32s a token each.
        "vllm_kv_cache_memory_bytes": 2 * CONTEXT * 2 * 2 * 128 * 4 + 16 * 1024 * 1024,
        "vllm_serve_env": vllm_env(), "vllm_serve_start_timeout_s": START_S,
        "vllm_serve_extra_args": ["--enforce-eager", "--max-num-seqs", "2", "--max-num-batched-tokens", "2048"],
        "lora_adapters": {"tiny": {"path": str(adapter)}}}})
    engine: set[int] = set()   # vLLM's engine core runs as a child in the replica's process group
    try:
        started.start()
        replica = started.wait_replicas_ready(BASE, 1, timeout=START_S)["replicas"][0]
        engine.update(process_group(replica["pid"]))
        yield started
    finally:
        survivors = started.cleanup() + [p for p in engine if pid_alive(p)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        assert not survivors, f"processes outlived the module and were killed: {survivors}"



def answer(proxy: ProxyProcess, model: str) -> str:
    status, headers, body = http("POST", proxy.url + "/v1/chat/completions", timeout=300,
                                 body={"model": model, "messages": QUESTION, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    # vLLM serves the adapter under its public id: the body's `model` and the header are the id asked for.
    assert headers["X-LLM-Pool-Model"] == model and body["model"] == model
    return str(body["choices"][0]["message"]["content"])


def replica_adapters(proxy: ProxyProcess) -> list[list[str]]:
    return [r["adapters"] for r in proxy.admin_model(BASE)["replicas"]]


def test_the_adapter_answers_otherwise_than_its_base(proxy: ProxyProcess) -> None:
    base, tuned = answer(proxy, BASE), answer(proxy, TUNED)
    assert tuned != base
    assert (answer(proxy, BASE), answer(proxy, TUNED)) == (base, tuned)   # greedy: the same again
    assert replica_adapters(proxy) == [["tiny"]]


def test_an_unloaded_adapter_is_loaded_again_by_the_next_request_for_it(proxy: ProxyProcess) -> None:
    tuned = answer(proxy, TUNED)
    status, _, body = http("POST", f"{proxy.url}/v1/admin/models/{BASE}/adapters/tiny/unload",
                           headers=proxy.admin_headers, timeout=300)
    assert status == 200, body
    assert replica_adapters(proxy) == [[]]
    assert answer(proxy, TUNED) == tuned   # vLLM no longer knew `tiny`: the proxy loaded it first
    assert replica_adapters(proxy) == [["tiny"]]
    # An admin's load of an adapter the replica holds changes nothing.
    status, _, body = http("POST", f"{proxy.url}/v1/admin/models/{BASE}/adapters/tiny/load",
                           headers=proxy.admin_headers, timeout=300)
    assert status == 200 and body["replicas"][0]["adapters"] == ["tiny"], body


def test_models_list_the_adapter_with_its_parent(proxy: ProxyProcess) -> None:
    status, _, listed = http("GET", proxy.url + "/v1/models")
    assert status == 200, listed
    entries = {m["id"]: m for m in listed["data"]}
    assert entries[TUNED]["parent"] == BASE and "parent" not in entries[BASE]
