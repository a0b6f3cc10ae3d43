"""A replica's bytes are not trusted (issue 28, items 4, 5 and 12): the proxy's client to replicas
(proxy/upstream/client.py) and the data path over it, against a hostile replica.

`Hostile` is a real server on loopback port 0 (asyncio.start_server) that answers each request with
whatever bytes its test scripts: interim 1xx answers, answers nobody asked for, header floods,
invalid headers, a body that trickles, bad chunking. The client is driven directly, and through the
proxy's own routes (the app's upstream_session) for a program replica and for a plain-http
`openai_remote` provider. Nothing here counts on timing: where a hostile answer once made a request
hang, the test client's total timeout only turns that hang into a failure."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from fakes import FakeSupervisor
from in_process import in_rotation, serve_routes
from launchers import llama_server
from proxy.config.loading import load_settings
from proxy.lifecycle.pool import Pool
from proxy.upstream.reach import ProgramReach
from proxy.lifecycle.kinds.remote import RemoteReach
from proxy.lifecycle.state.replicas import Replica
from proxy.upstream.client import UpstreamHttp
from proxy.upstream.connection import MAX_FIELD, MAX_HEAD, MAX_HEADERS, MalformedAnswer
from proxy.serving.forward import upstream_session

# Only a hang guard, for clients and the proxy's client alike: what the proxy did with some of
# these answers was to wait forever.
HANG_GUARD = aiohttp.ClientTimeout(total=30)
JSON = {"Content-Type": "application/json"}


@dataclass
class Exchange:
    """One request the hostile replica read: on which of its connections (1, 2, ...), its body, and
    the connection's two ends for the script to answer on."""

    connection: int
    body: bytes
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


Script = Callable[[Exchange], Awaitable[None]]


class Hostile:
    """A misbehaving replica on a loopback port: reads requests one after another on each
    connection and answers each with `script`, which writes what it likes (and may close). Notes
    each request (`requests`: connection, body) and each connection its client closed (`left`)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[tuple[int, bytes]] = []
        self.connections = 0
        self.left: set[int] = set()
        self.gone = asyncio.Event()   # set whenever a client closes a connection
        self.url = ""
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> "Hostile":
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        self._open.add(writer)
        try:
            while not writer.is_closing():
                body = await read_request(reader)
                if body is None:
                    self.left.add(number)   # the client closed it
                    self.gone.set()
                    return
                self.requests.append((number, body))
                await self.script(Exchange(number, body, reader, writer))
        except ConnectionError:
            self.left.add(number)
            self.gone.set()
        finally:
            self._open.discard(writer)
            writer.close()

    async def closed_by_client(self, connection: int) -> None:
        async with asyncio.timeout(HANG_GUARD.total):   # a hang guard too
            while connection not in self.left:
                self.gone.clear()
                await self.gone.wait()


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return await reader.readexactly(length)


def answer(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (status, len(body), extra, body))


def chat_answer(text: str) -> bytes:
    return answer(json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}).encode())


def echo(x: Exchange) -> bytes:
    return answer(b'{"echo": %s}' % x.body)


async def echo_script(x: Exchange) -> None:
    await send(x, echo(x))


async def send(x: Exchange, *parts: bytes) -> None:
    """Each part in a write (and a TCP segment) of its own: each reaches the client's parser alone."""
    for part in parts:
        x.writer.write(part)
        await x.writer.drain()


@pytest.fixture
async def client() -> AsyncIterator[UpstreamHttp]:
    async with UpstreamHttp(aiohttp.ClientSession()) as http:
        yield http


async def post(client: UpstreamHttp, url: str, body: bytes = b"{}",
               timeout: aiohttp.ClientTimeout = HANG_GUARD) -> tuple[int, bytes]:
    async with await client.post(url + "/v1/x", data=body, headers=JSON, timeout=timeout) as resp:
        return resp.status, await resp.read()


# -- Item 4: interim answers, and answers nobody asked for ------------------------------------------

