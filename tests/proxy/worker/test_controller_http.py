"""A worker's client to its controller (proxy/worker/controller_http.py) against a real aiohttp
server on a Unix socket, as the controller's private socket is."""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from proxy.worker.controller_http import ControllerHttp


class Controller:
    """An aiohttp app on a Unix socket that records what it got and how each request ended."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.peers: set[int] = set()          # the client connections' ids (a reused one repeats)
        self.cancelled = asyncio.Event()      # a handler whose client went away
        self.release = asyncio.Event()
        self.arrived = asyncio.Event()        # a request was read

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        self.peers.add(id(request.transport))
        body = await request.read()
        self.seen.append((request.method, request.raw_path, dict(request.headers), body))
        self.arrived.set()
        if request.path == "/wait":
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path == "/stream":
            stream = web.StreamResponse(headers={"X-Name": "café"})
            await stream.prepare(request)
            for part in (b"data: 1\n\n", b"data: 2\n\n"):
                await stream.write(part)
            await stream.write_eof()
            return stream
        return web.json_response({"got": len(body)}, headers={"X-Name": "café"})


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Controller, str, web.AppRunner]]:
    controller = Controller()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", controller.handle)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    path = str(tmp_path / "http.sock")
    await web.UnixSite(runner, path).start()
    try:
        yield controller, path, runner
    finally:
        controller.release.set()
        await runner.cleanup()


async def test_a_request_goes_as_the_client_sent_it_and_its_answer_reads_as_aiohttps(served) -> None:
    controller, path, _ = served
    http = ControllerHttp(path)
    answer = await http.send("POST", "/v1/chat/completions?x=%20y", [("Host", "pool.example:8000"),
                                                                       ("Content-Type", "application/json")], b'{"a":1}')
    assert answer.status == 200
    assert await answer.read() == b'{"got": 7}'
    # The parser's Latin-1 is the worker's to turn back (app._header_value): the bytes are the UTF-8 ones.
    assert answer.headers["X-Name"].encode("latin-1").decode() == "café"
    method, target, headers, body = controller.seen[0]
    assert (method, target, body) == ("POST", "/v1/chat/completions?x=%20y", b'{"a":1}')
    assert headers["Host"] == "pool.example:8000" and headers["Content-Length"] == "7"
    http.close()


async def test_a_get_has_no_body_and_the_connection_is_kept_for_the_next(served) -> None:
    controller, path, _ = served
    http = ControllerHttp(path)
    for _ in range(3):
        answer = await http.send("GET", "/v1/models", [("Host", "localhost")], None)
        assert await answer.read() == b'{"got": 0}'
    assert "Content-Length" not in controller.seen[0][2]
    assert len(controller.peers) == 1   # one connection carried the three
    http.close()


async def test_a_streamed_answer_reads_chunk_by_chunk_to_its_end(served) -> None:
    _, path, _ = served
    http = ControllerHttp(path)
    answer = await http.send("POST", "/stream", [("Host", "localhost")], b"{}")
    assert answer.content_length is None
    chunks = []
    while chunk := await answer.content.readany():
        chunks.append(chunk)
    assert b"".join(chunks) == b"data: 1\n\ndata: 2\n\n"
    http.close()


async def test_a_kept_connection_the_controller_closed_is_replaced_without_failing_the_request(served) -> None:
    controller, path, runner = served
    http = ControllerHttp(path)
    assert await (await http.send("GET", "/a", [("Host", "localhost")], None)).read()
    # The controller drops its idle connection (its keep-alive timeout, a reload); the client has
    # not seen the close yet when it sends the next request on it (no await between the two).
    assert runner.server is not None and len(runner.server.connections) == 1
    runner.server.connections[0].force_close()
    answer = await http.send("GET", "/b", [("Host", "localhost")], None)
    assert answer.status == 200 and await answer.read() == b'{"got": 0}'
    assert [seen[1] for seen in controller.seen] == ["/a", "/b"]
    http.close()


async def test_a_client_that_leaves_ends_the_request_in_the_controller(served) -> None:
    controller, path, _ = served
    http = ControllerHttp(path)
    waiting = asyncio.ensure_future(http.send("POST", "/wait", [("Host", "localhost")], b"{}"))
    await asyncio.wait_for(controller.arrived.wait(), 10)
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    await asyncio.wait_for(controller.cancelled.wait(), 10)
    http.close()


async def test_a_header_with_a_line_break_is_never_written(served) -> None:
    controller, path, _ = served
    http = ControllerHttp(path)
    with pytest.raises(ValueError):
        await http.send("GET", "/", [("X-Evil", "a\r\nX-Injected: 1")], None)
    assert controller.seen == []
    http.close()


async def test_no_controller_is_a_client_connection_error(tmp_path: Path) -> None:
    http = ControllerHttp(str(tmp_path / "none.sock"))
    with pytest.raises(aiohttp.ClientConnectionError):
        await http.send("GET", "/", [("Host", "localhost")], None)
