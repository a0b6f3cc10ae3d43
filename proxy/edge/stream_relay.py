"""A pass-through stream, from the replica's answer to the client as it arrives: the same loop in the
one process (proxy/serving/forward.py) and in a worker (proxy/worker/), which relays what its
controller leased to it. What the pool makes of how the stream went (the replica's outcome, the
usage, the metrics) is the `StreamEnd`'s; nothing here knows the pool.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Mapping, Protocol

import aiohttp
from aiohttp import web

from proxy.errors import BackendError, BackendTimeout, PoolError
from proxy.edge.anthropic import MESSAGES_PATH, message_start, stream_error
from proxy.edge.relay import Timeouts, stream_watch, timed_out
from proxy.edge.splice import Splice
from proxy.edge.stream_count import Tally
from proxy.upstream.client import Answer
from proxy.upstream.connection import UpstreamAnswer

log = logging.getLogger(__name__)


class StreamEnd(Protocol):
    """What a relayed stream's course means: told at its first read, its end, a failure, and in any case."""

    label: str   # the replica, for messages ("replica 0 of 'chat'")

    def first(self, chunk: bytes) -> bytes:
        """The stream's first read goes out now; returns what goes before it (b"": nothing)."""
        ...

    def ended(self, tally: Tally, tail: bytes, out: web.StreamResponse) -> None:
        """The stream's end went out: a success, whatever the client does next; its usage is set now."""
        ...

    def broke(self, err: PoolError) -> None:
        """The replica broke the stream off before its end (after it, nothing is told)."""
        ...

    def settle(self, tally: Tally, tail: bytes) -> None:
        """The stream is over without `ended` (the client left, a failure, no end marker): count what went out."""
        ...

    def whole(self) -> None:
        """The replica closed the stream cleanly without its end marker: not its failure."""
        ...


async def relay_stream(request: web.Request, upstream: Answer, timeouts: Timeouts, end: StreamEnd, strip: bool,
                       headers: Mapping[str, str]) -> web.StreamResponse:
    """The answer's stream to the client with `headers`; `strip`: keep the usage chunk, which the
    proxy asked for, from the client. Whatever way it ends, `end` is told before this returns or raises."""
    out = web.StreamResponse(status=upstream.status, headers=headers)
    await out.prepare(request)
    tally = Tally(request.path)
    splice = Splice(request, out, strip, tally, end.ended)
    watch = stream_watch(upstream, timeouts, end.label)
    try:
        # The first pieces are read by this task and written with aiohttp's writer (the headers go
        # with the first); once one went out, an answer on the proxy's own connection is diverted
        # to the splice, and any other is read on here, each read taken by it all the same.
        divert = isinstance(upstream, UpstreamAnswer)
        while True:
            with watch:
                chunk = await upstream.content.readany()
            if not chunk:
                break
            piece = splice.take(chunk)
            if not tally.head:
                tally.head = chunk
                piece = end.first(chunk) + piece
            try:
                await out.write(piece)
            except ConnectionResetError:
                # The client left: closing the upstream connection makes the backend stop generating.
                upstream.close()
                return out
            splice.check_end(chunk)
            if divert and piece:
                watch.close()
                assert isinstance(upstream, UpstreamAnswer)
                if not await _spliced(request, upstream, splice, timeouts, end.label):
                    return out   # the client left
                break
    except (BackendTimeout, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
        upstream.close()
        err = exc if isinstance(exc, PoolError) else \
            BackendError(f"{end.label} broke off the stream: {type(exc).__name__}")
        if tally.ended:
            # The backend closed badly after its last event: the client has the whole answer.
            log.info("%s %s: %s after the end of its stream", request.method, request.path, err.message)
        else:
            log.warning("%s %s: %s", request.method, request.path, err.message)
            end.broke(err)
            with contextlib.suppress(ConnectionResetError):
                await out.write(stream_error(err, request.path))
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out
    finally:
        watch.close()
        if not tally.settled:
            tally.events = splice.events
            # Ended early (the client left, the handler was cancelled, the backend broke off) or
            # without an end marker: what went out is counted.
            end.settle(tally, splice.tail())
    if not tally.ended:
        end.whole()
    with contextlib.suppress(ConnectionResetError):
        await out.write_eof()   # a client that closed once it had everything: still a success
    return out


def missing_message_start(path: str, first: bytes, model: str, request_id: str) -> bytes:
    """What goes before a stream's first read: on /v1/messages, the message_start that llama-server
    leaves out now and then (13% of short streams, measured), without which Anthropic's SDK has no
    message to give (the one its translation sends); else nothing."""
    if path != MESSAGES_PATH:
        return b""
    line, newline, _ = first.partition(b"\n")
    if newline and line.startswith(b"event:") and line[6:].strip() != b"message_start":
        return message_start(model, f"msg_{request_id}")
    return b""


async def _spliced(request: web.Request, upstream: UpstreamAnswer, splice: Splice, timeouts: Timeouts,
                   replica_label: str) -> bool:
    """The rest of a stream relayed by `splice` in the connection's callback, this task asleep
    until the answer ends (True) or the client leaves (False); raises what ended it otherwise."""
    splice.answer = upstream
    upstream.divert(splice, timeouts.idle_s, timed_out(replica_label, timeouts.idle_s, "stream_idle_timeout_s"))
    while not await upstream.ended():
        # Held: the client is behind (its transport past the high-water mark), or gone.
        if not splice.left:
            try:
                await request.writer.drain()
            except ConnectionResetError:
                splice.left = True
        if splice.left:
            break
        upstream.go_on()
    if splice.left:
        upstream.close()   # the backend stops generating for nobody
        if splice.failed is not None:
            raise splice.failed
        return False
    return True