INTERIMS = (b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 102 Processing\r\n\r\n",
            b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")


@pytest.mark.parametrize("segments", ["apart", "together"])
async def test_interim_answers_are_read_past_and_the_connection_then_carries_the_next(client, segments) -> None:
    async def script(x: Exchange) -> None:
        if segments == "apart":
            await send(x, *INTERIMS, echo(x))
        else:
            await send(x, b"".join(INTERIMS) + echo(x))

    async with Hostile(script) as replica:
        assert await post(client, replica.url, b'{"n": 1}') == (200, b'{"echo": {"n": 1}}')
        assert await post(client, replica.url, b'{"n": 2}') == (200, b'{"echo": {"n": 2}}')
    assert [c for c, _ in replica.requests] == [1, 1]   # kept alive, in step


@pytest.mark.parametrize("status", [b"101 Switching Protocols", b"099 Weird"])
async def test_a_101_or_a_status_below_100_is_refused_and_its_connection_closed(client, status) -> None:
    async def script(x: Exchange) -> None:
        await send(x, b"HTTP/1.1 %s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n" % status)

    async with Hostile(script) as replica:
        with pytest.raises(MalformedAnswer, match="status"):
            await post(client, replica.url)
        await replica.closed_by_client(1)


@pytest.mark.parametrize("when", ["start of one in the same segment", "one whole in the same segment", "later"])
async def test_an_answer_nobody_asked_for_never_reaches_the_next_request(client, when) -> None:
    extra = answer(b'"nobody asked"')
    first_read = asyncio.Event()

    async def script(x: Exchange) -> None:
        if x.connection > 1:
            await send(x, echo(x))
        elif when == "start of one in the same segment":
            await send(x, echo(x) + extra[:17])
            # Only a client that kept this connection sends its next request here: it then gets the rest.
            if await read_request(x.reader) is not None:
                await send(x, extra[17:])
        elif when == "one whole in the same segment":
            await send(x, echo(x) + extra)
        else:
            await send(x, echo(x))
            await first_read.wait()
            await send(x, extra)

    async with Hostile(script) as replica:
        assert await post(client, replica.url, b'{"n": 1}') == (200, b'{"echo": {"n": 1}}')
        if when == "later":
            first_read.set()
            await replica.closed_by_client(1)   # it arrived while the connection was idle
        assert await post(client, replica.url, b'{"n": 2}') == (200, b'{"echo": {"n": 2}}')
        assert [c for c, _ in replica.requests] == [1, 2]
        await replica.closed_by_client(1)   # the client dropped the connection that spoke out of turn


# -- Item 5: the head is bounded as aiohttp bounds its own ------------------------------------------

async def endless_line(x: Exchange) -> None:
    x.writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
    for _ in range(4 * MAX_HEAD // 65536):   # far past the bound, and then silence
        x.writer.write(b"a" * 65536)
        await x.writer.drain()
    await x.reader.read()


FLOODS = {
    "many headers": (b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-Flood-%d: v\r\n" % i for i in range(10_000))
                     + b"Content-Length: 2\r\n\r\n{}", f"more than {MAX_HEADERS} headers"),
    "a long header": (b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * (MAX_FIELD + 1) + b"\r\nContent-Length: 2\r\n\r\n{}",
                      f"a header of more than {MAX_FIELD} bytes"),
    "endless interim answers": (INTERIMS[2] * (2 * MAX_HEAD // len(INTERIMS[2])) + answer(b"{}"),
                                f"a head of more than {MAX_HEAD} bytes"),
}


@pytest.mark.parametrize("flood", [*FLOODS, "a header line that never ends"])
async def test_a_header_flood_fails_the_answer_once_past_the_bound(client, flood) -> None:
    async def script(x: Exchange) -> None:
        if flood in FLOODS:
            await send(x, FLOODS[flood][0])
        else:
            await endless_line(x)

    why = FLOODS[flood][1] if flood in FLOODS else f"a head of more than {MAX_HEAD} bytes"
    async with Hostile(script) as replica:
        with pytest.raises(MalformedAnswer, match=why):
            await post(client, replica.url)
        await replica.closed_by_client(1)


async def test_a_head_within_the_bounds_is_taken_whole(client) -> None:
    lines = b"".join(b"X-H-%d: %s\r\n" % (i, b"v" * (MAX_FIELD - 9)) for i in range(MAX_HEADERS - 2))

    async def script(x: Exchange) -> None:
        await send(x, INTERIMS[2] + b"HTTP/1.1 200 OK\r\n" + lines + b"Content-Length: 2\r\n\r\n{}")

    async with Hostile(script) as replica:
        async with await client.post(replica.url + "/v1/x", data=b"{}", headers=JSON, timeout=HANG_GUARD) as resp:
            assert resp.status == 200 and len(resp.headers) == MAX_HEADERS - 1 and await resp.read() == b"{}"


# llhttp, in the strict mode httptools runs it in, refuses what uvicorn's HEADER_RE and
# HEADER_VALUE_RE refuse: a name that is not a token, a value with a control character.
BAD_HEADERS = [b"Bad Name: x", b"Bad(: x", b"X\x00: y", b": empty", b"X: a\x00b", b"X: a\x01b", b"X: a\x7fb",
               b"X: a\rb", b"X: a\nInjected: b", b"X: a\r\n folded"]


@pytest.mark.parametrize("line", BAD_HEADERS)
async def test_an_invalid_header_name_or_value_is_refused(client, line) -> None:
    async def script(x: Exchange) -> None:
        await send(x, b"HTTP/1.1 200 OK\r\n" + line + b"\r\nContent-Length: 2\r\n\r\n{}")

    async with Hostile(script) as replica:
        with pytest.raises(MalformedAnswer):
            await post(client, replica.url)
        await replica.closed_by_client(1)


@pytest.mark.parametrize("chunks", [b"zz\r\nhi\r\n0\r\n\r\n", b"2\r\nhi there\r\n0\r\n\r\n", b"-2\r\nhi\r\n0\r\n\r\n",
                                    b"ffffffffffffffffff\r\nhi\r\n0\r\n\r\n"])
async def test_bad_chunking_breaks_the_answer(client, chunks) -> None:
    async def script(x: Exchange) -> None:
        await send(x, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)

    async with Hostile(script) as replica:
        with pytest.raises(aiohttp.ClientPayloadError, match="malformed"):
            await post(client, replica.url)
        await replica.closed_by_client(1)


async def test_a_refused_connection_is_the_error_aiohttp_raises_for_it(client) -> None:
    async with Hostile(echo_script) as replica:
        url = replica.url
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectorError) as theirs:
            await session.post(url + "/v1/x", data=b"{}")
    with pytest.raises(aiohttp.ClientConnectorError) as ours:
        await post(client, url)
    def seen(exc: aiohttp.ClientConnectorError) -> tuple[object, ...]:
        return type(exc.os_error), exc.host, exc.port, exc.ssl, str(exc).split(" [")[0]

    assert seen(ours.value) == seen(theirs.value)


# -- Through the proxy ----------------------------------------------------------------------------

class Proxy:
    """The proxy's public routes on a loopback port (the app's own upstream client), in front of a
    hostile replica: model `m` a program replica, model `r` a plain-http `openai_remote` provider."""

    def __init__(self, url: str, client: aiohttp.ClientSession, replica: Replica) -> None:
        self.url, self.client, self.replica = url, client, replica

    async def chat(self, content: str, model: str = "m") -> tuple[int, Any]:
        body = {"model": model, "messages": [{"role": "user", "content": content}]}
        async with self.client.post(self.url + "/v1/chat/completions", json=body,
                                    headers={"X-Allow-Remote": "true"}) as resp:
            return resp.status, await resp.json()


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Proxy]]]:
    async with contextlib.AsyncExitStack() as stack:
        async def start(script: Script, model: str = "m", **options: Any) -> tuple[Proxy, Hostile]:
            replica_server = await stack.enter_async_context(Hostile(script))
            port = replica_server.url.rsplit(":", 1)[1]
            models = {"m": {"backend": "llama_server", "model_path": str(tmp_path / "m.gguf"),
                            "llama_server_binary": "/bin/true", "target_inflight": 2},
                      "r": {"backend": "openai_remote", "remote_base_url": f"http://127.0.0.1:{port}/v1",
                            "remote_model": "theirs", "target_inflight": 2}}
            models[model].update(options)
            (tmp_path / "pool.yaml").write_text(json.dumps({"service": {"state_dir": str(tmp_path)},
                                                            "engine": {"models": models}}))
            settings = load_settings(tmp_path / "pool.yaml")
            http = await stack.enter_async_context(upstream_session())
            pool = Pool(settings, FakeSupervisor(), http, environ={})  # type: ignore[arg-type]
            if model == "m":
                spec = llama_server.launch(settings.models["m"], 0, int(port), 5, {})
                replica = Replica(model="m", index=0, spec=spec, fullname="m:r0", pid=os.getpid(),
                                  reach=ProgramReach(spec))
            else:
                replica = Replica(model="r", index=0, reach=RemoteReach(settings.models["r"], None))
            in_rotation(pool, model, [replica])
            url = await serve_routes(stack, settings, pool, http)
            client = await stack.enter_async_context(aiohttp.ClientSession(timeout=HANG_GUARD))
            return Proxy(url, client, replica), replica_server
        yield start


