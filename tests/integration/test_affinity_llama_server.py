"""Affinity routing against real llama-server replicas of the tiny GGUF, through `llm-pool serve`:
a conversation stays on one replica and reuses its cache from the second turn on, conversations
spread, a full replica spills to the key's next one (counted), a replica that leaves moves only its
keys, each kind of key selects, and least_loaded behaves as before."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import aiohttp
import pytest

from helpers import ProxyProcess, http
from proxy.lifecycle.state.affinity import order
from proxy.serving.affinity_key import digest, prompt_prefix

pytestmark = pytest.mark.integration

SYSTEM = {"role": "system", "content": "You are the archivist of a long-running project. " * 12}
REPLICAS = [0, 1, 2]


def home(key: str, replicas: list[int] = REPLICAS) -> int:
    return order(key, replicas)[0]


def keys_homed(source: str, wanted: list[int], replicas: list[int] = REPLICAS) -> dict[int, str]:
    """One client value per wanted replica whose key (from `source`) has that replica as its home."""
    found: dict[int, str] = {}
    i = 0
    while set(found) != set(wanted):
        value = f"{source}-{i}"
        found.setdefault(home(digest(source, value), replicas), value)
        i += 1
    return {r: found[r] for r in wanted}


def chat(proxy: ProxyProcess, model: str, messages: list[dict[str, Any]], headers: dict[str, str] | None = None,
         **fields: Any) -> tuple[int, dict[str, Any]]:
    """(the replica that answered, the answer)."""
    status, hdrs, body = http("POST", proxy.url + "/v1/chat/completions", headers=headers,
                              body={"model": model, "messages": messages, "max_tokens": 4, **fields})
    assert status == 200, body
    return int(hdrs["X-Replica"]), body


def metrics_text(proxy: ProxyProcess) -> str:
    status, _, raw = http("GET", proxy.url + "/metrics")
    assert status == 200
    return raw.decode() if isinstance(raw, bytes) else str(raw)


@pytest.fixture
def proxy(start_proxy, llama_model, request: pytest.FixtureRequest) -> ProxyProcess:
    # affinity_max_wait_s 0: a request whose replica is full spills at once (with the default it
    # would first wait a second for a place there). The parameter, where a test gives one: service.workers.
    p: ProxyProcess = start_proxy({"aff": llama_model(replicas=3, replica_max=3, affinity_max_wait_s=0),
                                   "ll": llama_model(replicas=2, routing="least_loaded")},
                                  workers=getattr(request, "param", 1))
    p.wait_replicas_ready("aff", 3, timeout=120)
    p.wait_replicas_ready("ll", 2, timeout=120)
    return p


@pytest.mark.parametrize("proxy", [1, 2], indirect=True, ids=["workers1", "workers2"])
def test_a_conversation_stays_on_its_replica_and_its_cache_is_reused(proxy: ProxyProcess) -> None:
    """With two workers too: the controller picks the replica and its slot, the worker sends to it."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "What did we decide in March?"}]
    expected = home(digest("p", prompt_prefix({"messages": messages}, 1024)))
    cached = []
    for turn in range(4):
        replica, answer = chat(proxy, "aff", messages)
        assert replica == expected, f"turn {turn + 1}"
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages = [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "-"},
                    {"role": "user", "content": f"And after that, step {turn}?"}]
    assert all(c > 0 for c in cached[1:]), cached
    model = proxy.admin_model("aff")
    mine = model["replicas"][expected]
    assert mine["affinity_keys"] == 1 and mine["affinity_picks"] == 4
    assert mine["cache_hits"] >= 3 and mine["cache_hit_rate"] >= 0.75
    assert model["routing"] == "affinity"
    line = f'llm_pool_replica_cached_prompt_tokens_total{{host="local",model="aff",replica="{expected}"}} {float(sum(cached))}'
    assert line in metrics_text(proxy)


def test_conversations_spread_and_each_kind_of_key_selects(proxy: ProxyProcess) -> None:
    question = [SYSTEM, {"role": "user", "content": "The same question for everyone"}]
    # prompt_cache_key: each key on its own replica, whatever the messages (the same for all here).
    for replica, value in keys_homed("c", REPLICAS).items():
        assert chat(proxy, "aff", question, prompt_cache_key=value)[0] == replica
    # X-Session-Id, likewise; prompt_cache_key wins over it.
    sessions = keys_homed("s", REPLICAS)
    for replica, value in sessions.items():
        assert chat(proxy, "aff", question, headers={"X-Session-Id": value})[0] == replica
    cache_keys = keys_homed("c", REPLICAS)
    assert chat(proxy, "aff", question, headers={"X-Session-Id": sessions[0]},
                prompt_cache_key=cache_keys[1])[0] == 1
    # The prefix hash: conversations that start differently land where their own prefix says.
    homes = set()
    for i in range(12):
        messages = [SYSTEM, {"role": "user", "content": f"Conversation {i} starts here"}]
        replica = chat(proxy, "aff", messages)[0]
        assert replica == home(digest("p", prompt_prefix({"messages": messages}, 1024)))
        homes.add(replica)
    assert homes == set(REPLICAS)
    # An error the replica answered says where it came from too.
    status, hdrs, body = http("POST", proxy.url + "/v1/chat/completions", body={
        "model": "aff", "messages": [{"role": "user", "content": "x " * 3000}], "prompt_cache_key": cache_keys[0]})
    assert (status, body["error"]["code"]) == (400, "context_length_exceeded"), body
    assert hdrs["X-Replica"] == "0"
    # /v1/responses: the same key, the same replica, and the header says so.
    status, hdrs, body = http("POST", proxy.url + "/v1/responses",
                              body={"model": "aff", "input": "hi", "prompt_cache_key": cache_keys[2],
                                    "decoding": {"max_tokens": 4}})
    assert status == 200, body
    assert hdrs["X-Replica"] == "2"


