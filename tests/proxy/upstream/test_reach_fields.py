"""What reaches a server of ours: never the proxy's own fields, nor the affinity key
(prompt_cache_key). A real aiohttp server on port 0 stands in for the replica and records the body."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from launchers import llama_server
from proxy.config.model import DEFAULT_ROUTING, ModelConfig
from proxy.upstream.reach import ProgramReach


@pytest.fixture
async def replica() -> AsyncIterator[tuple[list[dict[str, Any]], int]]:
    seen: list[dict[str, Any]] = []

    async def post(request: web.Request) -> web.Response:
        seen.append({"body": json.loads(await request.read()), "headers": dict(request.headers)})
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", post)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield seen, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    await runner.cleanup()


async def test_a_program_never_gets_the_affinity_or_fairness_key(replica: tuple[list[dict[str, Any]], int]) -> None:
    seen, port = replica
    cfg = ModelConfig(name="m", backend="llama_server", enabled=True, replicas=1, replica_max=1, target_inflight=1,
                      modalities=("text",), gpus=(), options={"model_path": "/m.gguf", **DEFAULT_ROUTING})
    reach = ProgramReach(llama_server.launch(cfg, 0, port, 5, {}))
    payload = {"messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "conv-1",
               "fairness_key": "team-a", "allow_remote": False}
    async with aiohttp.ClientSession() as http:
        async with await reach.post(http, "/v1/chat/completions", payload, "req_1",
                                    aiohttp.ClientTimeout(total=None)) as resp:
            assert resp.status == 200
    (got,) = seen
    assert got["body"] == {"messages": [{"role": "user", "content": "hi"}], "model": "m"}
    assert payload["prompt_cache_key"] == "conv-1"     # the caller's body is left as it was
