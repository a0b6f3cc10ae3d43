"""OpenAI-compatible pass-through: take a slot, pick a replica, forward, stream back as it arrives."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from types import TracebackType
from typing import Any, Hashable

import aiohttp
from aiohttp import web

from proxy.errors import BackendError, BackendTimeout, PoolError, Unavailable
from proxy.lifecycle.state.affinity import Wait
from proxy.lifecycle.state.outcomes import Outcomes, process_gone
from proxy.lifecycle.state.replicas import ModelState, Replica
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.lifecycle.state.slots import scoped
from proxy.upstream.client import SENDING, Answer, NotingConnector, Send, UpstreamHttp
from proxy.upstream.connection import MalformedAnswer, UpstreamAnswer
from proxy.serving.affinity_key import SLOT_PATHS
from proxy.serving.anthropic import message_start
from proxy.serving.errors_http import error_event
from proxy.serving.keys import (CACHE_SCOPE, FAIRNESS_KEY, HTTP, METRICS, POOL, QUEUE_WAIT, REPLICA, REPLICA_HEADER,
                                SETTINGS, STARTED, STREAM_ERROR, USAGE)
from proxy.serving.metrics import usage_in
from proxy.serving.relay import (ENGINE_JUDGES_INPUT, Deadline, Timeouts, backend_error, input_refused, read_capped,
                                 stream_watch, timed_out)
from proxy.serving.splice import Splice
from proxy.serving.stream_usage import MESSAGES_ROUTE, USAGE_ROUTES, Tally, ask_usage

log = logging.getLogger(__name__)

# Only connecting is bounded here; waiting for the answer is bounded by the model's Timeouts.
UPSTREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5)
# How a send fails on a pooled connection that the server had already closed, before any byte of
# an answer: the read meets the close, or the write or read is reset (aiohttp >= 3.10 raises its
# ClientConnectionResetError, a ConnectionResetError, for a write to a closing transport). A
# refused connection, ClientConnectorError, is a ClientOSError too but is not one of these.
CLOSED_UNDER_US = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionResetError)
# llama-server's fields that pick a slot (`slot_id`: its older name). Only the proxy picks one: a
# client's own would read the cache of whichever conversation, or tenant, sits there.
CLIENT_SLOT_FIELDS = ("id_slot", "slot_id")


def upstream_session() -> UpstreamHttp:
    """The app's one client for every upstream call: its own keep-alive connections for the sends
    to replicas, an aiohttp session for the rest. No per-connection limit, since admission
    already bounds how many requests a replica gets. Both note which sends went out on a reused
    connection: the one failure upstream() sends again."""
    return UpstreamHttp(aiohttp.ClientSession(connector=NotingConnector()))


class Slot:
    """Hold one of the model's slots for the block, waiting for it under the fairness rules;
    `queued` is what `runtime.admission.enqueue` returned. A class, not an asynccontextmanager: it
    runs once per request, and a generator-based one costs several times as much."""

    __slots__ = ("admission", "queued", "ticket")
    ticket: Hashable

    def __init__(self, runtime: ModelRuntime, queued: tuple[Hashable, "asyncio.Future[None] | None"]) -> None:
        self.admission = runtime.admission
        self.queued = queued

    async def __aenter__(self) -> None:
        self.ticket = await self.admission.wait(self.queued)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:
        # The client left (GeneratorExit: a relay its output stopped reading): the slot frees now,
        # and its running time still counts, but not as a completion.
        completed = exc_type is None or not issubclass(exc_type, (asyncio.CancelledError, GeneratorExit))
        self.admission.release(self.ticket, completed)


def label(replica: Replica) -> str:
    return f"replica {replica.index} of {replica.model!r}"


class upstream:
    """POST `payload` to a READY replica that has room (the least loaded, or the one its `affinity`
    key belongs to: ModelRuntime.pick_replica) and give its response once its headers arrive
    (within first_byte_timeout_s, else 504 `backend_timeout`). `raw`: the client's bytes of
    `payload`, for a replica's reach to send as they are when it changes nothing. `scope`: the
    request's tenant (CACHE_SCOPE): its affinity key is the tenant's, and every request that runs in a
    llama-server slot takes one of the tenant's (proxy/lifecycle/state/slots.py).

    Sent to another replica only when the first did not take the request: the connection was
    refused, the replica's process died before any answer, or a server of ours answered 503 (it
    is restarting) while another replica is READY; the last two once at most. Sent once more to
    the same replica, on a new connection, when it failed on a reused one before any answer came
    back (`_post`): that never reached a live server either, and counts for nothing. (A server
    that reads a request and then drops a kept-alive connection looks the same from here, and
    gets it twice.) Any other request dropped by a live replica after it was sent, that second
    send's failure included, is not replayed (it may be what brings replicas down) and does not
    take its replica out of rotation by itself: it counts toward ejection, and the health check
    decides. Leaving the block closes the response, which ends the backend's work on it if it is
    still generating.

    A class, not an asynccontextmanager: it runs once per request, and a generator-based one
    costs several times as much to enter and leave.
    """

    __slots__ = ("outcomes", "http", "runtime", "path", "payload", "request_id", "timeouts", "affinity", "raw",
                 "scope", "replica", "resp", "send", "slot")

    def __init__(self, outcomes: Outcomes, http: UpstreamHttp, runtime: ModelRuntime, path: str,
                 payload: dict[str, Any], request_id: str, timeouts: Timeouts, affinity: str | None = None,
                 raw: bytes | None = None, scope: str | None = None) -> None:
        self.outcomes, self.http, self.runtime, self.path = outcomes, http, runtime, path
        self.payload, self.request_id, self.timeouts = payload, request_id, timeouts
        self.affinity, self.raw, self.scope = affinity, raw, scope
        if scope is not None and affinity is not None:
            self.affinity = scoped(affinity, scope)   # routes and slots: two tenants' equal keys differ
        if "id_slot" in payload or "slot_id" in payload:
            self.payload, self.raw = {k: v for k, v in payload.items() if k not in CLIENT_SLOT_FIELDS}, None

    async def __aenter__(self) -> tuple[Replica, Answer]:
        outcomes, runtime, timeouts, affinity = self.outcomes, self.runtime, self.timeouts, self.affinity
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeouts.first_byte_s
        failed_over = False   # a request goes to a second replica once at most (below)
        # How long it may wait for its key's own replica while that one is full (affinity_max_wait_s).
        patience = loop.time() + runtime.max_wait_s()
        wait = Wait()

        def pick() -> Replica | None:
            wait.patient = loop.time() < patience
            return runtime.pick_replica(affinity, wait)

        for _attempt in range(len(runtime.replicas) + 1):
            try:
                replica = pick()
                while replica is None and runtime.ready() and loop.time() < deadline:
                    # Every READY replica already has target_inflight requests (one left READY with its
                    # requests still running there), or the key's own one has and is worth waiting for:
                    # wait for a place rather than overload one; a wait for the key's replica ends at
                    # `patience`, and the request then spills.
                    until = min(deadline, patience) if wait.patient else deadline
                    await runtime.wait_changed(max(0.0, until - loop.time()))
                    replica = pick()
            finally:
                runtime.stop_waiting(wait)   # it took a replica, timed out, or the client left
            if replica is None:
                break
            replica.inflight += 1
            replica.sent += 1
            send = Send()
            taken = False
            payload, raw, slot, slot_key, foreign = self.payload, self.raw, None, "", False
            if replica.slots is not None and (affinity is not None or self.scope is not None) and \
                    self.path in SLOT_PATHS:
                # The conversation's own llama-server slot there, whose cache it left (or a restore put)
                # there; with tenants, a request without a key takes its tenant's: proxy/lifecycle/state/slots.py.
                slot_key = affinity if affinity is not None else scoped("", self.scope or "")
                slot, foreign = replica.slots.take(slot_key)
                payload, raw = {**payload, "id_slot": slot}, with_slot(raw, payload, slot, foreign)
                if foreign:
                    payload["cache_prompt"] = False   # another tenant's cache: not to be reused
            try:
                try:
                    with Deadline(max(0.0, deadline - loop.time())):
                        resp = await _post(send, self.http, replica, self.path, payload, self.request_id, raw)
                except aiohttp.ClientConnectorError as exc:
                    outcomes.report_connection_failure(replica, f"{type(exc).__name__}: {exc}")
                    if send.second is None:
                        continue
                    # Refused on a new connection just after a reused one was dropped: the replica went
                    # away with this request on the wire, perhaps because of it. Only a process that is
                    # gone gives it to another replica, once, as below; a live one that stopped
                    # listening does not, so that a request that kills replicas cannot take them all down.
                    if not failed_over and process_gone(replica):
                        failed_over = True
                        continue
                    raise BackendError(f"{label(replica)} dropped the request: {type(exc).__name__}") from exc
                except asyncio.TimeoutError:
                    outcomes.report_outcome(replica, "no answer within first_byte_timeout_s")
                    raise BackendTimeout(f"{label(replica)} sent no answer within {timeouts.first_byte_s:g}s "
                                         "(first_byte_timeout_s)") from None
                except MalformedAnswer as exc:
                    # It answered, out of turn or out of bounds: nothing to send again, the replica's fault.
                    outcomes.report_outcome(replica, str(exc))
                    raise BackendError(f"{label(replica)} {exc}") from exc
                except (aiohttp.ClientError, OSError) as exc:
                    if not failed_over and process_gone(replica):
                        # Its process died with the request before any answer: nothing ran it to an
                        # end, so another replica may. Out of rotation until its health check passes.
                        outcomes.report_connection_failure(replica, f"its process exited ({type(exc).__name__})")
                        failed_over = True
                        continue
                    outcomes.report_outcome(replica, f"dropped the request: {type(exc).__name__}")
                    raise BackendError(f"{label(replica)} dropped the request: {type(exc).__name__}") from exc
                if resp.status == 503 and replica.spec is not None and not failed_over and \
                        any(r is not replica for r in runtime.ready()):
                    # A server of ours that is not serving (a restarted llama-server loading its
                    # model, a shim shutting down) did not take the request: another replica does,
                    # and this one stays out of rotation until its health check passes.
                    resp.close()
                    outcomes.report_connection_failure(replica, "answered 503 (not serving)")
                    failed_over = True
                    continue
                if foreign and resp.status == 200 and replica.slots is not None and slot is not None:
                    replica.slots.ran(slot, slot_key)
                self.replica, self.resp, self.send, self.slot = replica, resp, send, slot
                taken = True
                return replica, resp
            finally:
                if not taken:
                    await self._done(replica, send, slot)
        raise Unavailable(f"model {runtime.name!r} has no healthy replica right now", code="model_unavailable",
                          retry_after=2)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        # Closing the response (its own __aexit__) ends the backend's work on it if it is still generating.
        try:
            await self.resp.__aexit__(exc_type, exc, tb)
        finally:
            await self._done(self.replica, self.send, self.slot)

    async def _done(self, replica: Replica, send: Send, slot: int | None) -> None:
        self.runtime.release(replica)
        if slot is not None and replica.slots is not None:
            replica.slots.release(slot)
        if send.second is not None:
            await send.second.close()


def with_slot(raw: bytes | None, payload: dict[str, Any], slot: int, foreign: bool) -> bytes | None:
    """The client's bytes with the proxy's slot fields put before the object's end, so that they
    still go as they came instead of being decoded and encoded again; None where a field would be
    there twice (the reach then encodes `payload`). `raw` is one checked JSON object (strict_json)."""
    if raw is None or not payload or (foreign and "cache_prompt" in payload):
        return None
    end = raw.rfind(b"}")
    return raw[:end] + b',"id_slot":%d%s' % (slot, b',"cache_prompt":false' if foreign else b"") + raw[end:]


async def _post(send: Send, http: UpstreamHttp, replica: Replica, path: str, payload: dict[str, Any],
                request_id: str, raw: bytes | None) -> Answer:
    """Send to the replica; if that failed on a reused connection before any answer, once more on a
    new one. A server closes a kept-alive connection at its keep-alive timeout and (the pinned
    llama-server, measured) after every streamed answer; a pool can hand out such a connection
    before its close arrives, and a request written to it never reached the server. The second send
    gets a client of its own (`send.second`, closed by the caller), which never pools:
    only that is sure to open a new connection, and it is needed this rarely. A failure there is
    what it is (upstream() decides)."""
    assert replica.reach is not None
    token = SENDING.set(send)
    try:
        return await replica.reach.post(http, path, payload, request_id, UPSTREAM_TIMEOUT, raw)
    except CLOSED_UNDER_US as exc:
        if isinstance(exc, aiohttp.ClientConnectorError) or not send.reused:
            raise
        log.info("%s: a reused connection was closed under the request (%s); sending it again on a new one",
                 label(replica), type(exc).__name__)
    finally:
        SENDING.reset(token)
    send.second = UpstreamHttp.one_off()
    return await replica.reach.post(send.second, path, payload, request_id, UPSTREAM_TIMEOUT, raw)


async def forward(request: web.Request, runtime: ModelRuntime, key: str, body: dict[str, Any],
                  affinity: str | None = None, raw: bytes | None = None) -> web.StreamResponse:
    """Pass an OpenAI request through to a replica and its answer back, streams as they arrive.
    `key` is the request's fairness key, `affinity` its affinity key (proxy/serving/affinity_key.py);
    the proxy-only fields are dropped by the replica's reach. `raw`: the bytes `body` was read
    from, sent as they are where the reach changes nothing."""
    request_id = request.headers.get("X-Request-Id") or f"req_{os.urandom(16).hex()}"
    outcomes = request.app[POOL].outcomes
    strip = False
    if body.get("stream") is True and runtime.traits.usage_on_request and request.path in USAGE_ROUTES:
        # Asked for every stream, or a provider's is never counted; a client that did not ask
        # does not get it (the reach strips nothing: it is the relay's).
        asked = ask_usage(body, raw)
        if asked is not None:
            (body, raw), strip = asked, True
    cold = runtime.state != ModelState.LOADED   # it waits for its model to load (on demand)
    queued = runtime.admission.enqueue(key)
    enqueued = time.perf_counter()
    async with Slot(runtime, queued):
        waited = request[QUEUE_WAIT] = time.perf_counter() - enqueued
        request.app[METRICS].observe_wait(runtime.name, waited, cold)
        timeouts = Timeouts.of(request.app[SETTINGS].service, runtime.model)
        async with upstream(outcomes, request.app[HTTP], runtime, request.path, body, request_id,
                            timeouts, affinity, raw, request.get(CACHE_SCOPE)) as (replica, resp):
            request[REPLICA] = replica
            return await _relay(request, outcomes, replica, resp, request_id, timeouts, body, strip)


async def read_answer(outcomes: Outcomes, replica: Replica, resp: Answer, timeouts: Timeouts,
                      limit: int) -> bytes:
    """A non-streamed answer, whole, within service.max_response_bytes; a backend error (5xx, or an
    answer that is not JSON) is raised as an OpenAI error and counted against the replica, unless it
    is a 500 to input only the engine could judge (relay.ENGINE_JUDGES_INPUT): the client's 400."""
    try:
        raw = await read_capped(resp, timeouts, limit, label(replica))
    except (PoolError, aiohttp.ClientError) as exc:
        reason = exc.message if isinstance(exc, PoolError) else f"broke off its answer: {type(exc).__name__}"
        outcomes.report_outcome(replica, reason)
        if isinstance(exc, PoolError):
            raise
        raise BackendError(f"{label(replica)} {reason}") from exc
    content_type = resp.headers.get("Content-Type", "")
    if resp.status == 500 and ENGINE_JUDGES_INPUT.get():
        # The engine failed on what the client sent (a request only it could check): the client's 400,
        # and the replica answered as it should have.
        outcomes.report_outcome(replica, None)
        raise input_refused(resp.status, raw, label(replica))
    if resp.status >= 400 or "json" not in content_type:
        outcomes.report_outcome(replica, f"HTTP {resp.status}" if resp.status >= 500 else None)
        raise backend_error(resp.status if resp.status >= 400 else 502, raw, label(replica),
                            retry_after=resp.headers.get("Retry-After"))
    outcomes.report_outcome(replica, None)
    return raw


