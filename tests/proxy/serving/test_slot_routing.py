"""A conversation's requests carry its llama-server slot (`id_slot`) on a replica whose slots the
KV store keeps (Replica.slots), and the slot is free again once the answer is done, whether it was
sent once or again on a new connection. Real HTTP on loopback to a FAKE llama-server that records
what it read (tests/fakes.py); tests/integration/test_kv_store_llama_server.py does it for real."""
from __future__ import annotations

import asyncio
import json
import contextlib
import os
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from fakes import FakeLlamaServerHTTP, FakeSupervisor
from in_process import in_rotation, serve_routes
from launchers import llama_server
from proxy.config.loading import load_settings
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import Replica
from proxy.lifecycle.state.slots import SlotTable
from proxy.serving.affinity_key import digest
from proxy.serving.forward import upstream_session
from proxy.serving.tenancy import Tenancy
from proxy.upstream.reach import ProgramReach


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[tuple[Any, ...]]]]:
    async with contextlib.AsyncExitStack() as stack:
        async def make(slots: bool = True, routing: str = "affinity", tenants: bool = False,
                       **fake_options: Any) -> tuple[str, aiohttp.ClientSession, Replica, FakeLlamaServerHTTP]:
            fake = await stack.enter_async_context(FakeLlamaServerHTTP(**fake_options))
            (tmp_path / "pool.yaml").write_text(
                f"service: {{state_dir: {tmp_path}}}\n"
                f"engine: {{models: {{m: {{backend: llama_server, model_path: {tmp_path / 'm.gguf'}, "
                f"llama_server_binary: /bin/true, target_inflight: 3, routing: {routing}}}}}}}\n" +
                ("tenants: {alpha: {key_env: [ALPHA], fairness_key: a}, beta: {key_env: [BETA], fairness_key: b}}\n"
                 if tenants else ""))
            settings = load_settings(tmp_path / "pool.yaml")
            http = await stack.enter_async_context(upstream_session())
            pool = Pool(settings, FakeSupervisor(), http, environ={})  # type: ignore[arg-type]
            spec = llama_server.launch(settings.models["m"], 0, fake.port, 5, {})
            replica = Replica(model="m", index=0, spec=spec, fullname="m:r0", pid=os.getpid(), reach=ProgramReach(spec))
            replica.slots = SlotTable(3, scoped=tenants) if slots else None
            in_rotation(pool, "m", [replica])
            tenancy = None
            if tenants:
                tenancy = Tenancy.open(settings, {"ALPHA": "sk-alpha", "BETA": "sk-beta"}, CollectorRegistry())
                stack.callback(tenancy.close)
            url = await serve_routes(stack, settings, pool, http, tenancy=tenancy)
            client = await stack.enter_async_context(aiohttp.ClientSession())
            return url, client, replica, fake
        yield make


async def chat(client: aiohttp.ClientSession, url: str, session: str, stream: bool = False) -> int:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    async with client.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session}) as resp:
        await resp.read()
        return resp.status


async def settled(replica: Replica) -> None:
    """Until the proxy has let go of the replica: a streamed answer's last bytes reach the client
    before the handler that sent them has released its replica (and slot)."""
    for _ in range(500):
        if replica.inflight == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"replica still has {replica.inflight} requests in flight")


def sent_slots(fake: FakeLlamaServerHTTP) -> list[Any]:
    return [body.get("id_slot") for _conn, _path, body, _headers in fake.requests]


async def test_each_conversation_goes_to_its_own_slot_and_back_to_it(start: Any) -> None:
    url, client, replica, fake = await start()
    for session in ("a", "b", "a", "c", "b"):
        assert await chat(client, url, session) == 200
        await settled(replica)
    assert sent_slots(fake) == [0, 1, 0, 2, 1]
    assert replica.slots.take("d")[0] == 0   # every slot is free again: the least recently used first


async def test_a_stream_sent_again_on_a_new_connection_keeps_its_slot_and_frees_it(start: Any) -> None:
    url, client, replica, fake = await start()
    # The fake closes a streamed answer's connection as the next request arrives on it: that next
    # request is sent once more on a new connection (forward._post), with the same slot.
    assert await chat(client, url, "a", stream=True) == 200
    assert await chat(client, url, "a", stream=True) == 200
    assert set(sent_slots(fake)) == {0}
    await settled(replica)
    # a's slot was freed each time: it is a's again, and a new conversation takes another.
    assert replica.slots.take(digest("s", "a"))[0] == 0 and replica.slots.take("new")[0] == 1


