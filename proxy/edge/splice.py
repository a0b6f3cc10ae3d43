"""A pass-through stream's pieces, from the replica's connection to the client's as they arrive.

The relay (stream_relay.relay_stream) reads a stream's first piece as it reads any answer, and writes it with
the answer's headers. From then on each piece is taken by a `Splice`: counted, stripped of a usage
chunk the client did not ask for, and written to the client's transport with the chunk framing
aiohttp gives an HTTP/1.1 stream. Over one of the proxy's own connections (proxy/upstream/
connection.py) the answer is diverted: the Splice runs in the connection's own callback, as the
parser hands over each piece, so no task wakes, no coroutine resumes and no timer moves per event
(that was most of the relay's CPU per event: tests/bench/bench_stream_cost.py). The relay's task
sleeps until the stream ends, fails, or the client falls behind; then the replica's socket is not
read until the client's buffer drains. Any other answer (a provider's, over aiohttp's client) is
read by the task and each read taken by the same Splice.
"""
from __future__ import annotations

import logging
from typing import Callable

from aiohttp import web
from aiohttp.http import HttpVersion11

from proxy.edge.stream_count import Tally, without_usage_chunk
from proxy.upstream.connection import UpstreamAnswer

# What runs once the stream's end went out: the tally (ended, its events), the tail of what went
# out (the usage chunk is in it), and the client's response.
OnEnd = Callable[[Tally, bytes, web.StreamResponse], None]

log = logging.getLogger(__name__)


class Splice:
    """One stream's pieces after its first: taken (`take`) or taken and written (a call)."""

    __slots__ = ("out", "strip", "tally", "on_end", "needle", "marker", "edge",
                 "events", "oldest", "older", "last", "transport", "chunked", "high", "answer", "left", "failed")

    def __init__(self, request: web.Request, out: web.StreamResponse, strip: bool, tally: Tally,
                 on_end: OnEnd) -> None:
        self.out, self.strip, self.tally, self.on_end = out, strip, tally, on_end
        self.needle, self.marker = tally.needle, tally.marker
        self.edge = len(self.needle) - 1
        self.events = 0
        # The last three pieces: the usage chunk (sent last) is among them, so only they are scanned,
        # once, after the stream; nothing is copied per piece.
        self.oldest = self.older = self.last = b""
        transport = request.transport
        self.transport = transport
        # aiohttp frames a stream of unknown length as chunks for HTTP/1.1, and sends it bare to be
        # ended by the close for HTTP/1.0 (web.StreamResponse._prepare_headers).
        self.chunked = request.version >= HttpVersion11
        # Past the transport's own high-water mark its protocol is paused: the client is behind.
        self.high = transport.get_write_buffer_limits()[1] if transport is not None else 0
        self.answer: UpstreamAnswer | None = None   # the diverted answer, held while the client is behind
        self.left = False        # the client went away (or taking a piece failed): nothing more is written
        self.failed: BaseException | None = None

    def take(self, data: bytes) -> bytes:
        """Count a piece that goes out and return what of it the client gets (b"": nothing)."""
        last = self.last
        self.oldest, self.older, self.last = self.older, last, data
        # An event whose mark is split between two pieces is counted at the second.
        edge = self.edge
        self.events += data.count(self.needle) + (last[-edge:] + data[:edge]).count(self.needle)
        # The usage chunk's empty `choices` is its mark: one scan, and only then a closer look.
        return without_usage_chunk(data) if self.strip and b"[]" in data else data

    def check_end(self, data: bytes) -> None:
        """`data` went out: when it holds the stream's end, the request is a success and its usage
        is set now, before a client that closes at once cancels the handler."""
        tally = self.tally
        # A short piece may hold the end of a marker split between two reads.
        marker = self.marker
        if (data.find(marker, -32) >= 0 or len(data) < 32 and marker in self.older[-32:] + data) and not tally.ended:
            tally.events, tally.ended = self.events, True
            self.on_end(tally, self.tail(), self.out)

    def tail(self) -> bytes:
        return self.oldest + self.older + self.last

    def __call__(self, data: bytes) -> None:
        """A piece, written to the client right away. Runs inside the replica connection's parser
        (a diverted answer), so it never raises: a failure is kept for the relay's task."""
        if self.left:
            return
        try:
            transport = self.transport
            if transport is None or transport.is_closing():
                self.left = True     # not counted: it never went out
            else:
                out = self.take(data)
                if out:
                    transport.write(b"%x\r\n%b\r\n" % (len(out), out) if self.chunked else out)
                self.check_end(data)
                if transport.get_write_buffer_size() <= self.high:
                    return
        except Exception as exc:   # a bug here must not read as the replica's malformed answer
            log.exception("relaying a stream piece failed")
            self.failed, self.left = exc, True
        if self.answer is not None:
            self.answer.hold()   # the relay's task wakes: the client is behind, or gone
