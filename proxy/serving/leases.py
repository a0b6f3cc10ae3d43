"""The controller's end of its workers' channel (proxy/lease_wire.py): a request a worker passed on
is decided here as any other (its checks, tenant, fair queue, replica, slot), and then its send to
the replica is leased back to that worker, which posts it and relays the answer itself.

The lease takes the place of the upstream client in proxy/serving/forward.py's `upstream`
(`LeaseHttp.post`), so the choice of replica, the failovers and what each failure means stay
there: a worker tells what its send met (`head`, `failed`), and the controller answers as it
would have. A stream's events never come here: its `end` says how it went (its events, its first
and last bytes, whether its end went out) and the controller counts it as a stream it relayed.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.errors import PoolError
from proxy.lease_wire import LEASE_HEADER, PEER_HEADER, WireError, frame, read_frame
from proxy.upstream.connection import MalformedAnswer

log = logging.getLogger(__name__)


class WorkerGone(ConnectionResetError):
    """The worker that held the lease exited (or its channel broke): its request is lost with it."""


class Refused(aiohttp.ClientConnectorError):
    """The worker's send was refused: as aiohttp's own refusal is read by forward.upstream."""

    def __init__(self, detail: str) -> None:
        # Not aiohttp's own __init__: it needs the connection key of a connection this process never made.
        OSError.__init__(self, detail)
        self.detail = detail

    def __str__(self) -> str:
        return self.detail


class Lease:
    """One send to a replica, made by a worker for the controller."""

    __slots__ = ("line", "id", "head", "body", "end")

    def __init__(self, line: "WorkerLine", lease_id: int) -> None:
        loop = asyncio.get_running_loop()
        self.line, self.id = line, lease_id
        self.head: asyncio.Future[tuple[dict[str, Any], bytes]] = loop.create_future()
        self.body: asyncio.Future[tuple[dict[str, Any], bytes]] = loop.create_future()
        self.end: asyncio.Future[tuple[dict[str, Any], bytes]] = loop.create_future()

    def settled(self) -> bool:
        return self.body.done() or self.end.done()

    def abort(self) -> None:
        """The controller gave up on it (a timeout, its client left): the worker closes the send."""
        if self.line.leases.pop(self.id, None) is not None:
            self.line.send({"t": "abort", "lease": self.id})

    def fail(self, exc: BaseException) -> None:
        for future in (self.head, self.body, self.end):
            if not future.done():
                future.set_exception(exc)
                future.exception()   # retrieved here: not every one is awaited


class WorkerLine:
    """One worker's channel: its index and PID, the leases it holds, and what it last said of itself."""

    def __init__(self, index: int, pid: int, writer: asyncio.StreamWriter) -> None:
        self.index, self.pid, self.writer = index, pid, writer
        self.leases: dict[int, Lease] = {}
        self.stats: asyncio.Future[dict[str, Any]] | None = None

    def send(self, message: dict[str, Any], payload: bytes = b"") -> None:
        if not self.writer.is_closing():
            self.writer.write(frame(message, payload))

    async def ask(self, timeout_s: float) -> dict[str, Any] | None:
        """The worker's own count of its client connections and requests, or None if it does not answer."""
        if self.stats is None or self.stats.done():
            self.stats = asyncio.get_running_loop().create_future()
            self.send({"t": "ask"})
        try:
            return await asyncio.wait_for(asyncio.shield(self.stats), timeout_s)
        except (TimeoutError, ConnectionError):
            return None


