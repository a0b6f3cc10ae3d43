"""Headers a launcher asks for (a replica's API key) reach the replica on every call the proxy makes:
health probe, model check, metrics scrape and forwarded requests. A real aiohttp server on port 0
stands in for the replica and records what it was sent."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from launchers import vllm_serve
from proxy.config.model import ModelConfig
from proxy.upstream.reach import ProgramReach
from proxy.lifecycle.watch.monitor import probe

KEY = "sk-replica-key"


@pytest.fixture
async def replica() -> AsyncIterator[tuple[list[dict[str, str]], int]]:
    seen: list[dict[str, str]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "auth": request.headers.get("Authorization", "")})
        if request.path == "/v1/models":
            if request.headers.get("Authorization") != f"Bearer {KEY}":
                return web.json_response({"error": "unauthorized"}, status=401)
            return web.json_response({"data": [{"id": "m"}]})
        return web.Response(text="ok")

    async def post(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "auth": request.headers.get("Authorization", "")})
        if request.path == "/stall":
            await asyncio.Event().wait()   # never answers: only the client's read timeout ends it
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", record)
    app.router.add_route("POST", "/{tail:.*}", post)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield seen, port
    await runner.cleanup()


def spec(port: int, **options: Any) -> Any:
    cfg = ModelConfig(name="m", backend="vllm_serve", enabled=True, replicas=1, replica_max=1, target_inflight=1,
                      modalities=("text",), gpus=(), options={"vllm_model": "org/m", **options})
    return vllm_serve.launch(cfg, 0, port, 5, {})


async def test_probe_sends_the_replica_key(replica: tuple[list[dict[str, str]], int]) -> None:
    seen, port = replica
    async with aiohttp.ClientSession() as http:
        assert await probe(http, spec(port, vllm_serve_api_key=KEY)) == (True, None)
        ok, _ = await probe(http, spec(port))
    assert not ok  # without the key the replica refuses /v1/models: not ready
    assert [s["auth"] for s in seen[:2]] == [f"Bearer {KEY}"] * 2


async def test_forwarded_requests_carry_the_key(replica: tuple[list[dict[str, str]], int]) -> None:
    seen, port = replica
    reach = ProgramReach(spec(port, vllm_serve_api_key=KEY))
    async with aiohttp.ClientSession() as http:
        async with await reach.post(http, "/v1/chat/completions", {"messages": []}, "req_1",
                                    aiohttp.ClientTimeout(total=None)) as resp:
            assert resp.status == 200
    assert seen[-1] == {"path": "/v1/chat/completions", "auth": f"Bearer {KEY}"}


async def test_request_timeout_bounds_the_wait_for_bytes(replica: tuple[list[dict[str, str]], int]) -> None:
    _seen, port = replica
    assert ProgramReach(spec(port)).read_timeout_s is None   # unset: no limit of the backend's own
    reach = ProgramReach(spec(port, vllm_serve_timeout_s=0.2))
    async with aiohttp.ClientSession() as http:
        with pytest.raises(asyncio.TimeoutError):
            await reach.post(http, "/stall", {}, "req_2", aiohttp.ClientTimeout(total=None))