def test_a_full_replica_spills_to_the_keys_next_replica_and_the_spill_is_counted(proxy: ProxyProcess) -> None:
    key = "busy-conversation"
    first, second = order(digest("c", key), REPLICAS)[:2]
    home_replica = proxy.admin_model("aff")["replicas"][first]
    spills, picks = home_replica["affinity_spills"], home_replica["affinity_picks"]

    async def scenario() -> int:
        """The replica that answered a request sent while the key's home held two requests
        (target_inflight 2). The home is frozen first, so the two it holds make no token and cannot
        end however slow this machine is (a running one ends at its slot's context within a second)."""
        async with aiohttp.ClientSession() as session:
            held = [asyncio.create_task(session.post(proxy.url + "/v1/chat/completions", json={
                "model": "aff", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 8,
                "prompt_cache_key": key})) for _ in range(2)]
            try:
                while proxy.admin_model("aff")["replicas"][first]["inflight"] < 2:
                    assert not any(t.done() for t in held), "a request to the frozen home was answered"
                    await asyncio.sleep(0.05)
                async with session.post(proxy.url + "/v1/chat/completions", json={
                        "model": "aff", "messages": [{"role": "user", "content": "one more"}], "max_tokens": 4,
                        "prompt_cache_key": key}) as resp:
                    assert resp.status == 200, await resp.text()
                    went = int(resp.headers["X-Replica"])
                assert proxy.admin_model("aff")["replicas"][first]["inflight"] == 2
                return went
            finally:
                os.kill(home_replica["pid"], signal.SIGCONT)
                for answered in await asyncio.gather(*held, return_exceptions=True):
                    if isinstance(answered, aiohttp.ClientResponse):
                        assert answered.status == 200
                        answered.release()

    os.kill(home_replica["pid"], signal.SIGSTOP)
    try:
        assert asyncio.run(scenario()) == second
    finally:
        os.kill(home_replica["pid"], signal.SIGCONT)
    home_after = proxy.admin_model("aff")["replicas"][first]
    assert (home_after["affinity_spills"] - spills, home_after["affinity_picks"] - picks) == (1, 2)
    metric = f'llm_pool_replica_affinity_spills_total{{host="local",model="aff",replica="{first}"}}'
    assert f"{metric} {float(home_after['affinity_spills'])}" in metrics_text(proxy)


def test_a_replica_that_leaves_moves_only_its_keys_and_they_come_back_with_it(proxy: ProxyProcess) -> None:
    question = [{"role": "user", "content": "status?"}]
    keys = [f"conv-{i}" for i in range(18)]
    before = {k: chat(proxy, "aff", question, prompt_cache_key=k)[0] for k in keys}
    assert before == {k: home(digest("c", k)) for k in keys}
    leaving = 1
    program = proxy.admin_model("aff")["replicas"][leaving]["program"]
    assert proxy.supervisorctl("stop", program).returncode == 0
    deadline = time.monotonic() + 30
    while proxy.admin_model("aff")["replicas"][leaving]["state"] == "ready":
        assert time.monotonic() < deadline, "the stopped replica stayed READY"
        time.sleep(0.05)
    during = {k: chat(proxy, "aff", question, prompt_cache_key=k)[0] for k in keys}
    assert {k for k in keys if during[k] != before[k]} == {k for k in keys if before[k] == leaving}
    assert all(during[k] == home(digest("c", k), [0, 2]) for k in keys)
    assert proxy.supervisorctl("start", program).returncode == 0
    proxy.wait_replicas_ready("aff", 3, timeout=60)
    after = {k: chat(proxy, "aff", question, prompt_cache_key=k)[0] for k in keys}
    assert after == before


def test_least_loaded_behaves_as_before(proxy: ProxyProcess) -> None:
    messages = [SYSTEM, {"role": "user", "content": "same conversation"}]
    seen = [chat(proxy, "ll", messages, prompt_cache_key="k", headers={"X-Session-Id": "s"})[0] for _ in range(4)]
    assert set(seen) == {0, 1}     # idle replicas take turns, whatever the keys say
    model = proxy.admin_model("ll")
    assert model["routing"] == "least_loaded"
    assert all(r["affinity_picks"] == 0 and r["affinity_keys"] == 0 for r in model["replicas"])