def content(body: Any) -> str:
    return str(body["choices"][0]["message"]["content"])


async def test_an_interim_answer_never_hands_one_request_anothers_answer(proxy) -> None:
    # A's replica sends 103 at once and its final answer only later: until it comes, A waits for
    # it, and B, sent meanwhile, goes on a connection of its own and gets its own answer.
    interim_sent, release = asyncio.Event(), asyncio.Event()

    async def script(x: Exchange) -> None:
        if b"request A" not in x.body:
            await send(x, chat_answer("answer to B"))
            return
        await send(x, INTERIMS[2])
        interim_sent.set()
        # The final answer to A goes out when the test says, or as soon as another request comes on
        # this connection: what a proxy that took the 103 as final and reused the connection sends.
        next_request = asyncio.ensure_future(x.reader.readuntil(b"\r\n\r\n"))
        released = asyncio.ensure_future(release.wait())
        await asyncio.wait({next_request, released}, return_when=asyncio.FIRST_COMPLETED)
        next_request.cancel()
        released.cancel()
        await send(x, chat_answer("answer to A"))
        x.writer.close()

    p, replica = await proxy(script)
    a = asyncio.ensure_future(p.chat("request A"))
    await interim_sent.wait()
    status_b, body_b = await p.chat("request B")
    release.set()
    status_a, body_a = await a
    assert (status_a, content(body_a)) == (200, "answer to A")
    assert (status_b, content(body_b)) == (200, "answer to B")
    assert [c for c, _ in replica.requests] == [1, 2]


