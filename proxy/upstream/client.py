"""The data path's HTTP client to replicas: POSTs over pooled keep-alive HTTP/1.1 connections,
parsed by httptools (llhttp, the parser of Node.js and uvicorn), with aiohttp's session beside it.

Why not aiohttp's client for every send: against a fast fake upstream, aiohttp's ClientSession
costs about 200 µs of CPU per request on uvloop (a ClientRequest, yarl URLs, the cookie jar, the
connector's bookkeeping), more than the rest of the hop; this client costs a fraction of that
(tests/bench/bench_proxy_overhead.py). It does what a send to a replica needs and nothing more: a
POST of bytes to a plain-HTTP URL; Content-Length, chunked and close-framed answers; keep-alive;
the connect, read and total timeouts of aiohttp.ClientTimeout; flow control. Anything else (https,
a form, a GET) goes to the aiohttp session it holds. Its answers read as aiohttp's do (`status`,
`headers`, `content.readany()`, `close()`), and it raises aiohttp's exception classes for the same
failures, so the code that reads an answer does not tell the two apart.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import weakref
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Awaitable, Callable, Protocol
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDictProxy
from yarl import URL

from proxy.upstream.connection import Connection, UpstreamAnswer

log = logging.getLogger(__name__)

# An idle connection older than this is closed rather than reused, as aiohttp's keepalive_timeout.
KEEPALIVE_S = 15.0


class Send:
    """One request's way to a replica: whether it went out on a pooled (reused) connection, and
    the client of its second send, if it needed one (proxy/serving/forward.py)."""

    def __init__(self) -> None:
        self.reused = False
        self.second: UpstreamHttp | None = None


# The request being sent in this task. A context variable, because a replica's Reach builds the
# request itself; both clients note on it what they know of the connection they used.
SENDING: contextvars.ContextVar[Send] = contextvars.ContextVar("upstream_send")
# How a send fails on a pooled connection that the server had already closed, before any byte of
# an answer: the read meets the close, or the write or read is reset (aiohttp >= 3.10 raises its
# ClientConnectionResetError, a ConnectionResetError, for a write to a closing transport). A
# refused connection, ClientConnectorError, is a ClientOSError too but is not one of these.
CLOSED_UNDER_US = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionResetError)


async def post_retrying(send: Send, http: UpstreamHttp, post: Callable[[UpstreamHttp], Awaitable[Answer]],
                        what: str) -> Answer:
    """`post` with `http`; if that failed on a reused connection before any answer, once more on a
    new one. A server closes a kept-alive connection at its keep-alive timeout and (the pinned
    llama-server, measured) after every streamed answer; a pool can hand out such a connection
    before its close arrives, and a request written to it never reached the server. The second send
    gets a client of its own (`send.second`, closed by the caller), which never pools:
    only that is sure to open a new connection, and it is needed this rarely. A failure there is
    what it is (the caller decides). `what`: the replica, for the log."""
    token = SENDING.set(send)
    try:
        return await post(http)
    except CLOSED_UNDER_US as exc:
        if isinstance(exc, aiohttp.ClientConnectorError) or not send.reused:
            raise
        log.info("%s: a reused connection was closed under the request (%s); sending it again on a new one",
                 what, type(exc).__name__)
    finally:
        SENDING.reset(token)
    send.second = UpstreamHttp.one_off()
    return await post(send.second)


class Body(Protocol):
    """What the data path reads of an answer's body (aiohttp's StreamReader, or this module's)."""

    async def readany(self) -> bytes: ...

    async def readline(self) -> bytes: ...

    def set_exception(self, exc: BaseException) -> None: ...


