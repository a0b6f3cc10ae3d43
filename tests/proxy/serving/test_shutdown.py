"""A stopping proxy: new work answered 503 shutting_down on a listener that stays open, reads still
answered, the drain waits for what was in flight. A real aiohttp server on port 0; the proxy's own
serve, signals and unload run in tests/integration/test_lifecycle.py."""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.serving.errors_http import error_middleware
from proxy.serving.shutdown import SHUTDOWN, Shutdown, shutdown_middleware


class Served:
    def __init__(self, server: TestServer, shutdown: Shutdown, entered: asyncio.Event, release: asyncio.Event) -> None:
        self.server, self.shutdown, self.entered, self.release = server, shutdown, entered, release
        self.url = str(server.make_url(""))


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    entered, release = asyncio.Event(), asyncio.Event()   # a held request has begun; it may end

    async def held(request: web.Request) -> web.Response:
        entered.set()
        await release.wait()
        return web.json_response({"done": True})

    async def quick(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[shutdown_middleware, error_middleware])
    app[SHUTDOWN] = shutdown = Shutdown(keep_models=False)
    app.router.add_post("/held", held)
    app.router.add_post("/work", quick)
    app.router.add_get("/view", quick)
    server = TestServer(app)
    await server.start_server()
    yield Served(server, shutdown, entered, release)
    release.set()
    await server.close()


async def test_once_stopping_new_work_is_503_shutting_down_and_reads_are_answered(served: Served) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(served.url + "/work") as resp:
            assert resp.status == 200
        served.shutdown.begin()
        async with session.post(served.url + "/work") as resp:
            body = await resp.json()
            assert (resp.status, body["error"]["code"], body["error"]["type"]) == (503, "shutting_down",
                                                                                   "server_error")
            # Retry-After as on every 503; the connection closes, so a client's pool reconnects.
            assert int(resp.headers["Retry-After"]) >= 1 and resp.headers["Connection"] == "close"
        async with session.get(served.url + "/view") as resp:
            assert resp.status == 200


async def test_the_drain_waits_for_the_request_in_flight_and_is_bounded(served: Served) -> None:
    async with aiohttp.ClientSession() as session:
        held = asyncio.create_task(session.post(served.url + "/held"))
        await served.entered.wait()
        served.shutdown.begin()
        assert await served.shutdown.drained(0) is False   # still in flight: the bound answers
        drained = asyncio.create_task(served.shutdown.drained(60))
        await asyncio.sleep(0)
        assert not drained.done()
        served.release.set()
        resp = await held
        assert resp.status == 200 and await resp.json() == {"done": True}   # admitted before: it finishes
        resp.release()
        assert await drained is True and served.shutdown.inflight == 0


def test_sigusr1_keeps_the_models_and_a_later_signal_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    shutdown = Shutdown(keep_models=False)
    with caplog.at_level(logging.INFO):
        shutdown.on_signal(signal.SIGUSR1)
        shutdown.on_signal(signal.SIGTERM)
    assert shutdown.started and shutdown.requested.is_set() and shutdown.keep_models
    assert "SIGTERM ignored: already shutting down (keeping the models)" in caplog.text
    shutdown = Shutdown(keep_models=False)
    shutdown.on_signal(signal.SIGTERM)
    assert shutdown.started and not shutdown.keep_models
