"""One keep-alive HTTP/1.1 connection to a replica and the answer read on it (httptools' callbacks).

The connection parses what arrives into the answer in flight and, when the answer ends and both
ends keep the connection, hands itself back to the client that made it (proxy/upstream/client.py,
through `KeepAlive`). The answer reads as aiohttp's ClientResponse does, raising aiohttp's
exception classes for the same failures.
"""
from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Callable, Protocol

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy

# An answer's unread bytes past which the socket is not read until the reader catches up, and the
# longest stream line readline() takes (aiohttp's own figures for both).
HIGH_WATER = 2 ** 17
LOW_WATER = 2 ** 16
MAX_LINE = 2 ** 17
# An answer's head is bounded as aiohttp's client bounds its own (ClientSession's defaults in aiohttp
# 3.14, client.py: max_line_size=8190, max_field_size=8190, max_headers=128): at most MAX_HEADERS
# headers, each name and value together at most MAX_FIELD bytes, and the bytes before the body at
# most what those allow (MAX_HEAD, every interim 1xx answer's included). httptools gathers a header
# line whole before it hands it over, so only a count of the bytes fed bounds a line that never ends.
MAX_FIELD = 8190
MAX_HEADERS = 128
MAX_HEAD = (MAX_HEADERS + 1) * (MAX_FIELD + 4)


class KeepAlive(Protocol):
    """The client a connection goes back to when its answer ends and both ends keep it."""

    closed: bool   # the client is closing: a connection whose answer ends now is closed

    def keep(self, conn: Connection) -> None: ...