class LeaseDesk:
    """The workers' channels, on a Unix socket only this user can reach (`serve`)."""

    def __init__(self) -> None:
        self.lines: dict[int, WorkerLine] = {}
        self.ids = itertools.count(1)
        self.connected = asyncio.Event()   # a worker said hello since this was last cleared

    async def serve(self, path: Path) -> asyncio.Server:
        return await asyncio.start_unix_server(self._line, path=str(path))

    def lessee(self, value: str) -> "Lessee | None":
        """The worker request named by a LEASE_HEADER, where its worker is connected."""
        index, _, ref = value.partition(":")
        if not (index.isascii() and index.isdigit() and ref.isascii() and ref.isdigit()):   # "²" is a digit too
            return None
        line = self.lines.get(int(index))
        return Lessee(self, line, int(ref)) if line is not None else None

    async def _line(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line: WorkerLine | None = None
        try:
            hello, _ = await read_frame(reader)
            index, pid = hello.get("worker"), hello.get("pid")
            if hello["t"] != "hello" or not isinstance(index, int) or not isinstance(pid, int):
                raise WireError("a channel that did not begin with hello")
            line = WorkerLine(index, pid, writer)
            old = self.lines.get(index)
            if old is not None:
                _drop(old)   # a worker restarted under its index: the one before is gone
            self.lines[index] = line
            self.connected.set()
            while True:
                message, payload = await read_frame(reader)
                _dispatch(line, message, payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except (WireError, ValueError, KeyError, TypeError) as exc:
            log.error("worker channel%s broke its framing (%s); closing it",
                      f" of worker {line.index}" if line else "", exc)
        finally:
            writer.close()
            if line is not None:
                if self.lines.get(line.index) is line:
                    del self.lines[line.index]
                _drop(line)


def _drop(line: WorkerLine) -> None:
    """Every lease the worker held is lost with it: a send still unanswered ends as a request whose
    client left (cancelled: no replica is blamed for it), a relayed stream as one whose report never came."""
    for lease in list(line.leases.values()):
        lease.head.cancel()
        lease.body.cancel()
        lease.fail(WorkerGone(f"worker {line.index} (pid {line.pid}) is gone"))
    line.leases.clear()
    if line.stats is not None and not line.stats.done():
        line.stats.set_exception(ConnectionResetError())
        line.stats.exception()


def _dispatch(line: WorkerLine, message: dict[str, Any], payload: bytes) -> None:
    kind = message["t"]
    if kind == "stats":
        if line.stats is not None and not line.stats.done():
            line.stats.set_result(message)
        return
    lease = line.leases.get(message.get("lease"))   # type: ignore[arg-type]
    if lease is None:
        return   # one the controller aborted: what it says now is no longer awaited
    if kind == "head" and not lease.head.done():
        lease.head.set_result((message, payload))
    elif kind == "failed":
        line.leases.pop(lease.id, None)
        if message.get("kind") == "gone":
            # Its client left before the answer: as a cancelled request, the replica blameless.
            for future in (lease.head, lease.body, lease.end):
                future.cancel()
        else:
            lease.fail(_failure(message))
    elif kind == "body":
        line.leases.pop(lease.id, None)
        lease.body.set_result((message, payload))
    elif kind == "end":
        line.leases.pop(lease.id, None)
        lease.end.set_result((message, payload))


def _failure(message: dict[str, Any]) -> BaseException:
    """What a worker's send met, as the exception forward.upstream reads it as."""
    detail = str(message.get("detail", ""))
    kind = message.get("kind")
    if kind == "refused":
        return Refused(detail)
    if kind == "malformed":
        return MalformedAnswer(detail)
    if kind == "pool":
        status = message.get("status")
        return PoolError(detail, code=str(message.get("code")), status=status if isinstance(status, int) else 502)
    if kind == "broke":
        return aiohttp.ClientPayloadError(detail)
    return aiohttp.ClientOSError(f"the worker's send failed: {detail}")


class Lessee:
    """The worker request a controller's request came from: where its replica's send is leased."""

    __slots__ = ("desk", "line", "ref")

    def __init__(self, desk: LeaseDesk, line: WorkerLine, ref: int) -> None:
        self.desk, self.line, self.ref = desk, line, ref

    def http(self, request_id: str, strip: bool, limit: int, first_byte_s: float, idle_s: float) -> "LeaseHttp":
        return LeaseHttp(self, {"req": self.ref, "request_id": request_id, "strip": strip, "limit": limit,
                                "first_byte_s": first_byte_s, "idle_s": idle_s})


class LeaseHttp:
    """What forward.upstream sends with in a leased request: a replica's reach calls `post` as it would
    the upstream client's, and the worker makes the send. `at` names the replica first."""

    __slots__ = ("lessee", "terms")

    def __init__(self, lessee: Lessee, terms: dict[str, Any]) -> None:
        self.lessee, self.terms = lessee, terms

    def at(self, index: int, model: str, label: str) -> None:
        self.terms = {**self.terms, "replica": index, "model": model, "label": label}

    async def post(self, url: str, *, data: bytes, headers: dict[str, str],
                   timeout: aiohttp.ClientTimeout) -> "LeasedAnswer":
        line = self.lessee.line
        lease = Lease(line, next(self.lessee.desk.ids))
        if line.writer.is_closing():
            # Its worker, the request's client here, is gone: as a client that left, no replica's fault.
            raise asyncio.CancelledError()
        line.leases[lease.id] = lease
        line.send({**self.terms, "t": "lease", "lease": lease.id, "url": url, "headers": headers,
                   "connect_s": timeout.sock_connect, "read_s": timeout.sock_read}, data)
        try:
            head, _ = await lease.head
        except asyncio.CancelledError:
            lease.abort()   # the first byte's deadline, or the client left
            raise
        return LeasedAnswer(lease, head)


class LeasedBody:
    """A non-streamed answer's body, read by the worker: the whole of it at once, then the end."""

    __slots__ = ("lease", "read")

    def __init__(self, lease: Lease) -> None:
        self.lease, self.read = lease, False

    async def readany(self) -> bytes:
        if self.read:
            return b""
        self.read = True
        _, payload = await self.lease.body
        return payload

    async def readline(self) -> bytes:
        return await self.readany()

    def set_exception(self, exc: BaseException) -> None:
        self.lease.fail(exc)


class LeasedAnswer:
    """The replica's answer to a worker's send, as forward.py reads an answer (upstream.client.Answer):
    a stream's status and headers, or a whole non-streamed one; `streaming`: the worker relays it."""

    def __init__(self, lease: Lease, head: dict[str, Any]) -> None:
        self.lease = lease
        status = head.get("status")
        self.status = status if isinstance(status, int) else 502
        raw = head.get("headers")
        pairs = raw if isinstance(raw, list) else []
        self.headers = CIMultiDictProxy(CIMultiDict((str(k), str(v)) for k, v in pairs))
        self.streaming = bool(head.get("stream"))
        self.content = LeasedBody(lease)
        self.content_length: int | None = None
        self.closed = False

    async def read(self) -> bytes:
        return await self.content.readany()

    async def text(self) -> str:
        return (await self.read()).decode(errors="replace")

    def close(self) -> None:
        self.closed = True
        if not self.lease.settled():
            self.lease.abort()

    def release(self) -> None:
        self.close()

    async def ended(self) -> tuple[dict[str, Any], bytes]:
        """The worker's report of the stream it relayed (WorkerGone if it died meanwhile)."""
        return await self.lease.end

    async def __aenter__(self) -> "LeasedAnswer":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


# The worker request a request came from (lease_middleware): its replica's send is leased to it.
LESSEE = web.RequestKey("lessee", Lessee)
# The address of the client the worker took the request from (what `request.remote` is in one process).
PEER = web.RequestKey("peer", str)


def lease_middleware(desk: LeaseDesk) -> Any:
    """A request a worker passed on over the controller's own socket is leased back to it
    (LESSEE); the header means nothing on any other listener."""
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        value = request.headers.get(LEASE_HEADER)
        if value is not None and request.transport is not None and \
                isinstance(request.transport.get_extra_info("sockname"), str):
            lessee = desk.lessee(value)
            if lessee is not None:
                request[LESSEE] = lessee
            peer = request.headers.get(PEER_HEADER)
            if peer:
                request[PEER] = peer
        return await handler(request)
    return middleware


PRIVATE_PREFIX = "llm-pool-"


def private_dir(parent: str | None = None) -> Path:
    """A folder for the controller's sockets that only this user can enter (mode 0700): a socket's
    path must be short (108 bytes), which a state folder's need not be. Its name holds this PID, so
    that the folders of controllers that were killed (no stop removed theirs) are removed here."""
    import tempfile
    parent = parent or tempfile.gettempdir()
    _remove_orphans(Path(parent))
    path = Path(tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-", dir=parent))
    os.chmod(path, 0o700)
    return path


def _remove_orphans(parent: Path) -> None:
    """This user's socket folders whose controller is gone. Only what private_dir makes is touched:
    a folder of ours, named for a PID no process has, holding nothing but sockets."""
    uid = os.getuid()
    for path in parent.glob(f"{PRIVATE_PREFIX}*-*"):
        pid = path.name[len(PRIVATE_PREFIX):].split("-", 1)[0]
        if not pid.isascii() or not pid.isdigit():
            continue
        try:
            if path.lstat().st_uid != uid or not path.is_dir() or path.is_symlink():
                continue
            os.kill(int(pid), 0)
            continue   # its controller runs (or the PID is another's now: left alone)
        except ProcessLookupError:
            pass
        except OSError:
            continue   # not ours to look at, or gone meanwhile
        with contextlib.suppress(OSError):
            if all(entry.is_socket() for entry in path.iterdir()):
                remove_private_dir(path)


def remove_private_dir(path: Path) -> None:
    for entry in path.iterdir():
        with contextlib.suppress(OSError):
            entry.unlink()
    with contextlib.suppress(OSError):
        path.rmdir()
