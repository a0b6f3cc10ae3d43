"""A worker process: it accepts clients on the service's listening socket (inherited from its
controller), passes each request to the controller over the controller's Unix socket, and relays
what comes back. Where the controller leases the replica's send back to it (proxy/serving/
leases.py), it posts to the replica and relays the answer itself: a stream's events then never
cross into the controller, which only decides (docs/workers.md).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from proxy.lease_wire import LEASE_HEADER, PEER_HEADER, RELAYED_HEADER
from proxy.upstream.client import NotingConnector, UpstreamHttp
from proxy.upstream.connection import UpstreamAnswer
from proxy.worker.controller_http import METHODS, ControllerHttp
from proxy.worker.lease_relay import run_lease
from proxy.worker.line import ControllerLine

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) are the connection's, not the request's; the lengths are the
# new connection's to set; Expect was met here (the body is read); the lease header is the worker's
# alone to send.
HOP = frozenset(h.lower() for h in ("Connection", "Keep-Alive", "Proxy-Connection", "TE", "Trailer",
                                     "Transfer-Encoding", "Upgrade", "Content-Length", "Expect",
                                     LEASE_HEADER, PEER_HEADER))
ANSWER_HOP = HOP | {"date", "server", RELAYED_HEADER.lower()}
# A body up to this size is read and sent whole; a larger one is streamed to the controller, which
# holds the limit (service.max_body_bytes) and answers a body over it as it always does.
READ_WHOLE = 64 * 1024


class Passed:
    """One client request this worker passed to the controller."""

    __slots__ = ("request", "started", "lease", "out")

    def __init__(self, request: web.Request) -> None:
        self.request, self.started = request, time.perf_counter()
        self.lease: asyncio.Task[web.StreamResponse | None] | None = None
        self.out: web.StreamResponse | None = None   # the stream a lease relayed


class Worker:
    def __init__(self, index: int, controller_socket: str) -> None:
        self.index = index
        self.controller = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=controller_socket, limit=0), auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None))
        self.fast = ControllerHttp(controller_socket)
        self.upstream = UpstreamHttp(aiohttp.ClientSession(connector=NotingConnector()))
        self.line = ControllerLine(index, self.on_frame)
        self.refs = itertools.count(1)
        self.passed: dict[int, Passed] = {}
        self.leases: dict[int, asyncio.Task[web.StreamResponse | None]] = {}
        self.background: set[asyncio.Task[Any]] = set()
        self.runner: web.AppRunner | None = None
        self.idle = asyncio.Event()   # no request in flight (a drain waits for it)
        self.stopping = False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        ref = next(self.refs)
        passed = self.passed[ref] = Passed(request)
        self.idle.clear()
        exchange = asyncio.ensure_future(self._exchange(request, ref, passed))
        try:
            return await asyncio.shield(exchange)
        except asyncio.CancelledError:
            # The client left. A lease (running or done) has told, or now tells as it stops, how
            # its answer went, and the controller's reply ends the exchange: closing the exchange
            # first would cancel a request there that its report may not have reached. Without a
            # lease, closing it cancels the request there, as a client that leaves the controller does.
            if passed.lease is not None:
                passed.lease.cancel()
                self._keep(exchange)
            else:
                exchange.cancel()
            raise
        finally:
            self.passed.pop(ref, None)
            if not self.passed:
                self.idle.set()

    async def close_when_stopping(self, request: web.Request, response: web.StreamResponse) -> None:
        """Once stopping, every answer closes its connection: the client opens a new one, which
        another worker (or a reload's successor) accepts."""
        if self.stopping:
            # Both: aiohttp has already chosen its headers when this hook runs.
            response.force_close()
            response.headers["Connection"] = "close"

    async def drained(self, timeout_s: float) -> None:
        """Until no request is in flight here, or `timeout_s`."""
        if self.passed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.idle.wait(), timeout_s)

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self.background.add(task)
        task.add_done_callback(_settled_quietly)
        task.add_done_callback(self.background.discard)

    async def _exchange(self, request: web.Request, ref: int, passed: Passed) -> web.StreamResponse:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
        headers.append((LEASE_HEADER, f"{self.index}:{ref}"))
        if request.remote:
            headers.append((PEER_HEADER, request.remote))
        data: Any = None
        if request.body_exists:
            length = request.content_length
            data = await request.read() if length is not None and length <= READ_WHOLE else request.content
        resp: aiohttp.ClientResponse | UpstreamAnswer | None = None
        try:
            if request.method in METHODS and (data is None or isinstance(data, bytes)):
                # The request line's target as the client sent it (an absolute form, as its path)
                target = request.raw_path if request.raw_path.startswith("/") else request.rel_url.raw_path_qs
                resp = await self.fast.send(request.method, target, headers, data)
            else:
                resp = await self.controller.request(request.method, "http://controller" + request.path_qs,
                                                     headers=headers, data=data, allow_redirects=False)
            if resp.headers.get(RELAYED_HEADER) == "1" and passed.out is not None:
                await resp.read()
                return passed.out
            return await _pass_back(request, resp)
        except (aiohttp.ClientError, OSError):
            if passed.lease is None:
                raise
            # The controller is gone (a crash: docs/workers.md): a stream relayed here goes on to its end.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await passed.lease
            if passed.out is None:
                raise
            return passed.out
        finally:
            if resp is not None:
                resp.close()   # read to its end, a no-op; else (the client left) the request there ends

    def on_frame(self, message: dict[str, Any], payload: bytes) -> None:
        kind = message["t"]
        if kind == "lease":
            passed = self.passed.get(message.get("req"))   # type: ignore[arg-type]
            if passed is None:
                self.line.tell({"t": "failed", "lease": message.get("lease"), "kind": "gone"})
                return
            lease_id: int = message["lease"]
            task = asyncio.ensure_future(self._lease(passed, message, payload))
            passed.lease = self.leases[lease_id] = task
            task.add_done_callback(lambda _t: self.leases.pop(lease_id, None))
        elif kind == "abort":
            aborted = self.leases.get(message.get("lease"))   # type: ignore[arg-type]
            if aborted is not None:
                aborted.cancel()
        elif kind == "ask":
            server = self.runner.server if self.runner is not None else None
            self.line.tell({"t": "stats", "connections": len(server.connections) if server is not None else 0,
                            "requests": len(self.passed)})

    async def _lease(self, passed: Passed, terms: dict[str, Any], body: bytes) -> web.StreamResponse | None:
        try:
            out = await run_lease(passed.request, passed.started, self.upstream, terms, body, self.line.tell)
        except Exception as exc:
            # A bug here must not leave the controller waiting for an answer until its timeout.
            log.exception("worker %d: lease %s failed", self.index, terms.get("lease"))
            self.line.tell({"t": "failed", "lease": terms.get("lease"), "kind": "reset", "detail": type(exc).__name__})
            return None
        if out is not None:
            passed.out = out
        return out

    async def close(self) -> None:
        for task in list(self.background):
            task.cancel()
        await self.line.close()
        self.fast.close()
        await self.controller.close()
        await self.upstream.close()


async def _pass_back(request: web.Request, resp: aiohttp.ClientResponse | UpstreamAnswer) -> web.StreamResponse:
    """The controller's answer to the client, as it comes (a stream it relays, event by event)."""
    headers = CIMultiDict((k, _header_value(v)) for k, v in resp.headers.items() if k.lower() not in ANSWER_HOP)
    if resp.content_length is not None:
        return web.Response(status=resp.status, body=await resp.read(), headers=headers)
    stream = web.StreamResponse(status=resp.status, headers=headers)
    await stream.prepare(request)
    try:
        while chunk := await resp.content.readany():
            await stream.write(chunk)
    except ConnectionResetError:
        return stream   # the client left: the caller's close ends the request in the controller
    await stream.write_eof()
    return stream


def _header_value(value: str) -> str:
    """A header's value as the controller's aiohttp wrote it (UTF-8), from the parser's Latin-1."""
    return value if value.isascii() else value.encode("latin-1").decode("utf-8", "replace")


def _settled_quietly(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("a request's exchange with the controller ended with %r after its client left", task.exception())
