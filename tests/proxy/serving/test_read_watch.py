"""The limits on a response's reads (relay.ReadWatch, one timer per response): the first read within
first_byte_timeout_s, each next one within stream_idle_timeout_s, and the time the relay spends
between reads (writing to a slow client) never counted. A real aiohttp server on port 0 streams."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from proxy.errors import BackendTimeout
from proxy.edge.relay import Timeouts, read_capped, stream_watch

# Bounds the tests' own waits: a watch that never fires fails them instead of hanging.
TEST_LIMIT_S = 10


async def chunks(resp: Any, timeouts: Timeouts, label: str) -> AsyncIterator[bytes]:
    """A stream's reads as the relay's first ones are watched (forward._relay)."""
    watch = stream_watch(resp, timeouts, label)
    try:
        while chunk := await _read(watch, resp):
            yield chunk
    finally:
        watch.close()


async def _read(watch: Any, resp: Any) -> bytes:
    with watch:
        return await resp.content.readany()


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    release = asyncio.Event()   # never set: a stalled answer stays stalled until the test ends

    async def stream(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if request.path == "/silent":
            await release.wait()
        for i in range(3):
            await out.write(b"data: %d\n\n" % i)
            if request.path == "/paced":
                await asyncio.sleep(0.05)   # chunks a read apart, as an engine makes them
        if request.path == "/stall":
            await release.wait()
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_get("/{tail:.*}", stream)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    await runner.cleanup()


async def test_time_between_reads_does_not_count(upstream: str) -> None:
    got = b""
    async with aiohttp.ClientSession() as http, http.get(upstream + "/paced") as resp:
        async with asyncio.timeout(TEST_LIMIT_S):
            async for chunk in chunks(resp, Timeouts(first_byte_s=0.1, idle_s=0.1), "replica 0"):
                got += chunk
                await asyncio.sleep(0.3)   # a slow client: three times the idle limit between reads
    assert got == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_a_stream_that_goes_silent_ends_after_the_idle_limit_not_the_first_byte_one(upstream: str) -> None:
    async with aiohttp.ClientSession() as http, http.get(upstream + "/stall") as resp:
        with pytest.raises(BackendTimeout) as info:
            async with asyncio.timeout(TEST_LIMIT_S):   # first_byte_s would be far later
                async for _chunk in chunks(resp, Timeouts(first_byte_s=600, idle_s=0.2), "replica 0"):
                    pass
        assert resp.closed   # closing the connection is what stops the backend
    assert "stream_idle_timeout_s" in info.value.message and info.value.status == 504


async def test_no_first_byte_in_time_names_first_byte_timeout_s(upstream: str) -> None:
    async with aiohttp.ClientSession() as http, http.get(upstream + "/silent") as resp:
        with pytest.raises(BackendTimeout) as info:
            async with asyncio.timeout(TEST_LIMIT_S):
                async for _chunk in chunks(resp, Timeouts(first_byte_s=0.2, idle_s=600), "replica 0"):
                    pass
    assert "first_byte_timeout_s" in info.value.message


async def test_a_whole_answer_that_stalls_ends_after_the_idle_limit(upstream: str) -> None:
    async with aiohttp.ClientSession() as http, http.get(upstream + "/stall") as resp:
        with pytest.raises(BackendTimeout) as info:
            async with asyncio.timeout(TEST_LIMIT_S):
                await read_capped(resp, Timeouts(first_byte_s=600, idle_s=0.2), 1 << 20, "replica 0")
    assert "stream_idle_timeout_s" in info.value.message