async def test_a_103_from_a_provider_is_read_past(proxy) -> None:
    async def script(x: Exchange) -> None:
        await send(x, INTERIMS[2], chat_answer("from the provider"))

    p, _ = await proxy(script, model="r")
    status, body = await p.chat("hi", model="r")
    assert (status, content(body)) == (200, "from the provider")


async def test_a_header_flood_is_a_502_that_counts_against_the_replica(proxy) -> None:
    async def script(x: Exchange) -> None:
        await send(x, FLOODS["many headers"][0])

    p, replica = await proxy(script)
    status, body = await p.chat("hi")
    assert status == 502
    assert body["error"]["message"] == f"replica 0 of 'm' sent a malformed answer: more than {MAX_HEADERS} headers"
    assert p.replica.failures == 1
    await replica.closed_by_client(1)


async def test_a_malformed_answer_from_a_provider_is_a_502_not_sent_again(proxy) -> None:
    # Retries are for a provider that could not be reached or was busy; one that answered with
    # bytes that are no answer would only be asked again to do the same.
    async def script(x: Exchange) -> None:
        await send(x, FLOODS["many headers"][0])

    p, provider = await proxy(script, model="r", remote_max_retries=2)
    status, body = await p.chat("hi", model="r")
    assert status == 502
    assert body["error"]["message"] == \
        f"remote provider of 'r' sent a malformed answer: more than {MAX_HEADERS} headers"
    assert len(provider.requests) == 1


async def trickle(x: Exchange) -> None:
    """A non-streamed answer whose body comes one byte at a time, for as long as anyone reads it."""
    x.writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    while not x.reader.at_eof():
        x.writer.write(b"1\r\n \r\n")
        await x.writer.drain()
        await asyncio.sleep(0.02)


# -- Item 12: a non-streamed answer has a total bound ---------------------------------------------

@pytest.mark.parametrize("model, options, why", [
    ("m", {"first_byte_timeout_s": 0.5, "stream_idle_timeout_s": 60},
     "replica 0 of 'm' did not end its answer within 0.5s (first_byte_timeout_s)"),
    ("r", {"remote_timeout_s": 0.5}, "replica 0 of 'r' did not end its answer in time: "
     "the answer took longer than its total timeout"),
])
async def test_a_trickling_answer_is_a_504_and_its_connection_closed(proxy, model, options, why) -> None:
    p, replica = await proxy(trickle, model=model, **options)
    status, body = await p.chat("hi", model=model)
    assert (status, body["error"]["code"], body["error"]["message"]) == (504, "backend_timeout", why)
    await replica.closed_by_client(1)


# -- Issue 39, item 6: a client's mistake never counts against a replica ------------------------------

# What llama-server answers a /detokenize id past its vocabulary (measured on the pinned build).
RANGE_CHECK = (b'{"error": {"code": 500, "message": "vector::_M_range_check: __n (which is 99999) >= '
               b'this->size() (which is 333)", "type": "server_error"}}')


async def test_an_engines_500_to_input_only_it_can_judge_is_the_clients_400(proxy) -> None:
    # Model m's GGUF is not on this machine: the proxy cannot know its vocabulary, so the ids go to
    # the engine, which fails on them as llama-server does. Before: a 500 each, counted against the
    # replica (ejected after a few, from everyone).
    async def script(x: Exchange) -> None:
        await send(x, answer(RANGE_CHECK, b"500 Internal Server Error"))

    p, _ = await proxy(script)
    for path, body in [("/detokenize", {"tokens": [99999]}), ("/v1/completions", {"prompt": [99999]}),
                       ("/tokenize", {"content": "x"})] * 4:
        async with p.client.post(p.url + path, json={"model": "m", **body}) as resp:
            error = (await resp.json())["error"]
            assert (resp.status, error["type"]) == (400, "invalid_request_error"), error
            assert error["message"].startswith("replica 0 of 'm' could not take this request's input (HTTP 500): "
                                               "vector::_M_range_check")
    assert (p.replica.failures, p.replica.state.value) == (0, "ready")
    # A 500 to a request the proxy checked whole is still the replica's failure.
    status, _ = await p.chat("hi")
    assert (status, p.replica.failures) == (500, 1)
