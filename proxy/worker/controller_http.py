"""A worker's HTTP client to its controller's Unix socket: the pooled keep-alive connections and
the httptools parser of the sends to replicas (proxy/upstream/connection.py), over that socket.

Why not aiohttp's ClientSession, which the worker keeps for the rest: per request it builds a
ClientRequest, yarl URLs, a cookie jar's look and the connector's bookkeeping: this client took
0.07 ms (JSON) to 0.26 ms (a 40-event stream) off a worker's CPU per request
(tests/bench/bench_proxy_overhead.py, `llm-pool w2`). It sends a request whose body the worker
has read whole, in one write, and reads the answer as aiohttp's reads (`status`, `headers`,
`content.readany()`, `close()`).
"""
from __future__ import annotations

import asyncio

import aiohttp

from proxy.upstream.client import CLOSED_UNDER_US, take_idle
from proxy.upstream.connection import Connection, UpstreamAnswer

# The controller answers when it answers (a request may wait in a fair queue for minutes): its own
# timeouts end what must end, as they do for a client connected to it.
NO_TIMEOUT = aiohttp.ClientTimeout(total=None)
# What this client sends; the rest (HEAD, whose answer has no body to read, OPTIONS, a body
# streamed on) goes through aiohttp's session.
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})


class ControllerHttp:
    def __init__(self, path: str) -> None:
        self.path = path
        self.closed = False
        self._idle: list[Connection] = []

    async def send(self, method: str, target: str, headers: list[tuple[str, str]],
                   body: bytes | None) -> UpstreamAnswer:
        """The controller's answer (its head read) to `method` `target` (the client's raw path and
        query, as its request line held them) with `headers` (the client's, its Host among them: the
        controller checks it) and `body` (None: no body)."""
        lines = "".join([f"{name}: {value}\r\n" for name, value in headers])
        if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):   # one of each per line
            raise ValueError("a header holds a line break")
        # surrogateescape: a header the worker read as undecodable bytes goes on as those bytes
        head = f"{method} {target} HTTP/1.1\r\n{lines}".encode("utf-8", "surrogateescape")
        message = head + (b"\r\n" if body is None else b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        conn = take_idle(self._idle, asyncio.get_running_loop().time())
        if conn is not None:
            try:
                return await self._exchange(conn, message)
            except CLOSED_UNDER_US:
                # The controller closed this kept-alive connection as the request went out (its keep-
                # alive timeout, a reload): the request never reached it. Once more, on a new one.
                pass
        return await self._exchange(await self._connect(), message)

    async def _exchange(self, conn: Connection, message: bytes) -> UpstreamAnswer:
        answer = UpstreamAnswer(conn, asyncio.get_running_loop(), NO_TIMEOUT, keep=not self.closed)
        conn.transport.write(message)
        try:
            return await answer.head()
        except BaseException:
            answer.close()   # the client left: closing the connection ends the request in the controller
            raise

    def keep(self, conn: Connection) -> None:
        """A connection whose answer ended, kept for the next request (Connection's pool)."""
        self._idle.append(conn)

    async def _connect(self) -> Connection:
        try:
            _, conn = await asyncio.get_running_loop().create_unix_connection(
                lambda: Connection(self, (self.path, 0)), self.path)
        except OSError as exc:
            raise aiohttp.ClientConnectionError(f"cannot reach the controller at {self.path}: {exc}") from exc
        return conn

    def close(self) -> None:
        self.closed = True   # an answer that ends from now on closes its connection
        for conn in self._idle:
            conn.close()
        self._idle.clear()