async def test_without_kept_slots_or_an_affinity_key_the_body_goes_as_it_came(start: Any) -> None:
    url, client, _replica, fake = await start(slots=False)
    assert await chat(client, url, "a") == 200
    assert sent_slots(fake) == [None]


async def test_least_loaded_routing_sends_no_slot(start: Any) -> None:
    url, client, _replica, fake = await start(routing="least_loaded")
    assert await chat(client, url, "a") == 200
    assert sent_slots(fake) == [None]


@pytest.mark.parametrize("slots, routing", [(False, "least_loaded"), (False, "affinity"), (True, "affinity")])
async def test_a_clients_own_slot_never_reaches_the_engine(start: Any, slots: bool, routing: str) -> None:
    # Issue 39: the body's `id_slot` (or its older name) would pick, and read, any slot's cache; a
    # prompt of nested token ids, which gets no affinity key of its own, is no exception.
    url, client, replica, fake = await start(slots=slots, routing=routing)
    bodies = [{"model": "m", "messages": [{"role": "user", "content": "hi"}], "id_slot": 2},
              {"model": "m", "prompt": [[5, 6, 7]], "slot_id": 2},
              {"model": "m", "prompt": [[5, 6, 7]], "id_slot": 2, "stream": True}]
    for body in bodies:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        async with client.post(url + path, json=body) as resp:
            await resp.read()
            assert resp.status == 200
        await settled(replica)
    seen = [(b.get("id_slot"), b.get("slot_id")) for _conn, _path, b, _headers in fake.requests]
    # Only the proxy's own slot goes (its table's: one per conversation, the token prompt's its own
    # too), and none at all without a table.
    assert seen == ([(0, None), (1, None), (1, None)] if slots else [(None, None)] * 3)


async def test_with_tenants_each_tenant_has_its_own_slots_and_never_reuses_anothers(start: Any) -> None:
    url, client, replica, fake = await start(tenants=True, routing="least_loaded")

    async def send(key: str, session: str | None = None, **fields: Any) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
        headers = {"Authorization": f"Bearer {key}", **({"X-Session-Id": session} if session else {})}
        async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            await resp.read()
            assert resp.status == 200
        await settled(replica)

    # Least loaded: no affinity key, yet every request runs in a slot of its tenant's, never llama-server's
    # choice by prompt similarity; the first in a slot of no known tenant does not reuse its cache.
    await send("sk-alpha")
    await send("sk-alpha")
    await send("sk-beta")
    await send("sk-beta", cache_prompt=True)   # the client's own cache_prompt, in its own slot
    await send("sk-alpha", id_slot=1)
    sent = [(b.get("id_slot"), b.get("cache_prompt")) for _conn, _path, b, _headers in fake.requests]
    assert sent == [(0, False), (0, None), (1, False), (1, True), (0, None)]


async def test_with_tenants_the_same_session_of_two_tenants_is_two_conversations(start: Any) -> None:
    url, client, replica, fake = await start(tenants=True)
    for key in ("sk-alpha", "sk-beta", "sk-alpha", "sk-beta"):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with client.post(url + "/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}", "X-Session-Id": "shared"}) as resp:
            await resp.read()
            assert resp.status == 200
        await settled(replica)
    sent = [(b.get("id_slot"), b.get("cache_prompt")) for _conn, _path, b, _headers in fake.requests]
    assert sent == [(0, False), (1, False), (0, None), (1, None)]
    assert replica.slots is not None and {replica.slots.key_of(0), replica.slots.key_of(1)} == \
        {digest("s", "shared") + "@alpha", digest("s", "shared") + "@beta"}


def test_the_slot_fields_go_into_the_clients_bytes_once() -> None:
    from proxy.serving.forward import with_slot

    raw = b'{"model": "m", "prompt": "a } b"}\n'
    assert with_slot(raw, {"model": "m", "prompt": "a } b"}, 2, False) == \
        b'{"model": "m", "prompt": "a } b","id_slot":2}\n'
    spliced = with_slot(raw, {"model": "m", "prompt": "a } b"}, 0, True)
    assert spliced is not None and json.loads(spliced) == {"model": "m", "prompt": "a } b", "id_slot": 0,
                                                          "cache_prompt": False}
    # The client's own cache_prompt would be there twice: the body is encoded again instead.
    assert with_slot(b'{"model": "m", "cache_prompt": true}', {"model": "m", "cache_prompt": True}, 0, True) is None
    assert with_slot(None, {"model": "m"}, 0, False) is None
