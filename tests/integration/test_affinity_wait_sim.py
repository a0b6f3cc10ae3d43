"""A request whose affinity key's replica is full waits for a place there while the load stays within
affinity_max_imbalance, instead of taking whichever replica frees first (and prefilling its whole
conversation there); after affinity_max_wait_s it spills. Through `llm-pool serve` to sim replicas
whose streams go silent after two tokens, so a held stream keeps its place until the test closes it."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from helpers import ProxyProcess, wait_for
from proxy.lifecycle.state.affinity import order
from proxy.serving.affinity_key import digest

pytestmark = pytest.mark.integration

REPLICAS = [0, 1, 2]
STALLING = {"max_seqs": 2, "decode_tokens_per_s": 200, "ttft_ms": 1, "stall_after_tokens": 2}


def model(max_wait: float | None) -> dict[str, Any]:
    return {"backend": "sim", "enabled": True, "replicas": 3, "replica_max": 3, "target_inflight": 2,
            "routing": "affinity", "affinity_max_wait_s": max_wait, "sim": STALLING}


def homed(replica: int) -> str:
    """A prompt_cache_key whose own replica is `replica`."""
    i = 0
    while order(digest("c", f"key-{i}"), REPLICAS)[0] != replica:
        i += 1
    return f"key-{i}"


@pytest.fixture
def proxy(start_proxy) -> ProxyProcess:
    p: ProxyProcess = start_proxy({"patient": model(None), "brief": model(0.2)})
    p.wait_replicas_ready("patient", 3, timeout=60)
    p.wait_replicas_ready("brief", 3, timeout=60)
    return p


async def _stream(session: aiohttp.ClientSession, url: str, name: str, key: str) -> aiohttp.ClientResponse:
    """A stream of `key`, open once its first bytes came: it holds its place until closed."""
    resp = await session.post(url + "/v1/chat/completions", json={
        "model": name, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 50, "stream": True,
        "prompt_cache_key": key})
    assert resp.status == 200, await resp.text()
    await resp.content.readline()
    return resp


async def _busy(session: aiohttp.ClientSession, proxy: ProxyProcess, name: str,
                key: str) -> tuple[list[aiohttp.ClientResponse], list[int]]:
    """`key`'s replica full (2 of target_inflight 2) and the others at 1 each: within the bound of 1."""
    first, second, third = order(digest("c", key), REPLICAS)
    held = [await _stream(session, proxy.url, name, k) for k in (key, key, homed(second), homed(third))]
    assert [int(r.headers["X-Replica"]) for r in held] == [first, first, second, third]
    return held, [first, second, third]


def test_a_full_replica_within_the_bound_is_waited_for_and_the_request_takes_its_next_place(
        proxy: ProxyProcess) -> None:
    key = "long-conversation"

    async def scenario() -> tuple[int, int]:
        async with aiohttp.ClientSession() as session:
            held, (first, _, _) = await _busy(session, proxy, "patient", key)
            waiter = asyncio.ensure_future(_stream(session, proxy.url, "patient", key))
            # Before the change it spilled to the key's second replica (it had room) at once.
            await asyncio.to_thread(wait_for, lambda: proxy.admin_model("patient")["replicas"][first]
                                    ["affinity_waits"] == 1, what="the request to wait for its replica")
            assert not waiter.done()
            # It waits at its replica, not on a place: admission lets one more request in for it.
            assert proxy.admin_model("patient")["capacity"] == 7
            held[0].close()
            resp = await waiter
            replica = int(resp.headers["X-Replica"])
            for r in [*held, resp]:
                r.close()
            return replica, first

    replica, first = asyncio.run(scenario())
    assert replica == first
    model = proxy.admin_model("patient")
    assert model["replicas"][first]["affinity_spills"] == 0 and model["replicas"][first]["affinity_picks"] == 3
    wait_for(lambda: proxy.admin_model("patient")["capacity"] == 6, what="the capacity back to the places")


def test_a_request_that_waited_affinity_max_wait_s_spills_to_the_keys_next_replica(proxy: ProxyProcess) -> None:
    key = "long-conversation"

    async def scenario() -> tuple[int, list[int]]:
        async with aiohttp.ClientSession() as session:
            held, replicas = await _busy(session, proxy, "brief", key)
            # Nothing frees a place: only the 0.2 s bound ends the wait.
            resp = await _stream(session, proxy.url, "brief", key)
            for r in [*held, resp]:
                r.close()
            return int(resp.headers["X-Replica"]), replicas

    replica, (first, second, _) = asyncio.run(scenario())
    assert replica == second
    mine = proxy.admin_model("brief")["replicas"][first]
    assert (mine["affinity_waits"], mine["affinity_spills"]) == (1, 1)
