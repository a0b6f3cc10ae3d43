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
from proxy.serving.shutdown import SHUTDOWN, STOP_SIGNALS, Shutdown, close_after_handover, shutdown_middleware


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
    app.on_response_prepare.append(close_after_handover)
    app.router.add_post("/held", held)
    app.router.add_post("/v1/admin/models/x/load", quick)
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


def test_a_stop_signal_stops_once_and_a_later_one_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    shutdown = Shutdown(keep_models=True)
    with caplog.at_level(logging.INFO):
        shutdown.on_signal(signal.SIGINT)
        shutdown.on_signal(signal.SIGTERM)
    assert shutdown.started and shutdown.requested.is_set() and shutdown.keep_models
    assert "SIGTERM ignored: already shutting down (keeping the models)" in caplog.text
    shutdown = Shutdown(keep_models=False)
    shutdown.on_signal(signal.SIGTERM)
    assert shutdown.started and not shutdown.keep_models
    # SIGUSR1 is a reload now (proxy/serving/reload.py), not a way to stop.
    assert signal.SIGUSR1 not in STOP_SIGNALS


def test_a_successor_keeps_the_models_until_it_took_over() -> None:
    shutdown = Shutdown(keep_models=False, successor=True)
    assert shutdown.keep_models        # stopped before the handover, it leaves them to its predecessor
    shutdown.took_over()
    assert not shutdown.keep_models    # then a stop unloads them, as for any proxy


async def test_handed_over_it_answers_work_with_connection_close_and_refuses_admin_actions(served: Served) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(served.url + "/work") as resp:
            assert resp.status == 200 and resp.headers.get("Connection") != "close"
        served.shutdown.hand_over()
        assert served.shutdown.keep_models and not served.shutdown.started
        # Work is answered as usual (the successor serves the same port), and the connection ends
        # with it, so that the client's next request opens one the successor accepts.
        async with session.post(served.url + "/work") as resp:
            assert (resp.status, resp.headers["Connection"]) == (200, "close")
        async with session.get(served.url + "/view") as resp:
            assert (resp.status, resp.headers["Connection"]) == (200, "close")
        # An admin's action is the successor's to take: this process changes nothing any more.
        async with session.post(served.url + "/v1/admin/models/x/load") as resp:
            body = await resp.json()
            assert (resp.status, body["error"]["code"], resp.headers["Connection"]) == (503, "shutting_down", "close")
            assert "reloaded" in body["error"]["message"] and resp.headers["Retry-After"] == "1"
        served.shutdown.on_signal(signal.SIGTERM)
        assert not served.shutdown.started   # its models are the successor's: a stop signal changes nothing


def test_a_stop_signal_before_a_successor_took_over_refuses_nothing_and_leaves_the_models() -> None:
    shutdown = Shutdown(keep_models=False, successor=True)
    shutdown.on_signal(signal.SIGTERM)
    # Its predecessor still serves: it ends as a handed-over process (no 503s, models kept).
    assert shutdown.handed_over and not shutdown.started and shutdown.keep_models
    shutdown = Shutdown(keep_models=False, successor=True)
    shutdown.on_signal(signal.SIGTERM)
    shutdown.took_over()      # handed the service just then: the signal was a stop of the proxy
    assert shutdown.started and not shutdown.handed_over and not shutdown.keep_models
