"""One lease, in a worker: post the controller's request to the replica, tell the controller what
came back, and relay a stream to the client here (proxy/serving/leases.py is the other end)."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import aiohttp
from aiohttp import web

from proxy.errors import PoolError
from proxy.edge.relay import Timeouts, read_capped
from proxy.edge.stream_count import Tally
from proxy.edge.stream_relay import missing_message_start, relay_stream
from proxy.upstream.client import Answer, Send, UpstreamHttp, post_retrying
from proxy.upstream.connection import MalformedAnswer

Tell = Callable[[dict[str, Any], bytes], None]


class WorkerEnd:
    """How a stream relayed here went (stream_relay.StreamEnd), for the controller's `end` report."""

    __slots__ = ("label", "path", "model", "request_id", "started", "ttft", "tally", "tail", "error", "whole_")

    def __init__(self, label: str, path: str, model: str, request_id: str, started: float) -> None:
        self.label, self.path, self.model, self.request_id, self.started = label, path, model, request_id, started
        self.ttft: float | None = None
        self.tally: Tally | None = None
        self.tail = b""
        self.error: dict[str, Any] | None = None
        self.whole_ = False

    def first(self, chunk: bytes) -> bytes:
        self.ttft = time.perf_counter() - self.started
        return missing_message_start(self.path, chunk, self.model, self.request_id)

    def ended(self, tally: Tally, tail: bytes, out: web.StreamResponse) -> None:
        self.tally, self.tail = tally, tail

    def broke(self, err: PoolError) -> None:
        self.error = {"code": err.metric_code, "message": err.message}

    def settle(self, tally: Tally, tail: bytes) -> None:
        self.tally, self.tail = tally, tail

    def whole(self) -> None:
        self.whole_ = True

    def report(self, lease_id: int) -> tuple[dict[str, Any], bytes]:
        tally = self.tally
        head = tally.head if tally is not None else b""
        return ({"t": "end", "lease": lease_id, "events": tally.events if tally is not None else 0,
                 "ended": bool(tally is not None and tally.ended), "whole": self.whole_, "error": self.error,
                 "ttft": self.ttft, "head": len(head)}, head + self.tail)


async def run_lease(request: web.Request, started: float, http: UpstreamHttp, terms: dict[str, Any], body: bytes,
                    tell: Tell) -> web.StreamResponse | None:
    """Send the leased request and answer for it with `tell`; the client's stream response where
    the stream was relayed here, else None (the controller answers the client through its reply)."""
    lease_id = terms["lease"]
    label = str(terms.get("label", "the replica"))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=terms.get("connect_s"), sock_read=terms.get("read_s"))
    headers = {str(k): str(v) for k, v in terms["headers"].items()}
    url = str(terms["url"])
    send = Send()
    over = False   # whether the controller was told how it ended (failed, body or end)

    def final(message: dict[str, Any], payload: bytes) -> None:
        nonlocal over
        over = True
        tell(message, payload)

    try:
        try:
            resp: Answer = await post_retrying(send, http, lambda h: h.post(url, data=body, headers=headers,
                                                                             timeout=timeout), label)
        except aiohttp.ClientConnectorError as exc:
            final({"t": "failed", "lease": lease_id, "kind": "refused", "detail": f"{type(exc).__name__}: {exc}"}, b"")
            return None
        except MalformedAnswer as exc:
            final({"t": "failed", "lease": lease_id, "kind": "malformed", "detail": str(exc)}, b"")
            return None
        except (aiohttp.ClientError, OSError) as exc:
            final({"t": "failed", "lease": lease_id, "kind": "reset", "detail": type(exc).__name__}, b"")
            return None
        try:
            content_type = resp.headers.get("Content-Type", "application/json")
            streaming = resp.status == 200 and content_type.startswith("text/event-stream")
            tell({"t": "head", "lease": lease_id, "status": resp.status, "headers": list(resp.headers.items()),
                  "stream": streaming}, b"")
            timeouts = Timeouts(first_byte_s=float(terms["first_byte_s"]), idle_s=float(terms["idle_s"]))
            if streaming:
                return await _stream(request, started, resp, terms, timeouts, label, content_type, final)
            try:
                raw = await read_capped(resp, timeouts, int(terms["limit"]), label)
            except PoolError as exc:
                final({"t": "failed", "lease": lease_id, "kind": "pool", "detail": exc.message, "code": exc.code,
                      "status": exc.status}, b"")
            except aiohttp.ClientError as exc:
                final({"t": "failed", "lease": lease_id, "kind": "broke", "detail": type(exc).__name__}, b"")
            else:
                final({"t": "body", "lease": lease_id}, raw)
            return None
        finally:
            await resp.__aexit__(None, None, None)
    except asyncio.CancelledError:
        if not over:
            # The controller aborted it, or its client left before the answer: nothing of it is the replica's.
            tell({"t": "failed", "lease": lease_id, "kind": "gone"}, b"")
        raise
    finally:
        if send.second is not None:
            await send.second.close()


async def _stream(request: web.Request, started: float, resp: Answer, terms: dict[str, Any], timeouts: Timeouts,
                  label: str, content_type: str, tell: Tell) -> web.StreamResponse:
    end = WorkerEnd(label, request.path, str(terms.get("model", "")), str(terms["request_id"]), started)
    headers = {"Content-Type": content_type, "Cache-Control": "no-cache", "X-Request-Id": str(terms["request_id"]),
               "X-Replica": str(terms.get("replica", "")), "X-LLM-Pool-Model": str(terms.get("model", ""))}
    try:
        return await relay_stream(request, resp, timeouts, end, bool(terms.get("strip")), headers)
    finally:
        tell(*end.report(terms["lease"]))   # however it ended: the controller counts it from this
