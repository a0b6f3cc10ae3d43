"""What a program replica is sent: the client's own bytes when nothing in them must change, a
re-encoded body when `model` differs from what the replica serves or a proxy-only field is present.
A real aiohttp server on port 0 stands in for the replica and records the bytes it received."""
from __future__ import annotations

import json
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from launchers import sim
from proxy.config.model import ModelConfig
from proxy.upstream.reach import ProgramReach


@pytest.fixture
async def replica() -> AsyncIterator[tuple[list[bytes], ProgramReach]]:
    seen: list[bytes] = []

    async def post(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/{tail:.*}", post)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    cfg = ModelConfig(name="m", backend="sim", enabled=True, replicas=1, replica_max=1, target_inflight=1,
                      modalities=("text",), gpus=(), options={})
    yield seen, ProgramReach(sim.launch(cfg, 0, port, 5, {}))
    await runner.cleanup()


async def send(reach: ProgramReach, raw: bytes) -> None:
    async with aiohttp.ClientSession() as http:
        async with await reach.post(http, "/v1/chat/completions", json.loads(raw), "req_1",
                                    aiohttp.ClientTimeout(total=None), raw) as resp:
            assert resp.status == 200


async def test_the_clients_bytes_go_as_they_came_when_nothing_changes(
        replica: tuple[list[bytes], ProgramReach]) -> None:
    seen, reach = replica
    raw = b'{ "model":"m",  "messages": [{"role": "user", "content": "caf\\u00e9"}], "max_tokens": 4 }'
    await send(reach, raw)
    assert seen == [raw]   # spacing and escapes as the client wrote them: nothing was decoded and encoded again


async def test_a_body_with_a_proxy_only_field_is_sent_without_it(replica: tuple[list[bytes], ProgramReach]) -> None:
    seen, reach = replica
    await send(reach, b'{"model": "m", "messages": [], "fairness_key": "alice", "allow_remote": false}')
    assert json.loads(seen[0]) == {"model": "m", "messages": []}


async def test_a_body_whose_model_is_not_the_served_one_gets_the_served_name(
        replica: tuple[list[bytes], ProgramReach]) -> None:
    seen, reach = replica
    reach.served_model = "served-name"
    await send(reach, b'{"model": "m", "messages": []}')
    assert json.loads(seen[0]) == {"model": "served-name", "messages": []}