async def _relay(request: web.Request, outcomes: Outcomes, replica: Replica, upstream: Answer,
                 request_id: str, timeouts: Timeouts, body: dict[str, Any], strip: bool) -> web.StreamResponse:
    """The answer back to the client, a stream as it arrives; `strip`: keep the usage chunk, which
    the proxy asked for, from the client. Whatever way a stream ends, its usage is set before this
    returns or raises (proxy/serving/stream_usage.py)."""
    content_type = upstream.headers.get("Content-Type", "application/json")
    metrics = request.app[METRICS]
    if not content_type.startswith("text/event-stream") or upstream.status != 200:
        limit = request.app[SETTINGS].service.max_response_bytes
        answer = await read_answer(outcomes, replica, upstream, timeouts, limit)
        request[USAGE] = metrics.count_usage(replica.model, metrics.key_label(request.get(FAIRNESS_KEY)),
                                             usage_in(answer), replica)
        return web.Response(status=upstream.status, body=answer, headers={
            "Content-Type": content_type, "X-Request-Id": request_id, REPLICA_HEADER: str(replica.index)})
    out = web.StreamResponse(status=upstream.status, headers={
        "Content-Type": content_type, "Cache-Control": "no-cache", "X-Request-Id": request_id,
        REPLICA_HEADER: str(replica.index)})
    await out.prepare(request)
    tally = Tally(request.path)
    splice = Splice(request, out, outcomes, replica, body, strip, tally)
    watch = stream_watch(upstream, timeouts, label(replica))
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
                metrics.child(metrics.ttft, replica.model, request.path).observe(time.perf_counter() - request[STARTED])
                if request.path == MESSAGES_ROUTE and _opens_without_message_start(chunk):
                    # llama-server leaves it out now and then (13% of short streams, measured), and
                    # Anthropic's SDK then has no message to give: it gets the one its translation sends.
                    piece = message_start(replica.model, f"msg_{request_id}") + piece
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
                if not await _spliced(request, upstream, splice, timeouts, label(replica)):
                    return out   # the client left
                break
    except (BackendTimeout, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
        upstream.close()
        err = exc if isinstance(exc, PoolError) else \
            BackendError(f"{label(replica)} broke off the stream: {type(exc).__name__}")
        if tally.ended:
            # The backend closed badly after its last event: the client has the whole answer.
            log.info("%s %s: %s after the end of its stream", request.method, request.path, err.message)
        else:
            log.warning("%s %s: %s", request.method, request.path, err.message)
            request[STREAM_ERROR] = err.metric_code
            outcomes.report_outcome(replica, err.message)
            with contextlib.suppress(ConnectionResetError):
                await out.write(error_event(err, request.path))
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out
    finally:
        watch.close()
        if not tally.settled:
            tally.events = splice.events
            # Ended early (the client left, the handler was cancelled, the backend broke off) or
            # without an end marker: what went out is counted.
            tally.settle(request, replica, body, splice.tail())
    if not tally.ended:
        outcomes.report_outcome(replica, None)
    with contextlib.suppress(ConnectionResetError):
        await out.write_eof()   # a client that closed once it had everything: still a success
    return out


def _opens_without_message_start(first: bytes) -> bool:
    """Whether an Anthropic stream's first read begins with a whole event line that is not message_start."""
    line, newline, _ = first.partition(b"\n")
    return bool(newline) and line.startswith(b"event:") and line[6:].strip() != b"message_start"


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