class MalformedAnswer(aiohttp.ClientConnectionError):
    """A replica's bytes that are not an answer to the request sent: bad framing, a head past the
    bounds, a 101, bytes nobody asked for. Its text is the parser's or this module's, never the replica's."""


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; its text goes into MalformedAnswer."""


class Connection(asyncio.Protocol):
    """One keep-alive connection to a replica: parses what arrives into the answer in flight, and
    goes back to its client's pool (`pool`, None for a one-off) when an answer ends and both ends
    keep the connection. Interim (1xx) answers are read past; a 101, a head past MAX_HEAD and any
    byte that arrives when no answer is awaited close it, so that nothing a replica sends out of turn
    is read as the next request's answer."""

    transport: asyncio.Transport

    def __init__(self, pool: KeepAlive | None, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.parser = httptools.HttpResponseParser(self)
        self.answer: UpstreamAnswer | None = None
        self.header_list: list[tuple[str, str]] = []
        self.interim = False   # the message being parsed is a 1xx answer
        self.lost = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]  # a uvloop transport is no asyncio.Transport subclass

    def close(self) -> None:
        self.lost = True
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None:
            self.close()   # nothing was asked: a server that sends unasked is not one to reuse
            return
        if answer.read_timeout is not None:
            answer.last_data = answer.loop.time()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            why = exc.__context__ if isinstance(exc.__context__, _Refused) else exc
            self._malformed(answer, str(why))
            return
        if not answer.started:
            # All that was fed since the request went out is head (status lines and headers).
            answer.head_size += len(data)
            if answer.head_size > MAX_HEAD:
                self._malformed(answer, f"a head of more than {MAX_HEAD} bytes")

    def _malformed(self, answer: UpstreamAnswer, why: str) -> None:
        self.close()
        # `answer` may have ended already (bytes after it): it then keeps what it got.
        answer.fail(aiohttp.ClientPayloadError(f"malformed answer: {why}") if answer.started
                    else MalformedAnswer(f"sent a malformed answer: {why}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        answer, self.answer = self.answer, None
        if answer is not None:
            answer.lost()

    # httptools' callbacks (llhttp refuses a name that is not a token and a value with CR, LF, NUL
    # or another control character, as uvicorn does; tests/proxy/upstream/test_hostile_upstream.py)
    def on_message_begin(self) -> None:
        if self.answer is None:
            # An answer nobody asked for, in the bytes that ended the last one: the next request
            # must not get it, so the connection goes.
            raise _Refused("bytes after the end of an answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.header_list) >= MAX_HEADERS:
            raise _Refused(f"more than {MAX_HEADERS} headers")
        if len(name) + len(value) > MAX_FIELD:
            raise _Refused(f"a header of more than {MAX_FIELD} bytes")
        self.header_list.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        answer = self.answer
        assert answer is not None
        headers, self.header_list = self.header_list, []
        status = self.parser.get_status_code()
        if status < 200:
            # 100 Continue, 103 Early Hints: read past, the final answer follows on the connection
            # (as aiohttp does). A 101 would switch protocols nobody asked for.
            if status == 101 or status < 100:
                raise _Refused(f"status {status}")
            self.interim = True
            return
        answer.started_with(status, headers)

    def on_body(self, body: bytes) -> None:
        answer = self.answer
        assert answer is not None
        answer.feed(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        answer, self.answer = self.answer, None
        assert answer is not None
        answer.end()
        pool = self.pool
        if answer.keep and self.parser.should_keep_alive() and pool is not None and not pool.closed and not self.lost:
            self.idle_since = answer.loop.time()
            pool.keep(self)
        else:
            self.close()


class UpstreamAnswer:
    """An answer on one pooled connection (client.py): its status and headers once they arrive
    (head()), then its body as aiohttp's StreamReader gives it (`content` is the answer itself)."""

    status: int
    headers: CIMultiDictProxy[str]
    content_length: int | None

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop, timeout: aiohttp.ClientTimeout,
                 keep: bool) -> None:
        conn.answer = self
        self.conn: Connection | None = conn
        self.loop = loop
        self.keep = keep
        self.started = False
        self.head_size = 0
        self.framed = True       # by Content-Length or chunked; else the body ends with the connection
        self.eof = False
        self.exc: BaseException | None = None
        self.parts: list[bytes] = []
        self.size = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        # Where the body goes as it arrives once diverted (divert()); None: kept for readany().
        self.sink: Callable[[bytes], None] | None = None
        self.stalled: BaseException | None = None   # what a diverted answer's silence fails with
        self.read_timeout = timeout.sock_read
        self.last_data = loop.time()
        self.read_timer: asyncio.TimerHandle | None = None
        self.total_timer = None if timeout.total is None else loop.call_later(timeout.total, self._total_expired)

    # What the connection tells it
    def started_with(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.status = status
        self.headers = CIMultiDictProxy(CIMultiDict(headers))
        length = self.headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.framed = length is not None or "Transfer-Encoding" in self.headers or status in (204, 304)
        self.started = True
        self._wake()

    def feed(self, body: bytes) -> None:
        sink = self.sink
        if sink is not None:
            sink(body)
            return
        self.parts.append(body)
        self.size += len(body)
        if self.size > HIGH_WATER and not self.paused and self.conn is not None:
            self.paused = True
            self.conn.transport.pause_reading()
        self._wake()

    def end(self) -> None:
        self.eof = True
        self._resume()   # the connection may carry another answer now
        self.conn = None
        self._stop_timers()
        self._wake()

    def lost(self) -> None:
        self.conn = None
        if self.started and not self.framed:
            self.end()   # a close-framed body ends with its connection
            return
        self.fail(aiohttp.ClientPayloadError("Response payload is not completed") if self.started
                  else aiohttp.ServerDisconnectedError())

    def fail(self, exc: BaseException) -> None:
        if self.exc is None and not self.eof:
            self.exc = exc
        self._stop_timers()
        self._wake()

    # What the data path asks of it
    async def head(self) -> "UpstreamAnswer":
        while not self.started:
            if self.exc is not None:
                raise self.exc
            await self._wait()
        return self

    @property
    def content(self) -> "UpstreamAnswer":
        return self

    @property
    def closed(self) -> bool:
        return self.conn is None

    def set_exception(self, exc: BaseException) -> None:
        self.fail(exc)

    async def readany(self) -> bytes:
        while True:
            if self.exc is not None:
                raise self.exc
            if self.parts:
                return self._take_all()
            if self.eof:
                return b""
            await self._wait()

    async def readline(self) -> bytes:
        while True:
            if self.exc is not None:
                raise self.exc
            if self.parts:
                if len(self.parts) > 1:
                    self.parts = [b"".join(self.parts)]
                data = self.parts[0]
                end = data.find(b"\n")
                if end >= 0:
                    line, rest = data[:end + 1], data[end + 1:]
                    self.parts = [rest] if rest else []
                    self.size = len(rest)
                    self._maybe_resume()
                    return line
                if len(data) > MAX_LINE:
                    raise ValueError("Chunk too big")
                if self.eof:
                    return self._take_all()
            elif self.eof:
                return b""
            await self._wait()

    def divert(self, sink: Callable[[bytes], None], idle_s: float, stalled: BaseException) -> None:
        """From now on each piece of the body goes to `sink` as it arrives, called from the
        connection's own callback: no task wakes per piece (a stream's relay, proxy/edge/splice.py).
        What was read and not taken goes first. The answer then fails with `stalled` when nothing
        arrives for `idle_s` (or the shorter read timeout it had), except while held (hold()).
        `sink` must not raise: it runs inside the parser. Wait for the end with ended()."""
        parts, self.parts, self.size = self.parts, [], 0
        self.sink = sink
        if self.read_timeout is None or idle_s < self.read_timeout:
            self.read_timeout, self.stalled = idle_s, stalled
            if self.read_timer is not None:   # armed for the longer limit: the next wait arms it anew
                self.read_timer.cancel()
                self.read_timer = None
        self.last_data = self.loop.time()
        self._resume()   # paused for the parts kept, if they were many; the sink holds it again if need be
        for part in parts:
            sink(part)

    def hold(self) -> None:
        """Stop reading the socket (a diverted answer whose sink's reader is behind)."""
        if not self.paused and self.conn is not None:
            self.paused = True
            self.conn.transport.pause_reading()
        self._wake()

    def go_on(self) -> None:
        """Read the socket again after hold(); the time it was held is no silence of the replica's."""
        self.last_data = self.loop.time()
        self._resume()

    async def ended(self) -> bool:
        """A diverted answer: wait until it ends (True), or is held (False); raises its failure."""
        while True:
            if self.exc is not None:
                raise self.exc
            if self.eof:
                return True
            if self.paused:
                return False
            await self._wait()

    async def read(self) -> bytes:
        body: list[bytes] = []
        while chunk := await self.readany():   # taken as it comes, so that a paused socket reads on
            body.append(chunk)
        return b"".join(body)

    async def text(self) -> str:
        return (await self.read()).decode(errors="replace")

    def close(self) -> None:
        """Leave the answer: a connection still carrying it is closed (the backend stops)."""
        conn, self.conn = self.conn, None
        self._stop_timers()
        if conn is not None:
            conn.answer = None
            conn.close()
            if self.exc is None and not self.eof:
                self.exc = aiohttp.ClientConnectionError("Connection closed")
            self._wake()

    def release(self) -> None:
        self.close()

    async def __aenter__(self) -> "UpstreamAnswer":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()

    # Within
    def _take_all(self) -> bytes:
        parts = self.parts
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.parts = []
        self.size = 0
        self._maybe_resume()
        return data

    def _maybe_resume(self) -> None:
        if self.size < LOW_WATER:
            self._resume()

    def _resume(self) -> None:
        if self.paused and self.conn is not None:
            self.paused = False
            self.conn.transport.resume_reading()

    async def _wait(self) -> None:
        waiter = self.waiter = self.loop.create_future()
        if self.read_timeout is not None and self.read_timer is None:
            self.read_timer = self.loop.call_at(self.last_data + self.read_timeout, self._read_expired)
        try:
            await waiter
        finally:
            self.waiter = None

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _read_expired(self) -> None:
        """aiohttp's sock_read: nothing arrived for read_timeout while a read waited."""
        self.read_timer = None
        assert self.read_timeout is not None
        due = self.last_data + self.read_timeout
        if self.waiter is None or self.eof or self.exc is not None:
            return   # no read is waiting: the next one arms the timer again
        if self.loop.time() < due:
            self.read_timer = self.loop.call_at(due, self._read_expired)
            return
        self.fail(self.stalled or aiohttp.SocketTimeoutError("Timeout on reading data from socket"))
        self.close()

    def _total_expired(self) -> None:
        self.total_timer = None
        self.fail(aiohttp.ServerTimeoutError("the answer took longer than its total timeout"))
        self.close()

    def _stop_timers(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None
        if self.total_timer is not None:
            self.total_timer.cancel()
            self.total_timer = None
