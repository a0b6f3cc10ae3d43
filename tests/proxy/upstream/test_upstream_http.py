"""The data path's own HTTP client to replicas (proxy/upstream/client.py), over real
loopback HTTP: an aiohttp server for what a replica answers, a bare asyncio server for what only a
misbehaving one does (close-framed bodies, cut-off answers)."""
from __future__ import annotations

import ast
import asyncio
import contextlib
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from helpers import free_port
from proxy.upstream import client as upstream_http, connection as upstream_connection
from proxy.upstream.client import SENDING, Send, UpstreamHttp
from proxy.upstream.connection import HIGH_WATER

NO_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5)
JSON = {"Content-Type": "application/json"}


class Replica:
    """An aiohttp app on a loopback port: /echo answers what it was sent, /sse a stream of
    `n` events, /big `size` bytes; every request's client port (one per connection) is noted."""

    def __init__(self) -> None:
        self.peers: list[int] = []
        self.headers: list[dict[str, str]] = []

    async def echo(self, request: web.Request) -> web.StreamResponse:
        self._note(request)
        return web.Response(body=await request.read(), content_type="application/json")

    async def sse(self, request: web.Request) -> web.StreamResponse:
        self._note(request)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(int(request.query.get("n", "3"))):
            await out.write(b"data: {\"i\": %d}\n\n" % i)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def big(self, request: web.Request) -> web.StreamResponse:
        self._note(request)
        return web.Response(body=b"x" * int(request.query["size"]), content_type="application/octet-stream")

    def _note(self, request: web.Request) -> None:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.peers.append(peer[1] if peer else 0)
        self.headers.append(dict(request.headers))


@pytest.fixture
async def replica() -> AsyncIterator[tuple[Replica, str]]:
    server = Replica()
    app = web.Application()
    for path in ("echo", "sse", "big"):
        app.router.add_post(f"/{path}", getattr(server, path))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield server, f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


@pytest.fixture
async def client() -> AsyncIterator[UpstreamHttp]:
    async with UpstreamHttp(aiohttp.ClientSession()) as http:
        yield http


