"""Headers a launcher asks for (a replica's API key) reach the replica on every call the proxy makes:
health probe, model check, metrics scrape and forwarded requests. A real aiohttp server on port 0
stands in for the replica and records what it was sent."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from launchers import vllm_serve
from proxy.config import ModelConfig
from proxy.forward import upstream_timeout
from proxy.pool import probe

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

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", record)
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


def test_request_timeout_bounds_the_wait_for_bytes_not_the_whole_answer() -> None:
    s = spec(1, vllm_serve_timeout_s=30.0)
    timeout = upstream_timeout(s)
    assert (timeout.total, timeout.sock_read) == (None, 30.0)
    assert upstream_timeout(replace(s, request_timeout_s=None)).sock_read is None
