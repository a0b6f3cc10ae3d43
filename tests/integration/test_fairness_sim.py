"""Fairness, capacity and disconnects through real supervisord and the simulated engine."""
from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import aiohttp
import pytest

from helpers import ProxyProcess, http, wait_for

pytestmark = pytest.mark.integration


def sim_model(max_seqs: int, decode: float, **fields: Any) -> dict[str, Any]:
    return {"backend": "sim", "target_inflight": max_seqs, "enabled": True,
            "sim": {"max_seqs": max_seqs, "decode_tokens_per_s": decode, "ttft_ms": 1}, **fields}


def sim_get(proxy: ProxyProcess, path: str) -> Any:
    port = proxy.admin_model("sim")["replicas"][0]["port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        body = resp.read().decode()
    return json.loads(body) if path.startswith("/v1") else body


def sim_running(proxy: ProxyProcess) -> int:
    for line in sim_get(proxy, "/metrics").splitlines():
        if line.startswith("vllm:num_requests_running"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("no running gauge")


def key_counts(proxy: ProxyProcess, key: str) -> dict[str, float]:
    return proxy.admin_model("sim")["keys"].get(key, {"active": 0, "waiting": 0})


async def post(session: aiohttp.ClientSession, proxy: ProxyProcess, key: str | None, request_id: str,
               max_tokens: int, header_key: bool = False) -> tuple[int, dict[str, str], Any]:
    body: dict[str, Any] = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    headers = {"X-Request-Id": request_id}
    if key is not None and header_key:
        headers["X-Fairness-Key"] = key
    elif key is not None:
        body["fairness_key"] = key
    async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def test_lone_key_uses_every_slot_and_disconnects_free_them(start_proxy) -> None:
    proxy = start_proxy({"sim": sim_model(4, decode=20)})
    proxy.wait_state("sim", "loaded")
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(post(session, proxy, "batch", f"b{i}", 10_000)) for i in range(8)]
        counts = await asyncio.to_thread(wait_for, lambda: (c := key_counts(proxy, "batch"))["waiting"] == 4 and c,
                                         what="4 running and 4 waiting")
        assert counts["active"] == 4
        assert await asyncio.to_thread(wait_for, lambda: sim_running(proxy) == 4, what="the sim to run 4")
        # The admin view carries the backend's own gauges, scraped from its /metrics for routing.
        replica = await asyncio.to_thread(
            wait_for, lambda: (r := proxy.admin_model("sim")["replicas"][0])["reported"].get("running") == 4 and r,
            what="the scraped running gauge")
        assert replica["inflight"] == 4 and replica["reported"]["waiting"] == 0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # Clients gone: queued ones left their queue, running ones were closed upstream.
    wait_for(lambda: sim_running(proxy) == 0, what="the sim to stop generating")
    model = wait_for(lambda: (m := proxy.admin_model("sim"))["active"] == 0 and m["waiting"] == 0 and m,
                     what="the proxy to free every slot")
    assert model["capacity"] == 4


async def test_interactive_request_gets_the_next_slot_behind_100_queued(start_proxy) -> None:
    fairness = {"max_pending_per_key": 500, "max_pending_per_executor": 500}
    proxy = start_proxy({"sim": sim_model(2, decode=400)}, engine={"fairness": fairness})
    proxy.wait_state("sim", "loaded")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        batch = [asyncio.create_task(post(session, proxy, "batch", f"batch-{i}", 40)) for i in range(120)]
        await asyncio.to_thread(wait_for, lambda: key_counts(proxy, "batch")["waiting"] >= 100,
                                what="100 queued batch requests")
        started_before = len(sim_get(proxy, "/v1/sim/started")["started"])
        status, _, _ = await post(session, proxy, "ui", "ui-0", 4, header_key=True)
        assert status == 200
        started = [s["id"] for s in sim_get(proxy, "/v1/sim/started")["started"]]
        results = await asyncio.gather(*batch)
    assert all(r[0] == 200 for r in results)
    # The UI request took one of the next slots to free (both slots may free together while its
    # request is on the wire), not a place behind the 100 batch requests that were waiting before it.
    assert started.index("ui-0") <= started_before + 2, (started_before, started.index("ui-0"))
    # The fairness key (body or header) is llm-pool's alone: the engine never sees it.
    assert all("fairness_key" not in s["fields"] for s in sim_get(proxy, "/v1/sim/started")["started"])


async def test_full_queues_answer_429_and_leaving_clients_free_them(start_proxy) -> None:
    fairness = {"max_pending_per_key": 3, "max_pending_per_executor": 5}
    proxy = start_proxy({"sim": sim_model(1, decode=50)}, engine={"fairness": fairness})
    proxy.wait_state("sim", "loaded")
    async with aiohttp.ClientSession() as session:
        held = [asyncio.create_task(post(session, proxy, "a", f"a{i}", 10_000)) for i in range(4)]
        await asyncio.to_thread(wait_for, lambda: key_counts(proxy, "a")["waiting"] == 3, what="a's queue")
        status, headers, body = await post(session, proxy, "a", "a-over", 10)
        assert (status, body["error"]["code"]) == (429, "fairness_key_queue_full")
        assert int(headers["Retry-After"]) >= 1
        held += [asyncio.create_task(post(session, proxy, "b", f"b{i}", 10_000, header_key=True))
                 for i in range(2)]
        await asyncio.to_thread(wait_for, lambda: proxy.admin_model("sim")["waiting"] == 5, what="5 waiting")
        status, headers, body = await post(session, proxy, "c", "c-over", 10)
        assert (status, body["error"]["code"]) == (429, "executor_queue_full")
        assert int(headers["Retry-After"]) >= 1
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    model = wait_for(lambda: (m := proxy.admin_model("sim"))["waiting"] == 0 and m["active"] == 0 and m,
                     what="queues to empty")
    assert model["capacity"] == 1
    wait_for(lambda: sim_running(proxy) == 0, what="the sim to stop generating")
    status, _, _ = http("POST", proxy.url + "/v1/chat/completions",
                        body={"model": "sim", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert status == 200
