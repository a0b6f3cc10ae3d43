"""One tenant cannot read another's cache (issue 39, item 4), on a real `llm-pool serve` with real
llama-server replicas of the tiny GGUF and two tenants: the issue's probe (a right guess of another
tenant's secret gives more cached tokens than a wrong one) tells nothing across tenants, whatever
the prompt's shape, the body's own `id_slot`, an `X-Session-Id` or `prompt_cache_key` the other
tenant uses, or the route; while one tenant's own conversation still reuses its cache."""
from __future__ import annotations

from typing import Any

import pytest
import yaml

from helpers import ProxyProcess, http

pytestmark = pytest.mark.integration

KEYS = {"ALPHA_KEY": "sk-alpha-3c1d9e", "BETA_KEY": "sk-beta-77f0aa"}
TENANTS = {"alpha": {"key_env": ["ALPHA_KEY"], "fairness_key": "alpha"},
           "beta": {"key_env": ["BETA_KEY"], "fairness_key": "beta"}}
SECRET = "The vault code of tenant alpha is 4 8 1 5 1 6 2 3 4 2 and nobody else may know it. " * 2
RIGHT = SECRET[:120] + " and then some words"
WRONG = SECRET[:100] + "X" + SECRET[101:120] + " and then some words"
FILLER = "Nothing at all about vaults: the weather in spring, and the birds that sing."


def post(proxy: ProxyProcess, tenant: str, path: str, body: dict[str, Any],
         headers: dict[str, str] | None = None) -> dict[str, Any]:
    key = KEYS[f"{tenant.upper()}_KEY"]
    status, _, answer = http("POST", proxy.url + path, body=body,
                             headers={"Authorization": f"Bearer {key}", **(headers or {})})
    assert status == 200, answer
    assert isinstance(answer, dict)
    return answer


def cached(answer: dict[str, Any]) -> int:
    usage = answer.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens", usage.get("cache_read_input_tokens", 0)))


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from proxy.setup.demo_model import write_tiny_gguf
    from proxy.setup.llama_build import build_llama_server

    gguf = write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf")
    model = {"backend": "llama_server", "model_path": str(gguf), "llama_server_binary": str(build_llama_server()),
             "target_inflight": 2, "enabled": True}
    p = ProxyProcess({"ll": {**model, "routing": "least_loaded"}, "aff": {**model, "routing": "affinity"}})
    p.config["tenants"] = TENANTS
    p.config_path.write_text(yaml.safe_dump(p.config))
    p.env = dict(KEYS)
    p.start()
    try:
        p.wait_replicas_ready("ll", 1, timeout=120)
        p.wait_replicas_ready("aff", 1, timeout=120)
        yield p
    finally:
        assert not p.cleanup()


def probe(proxy: ProxyProcess, model: str, guess: str, **fields: Any) -> int:
    """Beta's cached tokens for `guess`, right after a prompt of its own that shares nothing with it."""
    post(proxy, "beta", "/v1/completions", {"model": model, "prompt": FILLER, "max_tokens": 1, **fields})
    return cached(post(proxy, "beta", "/v1/completions", {"model": model, "prompt": guess, "max_tokens": 1, **fields}))


def tokens(proxy: ProxyProcess, text: str) -> list[int]:
    answer = post(proxy, "beta", "/tokenize", {"model": "ll", "content": text})
    return [int(t) for t in answer["tokens"]]


def test_a_guess_of_another_tenants_prompt_is_never_answered_by_its_cache(proxy: ProxyProcess) -> None:
    for _ in range(2):
        post(proxy, "alpha", "/v1/completions", {"model": "ll", "prompt": SECRET, "max_tokens": 1})
    # Least loaded: llama-server's own choice by prompt similarity would pick alpha's slot.
    right, wrong = probe(proxy, "ll", RIGHT), probe(proxy, "ll", WRONG)
    assert right == wrong and right <= 4, (right, wrong)
    # The issue's shape: a nested token list, which got no key, and the body's own slot, each of them.
    for slot in (0, 1):
        right = probe(proxy, "ll", [tokens(proxy, RIGHT)], id_slot=slot)   # type: ignore[arg-type]
        wrong = probe(proxy, "ll", [tokens(proxy, WRONG)], slot_id=slot)   # type: ignore[arg-type]
        assert right == wrong and right <= 4, (slot, right, wrong)


def test_the_same_session_or_cache_key_is_another_conversation_in_another_tenant(proxy: ProxyProcess) -> None:
    def chat(tenant: str, system: str, field: dict[str, str], headers: dict[str, str]) -> int:
        return cached(post(proxy, tenant, "/v1/chat/completions",
                           {"model": "aff", "messages": [{"role": "system", "content": system},
                                                         {"role": "user", "content": "hi"}],
                            "max_tokens": 1, **field}, headers))

    for n, (field, headers) in enumerate((({"prompt_cache_key": "team"}, {}), ({}, {"X-Session-Id": "shared"}))):
        secret = f"Secret number {n}. {SECRET}"
        for _ in range(2):
            mine = chat("alpha", secret, field, headers)
        assert mine > 40   # alpha's own conversation reuses its cache
        guesses = []
        for guess in (secret, secret.replace("vault", "house")):
            chat("beta", FILLER, field, headers)
            guesses.append(chat("beta", guess, field, headers))
        assert guesses[0] == guesses[1] and guesses[0] < 40, (field, headers, guesses)


def counted(answer: dict[str, Any]) -> int:
    """The cached prompt tokens an answer of any route reports."""
    metrics = answer.get("metrics") or {}
    timings = answer.get("timings") or {}
    return cached(answer) or int(metrics.get("engine_cached_prompt_tokens") or 0) or int(timings.get("cache_n") or 0)


@pytest.mark.parametrize("path, shape", [
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
    ("/v1/messages", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
    ("/v1/responses", lambda text: {"input": text, "decoding": {"max_tokens": 1}}),
    ("/infill", lambda text: {"input_prefix": text, "input_suffix": "", "max_tokens": 1}),
])
def test_no_route_reads_another_tenants_slot(proxy: ProxyProcess, path: str, shape: Any) -> None:
    for _ in range(2):
        post(proxy, "alpha", path, {"model": "ll", **shape(SECRET)})
    for slot in (0, 1):
        guesses = []
        for guess in (RIGHT, WRONG):
            post(proxy, "beta", path, {"model": "ll", **shape(FILLER)})
            guesses.append(counted(post(proxy, "beta", path, {"model": "ll", **shape(guess), "id_slot": slot})))
        assert guesses[0] == guesses[1], (path, slot, guesses)
