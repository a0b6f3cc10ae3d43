"""What the shim tests share: an engine served by the shim core on a loopback port."""
from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from helpers import until_healthy
from shims.core import create_app


@pytest.fixture
async def shim_server() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Serve an engine with `create_app`, as its shim process would, and return its base URL;
    with `healthy` (the default), once its /health answers 200. Every server is closed after the test."""
    servers: list[TestServer] = []

    async def start(engine: Any, healthy: bool = True) -> str:
        # handler_cancellation as in production: a client that leaves cancels its generation.
        server = TestServer(create_app(engine, exit_on_load_failure=False), handler_cancellation=True)
        await server.start_server()
        servers.append(server)
        url = str(server.make_url(""))
        if healthy:
            async with aiohttp.ClientSession() as s:
                await until_healthy(s, url)
        return url

    yield start
    for server in servers:
        await server.close()