class Answer(Protocol):
    """An answer from a replica, as the data path reads it: aiohttp's ClientResponse or UpstreamAnswer."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> CIMultiDictProxy[str]: ...

    @property
    def content_length(self) -> int | None: ...

    @property
    def content(self) -> Body: ...

    @property
    def closed(self) -> bool: ...

    async def read(self) -> bytes: ...

    async def text(self) -> str: ...

    def close(self) -> None: ...

    def release(self) -> Any: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None: ...


class NotingConnector(aiohttp.TCPConnector):
    """The aiohttp session's connector, noting for the request being sent whether its connection is
    one it handed out before (reused) or a new one. A connection's protocol object lives as long as
    the connection, so it tells the two apart (a TraceConfig cost a dozen events per request)."""

    def __init__(self) -> None:
        super().__init__(limit=0, limit_per_host=0)
        self._handed: weakref.WeakSet[asyncio.BaseProtocol] = weakref.WeakSet()

    # BaseConnector.connect as aiohttp documents it; its traces' and connection's classes are left
    # unnamed, since aiohttp exports neither.
    async def connect(self, req: aiohttp.ClientRequest, traces: list[Any],
                      timeout: aiohttp.ClientTimeout) -> Any:
        send = SENDING.get(None)
        if send is not None:
            send.reused = False   # what counts is the request that failed (a Reach may send several)
        conn = await super().connect(req, traces, timeout)
        protocol = conn.protocol
        # Every connection is noted, a probe's or a scrape's too: a request may reuse it next.
        if protocol is not None and protocol not in self._handed:
            self._handed.add(protocol)
        elif send is not None and protocol is not None:
            send.reused = True
        return conn


class UpstreamHttp:
    """The proxy's sends to replicas: plain-HTTP POSTs of bytes on this module's pooled connections,
    anything else on `session`, as are the GETs and DELETEs (probes, scrapes, a provider's files).
    `pooled=False`: every send on a new connection, closed after its answer (the second send of a
    request whose reused connection was closed under it)."""

    def __init__(self, session: aiohttp.ClientSession, pooled: bool = True) -> None:
        self.session = session
        self.pooled = pooled
        self.closed = False
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._targets: dict[str, tuple[str, int, bytes] | None] = {}

    @classmethod
    def one_off(cls) -> "UpstreamHttp":
        return cls(aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)), pooled=False)

    def post(self, url: str, *, data: Any, headers: dict[str, str],
             timeout: aiohttp.ClientTimeout) -> Awaitable[Answer]:
        target = self._target(url) if isinstance(data, bytes) else None
        if target is None:
            return self.session.post(url, data=data, headers=headers, timeout=timeout)
        return self._post(target, data, headers, timeout)

    def get(self, url: str, **kwargs: Any) -> AbstractAsyncContextManager[aiohttp.ClientResponse]:
        return self.session.get(url, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> AbstractAsyncContextManager[aiohttp.ClientResponse]:
        return self.session.delete(url, **kwargs)

    async def __aenter__(self) -> "UpstreamHttp":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        self.closed = True   # an answer that ends from now on closes its connection
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        await self.session.close()

    def _target(self, url: str) -> tuple[str, int, bytes] | None:
        """(host, port, the request's first two lines) of a plain-HTTP URL; None for what is left
        to aiohttp. Parsed once per URL: a replica has a few."""
        try:
            return self._targets[url]
        except KeyError:
            pass
        parts = urlsplit(url)
        target = None
        if parts.scheme == "http" and parts.hostname and not parts.username and not parts.password \
                and not _unsafe(url):
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            start = f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n".encode()
            target = (parts.hostname, parts.port or 80, start)
        if len(self._targets) > 1024:
            self._targets.clear()   # bounded, should URLs ever vary
        self._targets[url] = target
        return target

    async def _post(self, target: tuple[str, int, bytes], data: bytes, headers: dict[str, str],
                    timeout: aiohttp.ClientTimeout) -> "UpstreamAnswer":
        host, port, start = target
        lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
        if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):   # one of each per line
            raise ValueError("a header holds a line break")
        # surrogateescape: a header the server read as undecodable bytes goes on as those bytes
        head = b"%s%sContent-Length: %d\r\n\r\n" % (start, lines.encode("utf-8", "surrogateescape"), len(data))
        keep = self.pooled and headers.get("Connection", "").lower() != "close"
        loop = asyncio.get_running_loop()
        conn = self._take((host, port), loop.time())
        send = SENDING.get(None)
        if send is not None:
            send.reused = conn is not None
        if conn is None:
            conn = await self._connect(host, port, timeout, loop)
        answer = UpstreamAnswer(conn, loop, timeout, keep)
        conn.transport.write(head + data)
        try:
            return await answer.head()
        except BaseException:
            answer.close()   # timed out or the client left: closing the connection stops the backend
            raise

    def keep(self, conn: Connection) -> None:
        """A connection whose answer ended, kept for the next send to the same replica."""
        self._idle.setdefault(conn.key, []).append(conn)

    def _take(self, key: tuple[str, int], now: float) -> Connection | None:
        idle = self._idle.get(key)
        return take_idle(idle, now) if idle else None

    async def _connect(self, host: str, port: int, timeout: aiohttp.ClientTimeout,
                       loop: asyncio.AbstractEventLoop) -> Connection:
        pool = self if self.pooled else None
        try:
            async with asyncio.timeout(timeout.sock_connect or timeout.connect):
                _, conn = await loop.create_connection(lambda: Connection(pool, (host, port)), host, port)
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(f"Connection timeout to host http://{host}:{port}") from None
        except OSError as exc:
            # aiohttp's own error for it, whose key only a public ClientRequest builds (a refusal is rare)
            request = aiohttp.ClientRequest("POST", URL.build(scheme="http", host=host, port=port), loop=loop)
            raise aiohttp.ClientConnectorError(request.connection_key, exc) from exc
        return conn


def take_idle(idle: list[Connection], now: float) -> Connection | None:
    """The most recently kept of `idle` that is still open and not past KEEPALIVE_S (the others
    are closed on the way), or None."""
    while idle:
        conn = idle.pop()
        if not conn.lost and not conn.transport.is_closing() and now - conn.idle_since < KEEPALIVE_S:
            return conn
        conn.close()
    return None


def _unsafe(text: str) -> bool:
    return "\r" in text or "\n" in text
