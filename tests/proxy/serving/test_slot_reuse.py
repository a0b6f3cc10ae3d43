"""A restored slot is checked, not assumed: through the proxy's routes, on loopback, to a FAKE
llama-server (tests/fakes.py) that answers its slot endpoints. Its conversation is saved, the
replica "restarts" (a fresh table) and its slot is restored, and the conversation's next request
runs there: an answer that says it reused nothing (the llama.cpp bug of a restore that reports its
tokens and keeps none) marks the model and stops its saves; one that shows reuse keeps it saving.
tests/integration/test_kv_store_llama_server.py checks that the real llama-server's restores verify."""
from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from fakes import FakeLlamaServerHTTP, FakeSupervisor
from in_process import in_rotation, serve_routes
from launchers import llama_server
from proxy.config.loading import load_settings
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import Replica
from proxy.lifecycle.state.slots import SlotTable
from proxy.serving.forward import upstream_session
from proxy.serving.slot_reuse import stated_cached
from proxy.upstream.reach import ProgramReach


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[tuple[Any, ...]]]]:
    async with contextlib.AsyncExitStack() as stack:
        async def make(cached: int) -> tuple[str, aiohttp.ClientSession, Pool, Replica, FakeLlamaServerHTTP]:
            fake = await stack.enter_async_context(FakeLlamaServerHTTP(cached=cached))
            (tmp_path / "pool.yaml").write_text(
                f"service: {{state_dir: {tmp_path}}}\n"
                f"engine: {{lifecycle: {{kv_store_mib: 1}}, models: {{m: {{backend: llama_server, "
                f"model_path: {tmp_path / 'm.gguf'}, llama_server_binary: /bin/true, target_inflight: 3}}}}}}\n")
            settings = load_settings(tmp_path / "pool.yaml")
            http = await stack.enter_async_context(upstream_session())
            pool = Pool(settings, FakeSupervisor(), http, environ={})  # type: ignore[arg-type]
            spec = llama_server.launch(settings.models["m"], 0, fake.port, 5, {})
            replica = Replica(model="m", index=0, spec=spec, fullname="m:r0", pid=os.getpid(), reach=ProgramReach(spec))
            replica.slots = SlotTable(3)
            in_rotation(pool, "m", [replica])
            url = await serve_routes(stack, settings, pool, http)
            client = await stack.enter_async_context(aiohttp.ClientSession())
            return url, client, pool, replica, fake
        yield make


async def turn(client: aiohttp.ClientSession, url: str, replica: Replica, stream: bool) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    async with client.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "a"}) as resp:
        await resp.read()
        assert resp.status == 200
    # A stream's last bytes reach the client before its handler has counted its usage and let go.
    for _ in range(500):
        if replica.inflight == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"replica still has {replica.inflight} requests in flight")


async def saved_and_restored(pool: Pool, replica: Replica) -> None:
    """The model unloaded with its slots saved, and a new replica of its index given them back."""
    runtime = pool.models["m"]
    await pool.kv.save(runtime, seconds=30)
    assert pool.kv.describe("m")["stored_slots"] == 3
    replica.slots = None
    await pool.kv.restore(runtime, replica, seconds=30)
    assert pool.kv.describe("m")["restored"]["hit"] == 3


def saves_asked(fake: FakeLlamaServerHTTP) -> int:
    return sum(1 for _conn, path, _body, _headers in fake.requests if path.startswith("/slots"))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_restore_the_next_answer_shows_no_reuse_of_marks_the_model_and_stops_its_saves(
        start: Any, stream: bool) -> None:
    url, client, pool, replica, fake = await start(cached=0)
    await turn(client, url, replica, stream)
    await saved_and_restored(pool, replica)
    await turn(client, url, replica, stream)   # the conversation's own slot: it reads 0 tokens from it
    view: Any = pool.describe(pool.models["m"])["kv_store"]   # the admin view's
    assert view["restore_unverified"] is True and view["restore_checks"] == {"verified": 0, "unverified": 1}
    [event] = pool.events.since(kinds=frozenset({"kv_store"}))
    assert event.model == "m" and event.reason == "restore_unverified" and "0 cached tokens" in event.message
    asked = saves_asked(fake)
    await pool.kv.save(pool.models["m"], seconds=30)
    assert saves_asked(fake) == asked and pool.kv.store.entries() == []   # no disk spent for nothing


@pytest.mark.parametrize("stream", [False, True])
async def test_a_restore_the_next_answer_shows_reuse_of_is_verified_and_saves_go_on(start: Any, stream: bool) -> None:
    url, client, pool, replica, fake = await start(cached=2)
    await turn(client, url, replica, stream)
    await saved_and_restored(pool, replica)
    await turn(client, url, replica, stream)
    view = pool.kv.describe("m")
    assert view["restore_unverified"] is False and view["restore_checks"] == {"verified": 1, "unverified": 0}
    await pool.kv.save(pool.models["m"], seconds=30)
    assert pool.kv.describe("m")["stored_slots"] == 3
    assert pool.events.since(kinds=frozenset({"kv_store"})) == []


def test_only_a_figure_the_answer_gives_counts() -> None:
    assert stated_cached({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}) == 0
    assert stated_cached({"prompt_tokens": 9, "cached_tokens": 4}) == 4          # Moonshot's shape
    assert stated_cached({"prompt_tokens": 9, "completion_tokens": 1}) is None
    assert stated_cached({"input_tokens": 9, "output_tokens": 1}) is None      # Anthropic's, silent on the cache
    assert stated_cached({"input_tokens": 9, "cache_read_input_tokens": 0}) == 0
    assert stated_cached(None) is None