@contextlib.asynccontextmanager
async def raw_server(answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
                     ) -> AsyncIterator[str]:
    """A bare asyncio server that reads a request's head and body and then runs `answer`."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        try:
            await answer(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_answers_come_back_whole_on_one_kept_alive_connection(replica, client: UpstreamHttp) -> None:
    server, url = replica
    for i in range(3):
        resp = await client.post(url + "/echo", data=b'{"n": %d}' % i, headers=JSON, timeout=NO_TIMEOUT)
        async with resp:
            assert resp.status == 200 and resp.headers["content-type"].startswith("application/json")
            assert resp.content_length == 8
            assert await resp.read() == b'{"n": %d}' % i
    assert len(set(server.peers)) == 1 and len(server.peers) == 3


async def test_a_stream_arrives_in_pieces_and_by_lines(replica, client: UpstreamHttp) -> None:
    _, url = replica
    resp = await client.post(url + "/sse?n=2", data=b"{}", headers=JSON, timeout=NO_TIMEOUT)
    async with resp:
        assert resp.headers.get("Transfer-Encoding") == "chunked"
        lines = []
        while line := await resp.content.readline():
            lines.append(line)
    assert [line for line in lines if line.strip()] == [b'data: {"i": 0}\n', b'data: {"i": 1}\n', b"data: [DONE]\n"]
    resp = await client.post(url + "/sse?n=50", data=b"{}", headers=JSON, timeout=NO_TIMEOUT)
    async with resp:
        body = b""
        while chunk := await resp.content.readany():
            body += chunk
    assert body.count(b"data: ") == 51 and body.endswith(b"data: [DONE]\n\n")


async def test_a_send_on_a_pooled_connection_is_noted_as_reused(replica, client: UpstreamHttp) -> None:
    _, url = replica
    reused = []
    for _ in range(2):
        send = Send()
        token = SENDING.set(send)
        try:
            async with await client.post(url + "/echo", data=b"{}", headers=JSON, timeout=NO_TIMEOUT) as resp:
                await resp.read()
        finally:
            SENDING.reset(token)
        reused.append(send.reused)
    assert reused == [False, True]


async def test_connection_close_is_not_pooled_and_the_request_headers_go_as_given(replica, client: UpstreamHttp) -> None:
    server, url = replica
    for _ in range(2):
        async with await client.post(url + "/echo", data=b"{}", timeout=NO_TIMEOUT,
                                     headers={**JSON, "Connection": "close", "Authorization": "Bearer k"}) as resp:
            await resp.read()
    assert len(set(server.peers)) == 2
    assert server.headers[0]["Authorization"] == "Bearer k" and server.headers[0]["Connection"] == "close"
    assert server.headers[0]["Host"] == url.removeprefix("http://")


async def test_a_header_with_a_line_break_is_refused_before_anything_is_sent(replica, client: UpstreamHttp) -> None:
    server, url = replica
    with pytest.raises(ValueError):
        await client.post(url + "/echo", data=b"{}", headers={"X-Request-Id": "a\r\nX-Evil: 1"}, timeout=NO_TIMEOUT)
    assert server.peers == []


async def test_a_refused_connection_is_aiohttps_connector_error(client: UpstreamHttp) -> None:
    with pytest.raises(aiohttp.ClientConnectorError) as caught:
        await client.post(f"http://127.0.0.1:{free_port()}/echo", data=b"{}", headers=JSON, timeout=NO_TIMEOUT)
    assert isinstance(caught.value.os_error, ConnectionRefusedError)


class Stall:
    """A replica that reads a request and answers nothing; `left` is set once its client closes
    the connection (the replica would then stop working on it)."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.left = asyncio.Event()

    async def __call__(self, reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        self.asked.set()
        await reader.read()   # b"" once the client closed
        self.left.set()


async def test_sock_read_bounds_the_wait_for_the_answer(client: UpstreamHttp) -> None:
    stall = Stall()
    async with raw_server(stall) as url:
        with pytest.raises(aiohttp.SocketTimeoutError):
            await client.post(url + "/x", data=b"{}", headers=JSON, timeout=aiohttp.ClientTimeout(total=None, sock_read=0.1))
        await stall.left.wait()   # the connection was closed


async def test_total_bounds_the_whole_answer(client: UpstreamHttp) -> None:
    stall = Stall()
    async with raw_server(stall) as url:
        with pytest.raises(asyncio.TimeoutError):
            await client.post(url + "/x", data=b"{}", headers=JSON, timeout=aiohttp.ClientTimeout(total=0.1))
        await stall.left.wait()


async def test_a_cancelled_send_closes_its_connection(client: UpstreamHttp) -> None:
    stall = Stall()
    async with raw_server(stall) as url:
        send = asyncio.ensure_future(client.post(url + "/x", data=b"{}", headers=JSON, timeout=NO_TIMEOUT))
        await stall.asked.wait()
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        await stall.left.wait()


async def test_leaving_an_unread_stream_closes_its_connection_and_the_next_send_opens_one(replica, client) -> None:
    server, url = replica
    resp = await client.post(url + "/big?size=%d" % (4 * HIGH_WATER), data=b"{}", headers=JSON, timeout=NO_TIMEOUT)
    assert len(await resp.content.readany()) > 0
    await resp.__aexit__(None, None, None)
    assert resp.closed
    async with await client.post(url + "/echo", data=b"{}", headers=JSON, timeout=NO_TIMEOUT) as resp:
        assert await resp.read() == b"{}"
    assert len(set(server.peers)) == 2


async def test_a_big_answer_read_slowly_comes_back_whole(replica, client: UpstreamHttp) -> None:
    # Past HIGH_WATER unread bytes the socket is paused, and read again as the reader catches up.
    server, url = replica
    size = 8 * HIGH_WATER
    async with await client.post(url + f"/big?size={size}", data=b"{}", headers=JSON, timeout=NO_TIMEOUT) as resp:
        async def paused() -> None:
            while not resp.paused:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(paused(), 5)
        assert len(await resp.read()) == size
    # Its connection is read again once the answer ended, paused or not, and carries the next one.
    async with await client.post(url + "/echo", data=b"{}", headers=JSON, timeout=NO_TIMEOUT) as resp:
        assert await asyncio.wait_for(resp.read(), 5) == b"{}"
    assert len(set(server.peers)) == 1


async def test_a_body_framed_by_the_close_ends_with_it(client: UpstreamHttp) -> None:
    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: a\n\ndata: [DONE]\n\n")
        await writer.drain()

    async with raw_server(answer) as url:
        async with await client.post(url + "/x", data=b"{}", headers=JSON, timeout=NO_TIMEOUT) as resp:
            assert resp.content_length is None
            assert await resp.read() == b"data: a\n\ndata: [DONE]\n\n"


async def test_an_answer_cut_off_is_a_payload_error_and_no_answer_a_disconnect(client: UpstreamHttp) -> None:
    async def cut(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
        await writer.drain()

    async def nothing(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pass

    async with raw_server(cut) as url:
        resp = await client.post(url + "/x", data=b"{}", headers=JSON, timeout=NO_TIMEOUT)
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    async with raw_server(nothing) as url:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await client.post(url + "/x", data=b"{}", headers=JSON, timeout=NO_TIMEOUT)


async def test_a_malformed_answer_is_a_connection_error(client: UpstreamHttp) -> None:
    async def garbage(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)   # held open: the error is the parser's, not the close's

    async with raw_server(garbage) as url:
        with pytest.raises(aiohttp.ClientConnectionError, match="malformed"):
            await client.post(url + "/x", data=b"{}", headers=JSON, timeout=NO_TIMEOUT)


async def test_what_it_does_not_do_itself_goes_to_its_aiohttp_session(replica, client: UpstreamHttp) -> None:
    server, url = replica
    form = aiohttp.FormData()
    form.add_field("purpose", "x")
    async with await client.post(url + "/echo", data=form, headers={}, timeout=NO_TIMEOUT) as resp:
        assert isinstance(resp, aiohttp.ClientResponse) and await resp.read() == b"purpose=x"


def test_it_names_only_what_aiohttp_exports() -> None:
    # aiohttp's inner modules and underscored names change between releases, and setup.cfg puts no
    # upper bound on aiohttp: the client stays on the public API (issue 28).
    trees = [ast.parse(Path(m.__file__).read_text()) for m in (upstream_http, upstream_connection)]
    named = [(node.module, alias.name) for tree in trees for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and (node.module or "").startswith("aiohttp") for alias in node.names]
    assert all(module == "aiohttp" and not name.startswith("_") for module, name in named), named
