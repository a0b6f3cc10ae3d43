"""A stream relayed by the splice (proxy/edge/splice.py): after its first piece, each piece goes
from the replica's connection to the client's in the connection's callback. Every byte arrives in
order; a client that falls behind stops the proxy reading the replica (nothing piles up in the
proxy); an HTTP/1.0 client gets the stream unframed, ended by the close; an end split between two
reads is seen. The replica is an aiohttp
server of the test's (a provider's URL, so the proxy's own client reads it), served in-process
with the proxy's routes (tests/metered.py)."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

from aiohttp import web

from metered import Metered, metered_app
from proxy.lifecycle.kinds.remote import RemoteReach
from proxy.lifecycle.kinds.remote_options import Secret
from proxy.upstream.connection import Connection

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 1000 + b'"}}]}\n\n'
EVENTS = 32 * 1024   # 32 MiB of events: more than every socket buffer between the replica and the client
DONE = b"data: [DONE]\n\n"


class Replica:
    """An engine that streams EVENTS events as fast as its client reads them; `done` once it wrote them all."""

    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for _ in range(EVENTS // 64):
            await out.write(EVENT * 64)
        await out.write(DONE)
        self.done.set()
        await out.write_eof()
        return out


@contextlib.asynccontextmanager
async def relayed(tmp_path: Path) -> AsyncIterator[tuple[Metered, Replica]]:
    replica = Replica()
    async with served(tmp_path, replica.chat) as metered:
        yield metered, replica


@contextlib.asynccontextmanager
async def served(tmp_path: Path, chat: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> AsyncIterator[Metered]:
    """The proxy's routes in front of a replica whose chat completions `chat` answers."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    config = {"backend": "openai_remote", "remote_base_url": f"http://127.0.0.1:{port}/v1", "remote_model": "e",
              "remote_api_key_env": "PROVIDER_KEY", "remote_health_check": "config_only", "target_inflight": 4}
    try:
        async with metered_app(tmp_path, "r", config, lambda c: RemoteReach(c, Secret("sk-unused"))) as metered:
            yield metered
    finally:
        await runner.cleanup()


def held() -> bool:
    """Whether a connection of the proxy's to a replica has stopped reading its socket."""
    return any(isinstance(o, Connection) and not o.lost and not o.transport.is_reading() for o in gc.get_objects())


async def test_a_client_that_falls_behind_holds_the_replica_and_then_gets_every_byte(tmp_path: Path) -> None:
    async with relayed(tmp_path) as (metered, replica):
        async with metered.client.post(metered.url + "/v1/chat/completions", headers=metered.headers(),
                                       json=metered.chat("go")) as resp:
            assert resp.status == 200
            got = bytearray(await resp.content.readany())
            # The client reads nothing more: once the buffers between are full the proxy stops
            # reading the replica, which can then never end its stream. (Without the hold the
            # proxy would take all 32 MiB into its own memory and the replica would end.)
            async with asyncio.timeout(60):   # a hang guard, not a wait to pass
                while not held() and not replica.done.is_set():
                    await asyncio.sleep(0.01)
            assert not replica.done.is_set(), "the proxy read the whole stream for a client that read none of it"
            proxy_side = metered.requests[-1].transport
            assert proxy_side is not None and proxy_side.get_write_buffer_size() < 2 * 1024 * 1024
            while chunk := await resp.content.readany():
                got += chunk
    assert bytes(got) == EVENT * EVENTS + DONE
    assert metered.seen[-1][1][2] == EVENTS   # no usage came: the events that went out are what counts


async def test_an_http_1_0_client_gets_the_stream_unframed_ended_by_the_close(tmp_path: Path) -> None:
    async with relayed(tmp_path) as (metered, _):
        host, port = metered.url.removeprefix("http://").split(":")
        body = json.dumps(metered.chat("go")).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        head = "".join(f"{k}: {v}\r\n" for k, v in metered.headers().items())
        writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n" + head.encode()
                     + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        async with asyncio.timeout(60):
            answer = await reader.read()   # to the close
        writer.close()
    head_bytes, _, stream = answer.partition(b"\r\n\r\n")
    assert head_bytes.startswith(b"HTTP/1.0 200") and b"transfer-encoding" not in head_bytes.lower()
    assert stream == EVENT * EVENTS + DONE


async def test_an_end_split_between_two_reads_is_seen(tmp_path: Path) -> None:
    go_on = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(EVENT * 3 + b"data: [DO")
        await go_on.wait()   # the client has had the first half: the proxy read it alone
        await out.write(b"NE]\n\n")
        await out.write_eof()
        return out

    async with served(tmp_path, chat) as metered:
        async with metered.client.post(metered.url + "/v1/chat/completions", headers=metered.headers(),
                                       json=metered.chat("go")) as resp:
            got = b""
            while not got.endswith(b"data: [DO"):
                got += await resp.content.readany()
            go_on.set()
            got += await resp.content.read()
        await metered.until_finished(1)
    assert got == EVENT * 3 + DONE
    assert metered.seen[-1][1][2] == 3   # three tokens: its [DONE] was seen as the end, not counted as one
