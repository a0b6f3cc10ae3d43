"""OpenAI-compatible pass-through: take a slot, pick a replica, forward, stream back as it arrives."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from types import TracebackType
from typing import Any, Awaitable, Hashable, cast

import aiohttp
from aiohttp import web

from proxy.config.model import Adapter
from proxy.errors import BackendError, BackendTimeout, PoolError, Unavailable
from proxy.lifecycle import adapters
from proxy.lifecycle.state.affinity import Wait
from proxy.lifecycle.state.outcomes import Outcomes, process_gone
from proxy.lifecycle.state.replicas import ModelState, Replica
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.lifecycle.state.slots import cache_scope, scoped
from proxy.upstream.client import Answer, NotingConnector, Send, UpstreamHttp, post_retrying
from proxy.upstream.connection import MalformedAnswer
from proxy.upstream.reach import ProgramReach
from proxy.lease_wire import RELAYED_HEADER
from proxy.serving.affinity_key import SLOT_PATHS
from proxy.serving.body import priority_class
from proxy.serving.leases import LESSEE, LeasedAnswer, LeaseHttp, WorkerGone
from proxy.serving.keys import (ADAPTER, CACHE_SCOPE, ENGINE_SLOT, FAIRNESS_KEY, HTTP, METRICS, POOL, QUEUE_WAIT,
                                REPLICA, REPLICA_HEADER, SETTINGS, STARTED, STREAM_ERROR, USAGE)
from proxy.edge.response_metrics import usage_in
from proxy.edge.relay import ENGINE_JUDGES_INPUT, Deadline, Timeouts, backend_error, input_refused, read_capped
from proxy.edge.stream_count import Tally
from proxy.edge.stream_relay import missing_message_start, relay_stream
from proxy.serving.slot_reuse import note_reuse
from proxy.serving.stream_usage import USAGE_ROUTES, ask_usage, mark_ended, settle_tally

log = logging.getLogger(__name__)

# Only connecting is bounded here; waiting for the answer is bounded by the model's Timeouts.
UPSTREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5)
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
                 "scope", "lease", "adapter", "replica", "resp", "send", "slot")

    def __init__(self, outcomes: Outcomes, http: UpstreamHttp, runtime: ModelRuntime, path: str,
                 payload: dict[str, Any], request_id: str, timeouts: Timeouts, affinity: str | None = None,
                 raw: bytes | None = None, scope: str | None = None, lease: LeaseHttp | None = None,
                 adapter: Adapter | None = None) -> None:
        self.outcomes, self.http, self.runtime, self.path = outcomes, http, runtime, path
        self.payload, self.request_id, self.timeouts = payload, request_id, timeouts
        # The model's LoRA adapter that runs it (docs/adapters.md); a prefix cached under one adapter
        # is no prefix under another, nor under the base: the adapter is part of the cache's scope,
        # so its routes and slots are its own, and the base's requests too take a slot of the table.
        self.adapter = adapter
        scope = cache_scope(scope, adapter.name if adapter is not None else None, bool(runtime.model.adapters))
        self.affinity, self.raw, self.scope = affinity, raw, scope
        # A worker's request (proxy/serving/leases.py): a server of ours gets the send from that
        # worker; a provider's reach, which is no plain POST, is sent from here.
        self.lease = lease
        if scope is not None and affinity is not None:
            self.affinity = scoped(affinity, scope)   # routes and slots: two tenants' (adapters') equal keys differ
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
                    payload["cache_prompt"] = False   # another tenant's (adapter's) cache: not to be reused
            http = self.http
            adapter = self.adapter
            if adapter is not None and not replica.holds(adapter.name):
                try:
                    await adapters.load(http, replica, adapter)   # an admin unloaded it there (vLLM)
                except BaseException:
                    await self._done(replica, send, slot)
                    raise
            if self.lease is not None and isinstance(replica.reach, ProgramReach):
                self.lease.at(replica.index, replica.model, label(replica))
                http = cast(UpstreamHttp, self.lease)
            try:
                try:
                    with Deadline(max(0.0, deadline - loop.time())):
                        resp = await _post(send, http, replica, self.path, payload, self.request_id, raw,
                                           adapter.name if adapter is not None else None)
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


def _post(send: Send, http: UpstreamHttp, replica: Replica, path: str, payload: dict[str, Any],
          request_id: str, raw: bytes | None, adapter: str | None = None) -> Awaitable[Answer]:
    """Send to the replica; once more on a new connection where a reused one was closed under it."""
    reach = replica.reach
    assert reach is not None
    return post_retrying(send, http, lambda h: reach.post(h, path, payload, request_id, UPSTREAM_TIMEOUT, raw, adapter),
                         label(replica))


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
    queued = runtime.admission.enqueue(key, priority_class(request, runtime.policy))
    enqueued = time.perf_counter()
    async with Slot(runtime, queued):
        waited = request[QUEUE_WAIT] = time.perf_counter() - enqueued
        request.app[METRICS].observe_wait(runtime.name, waited, cold)
        service = request.app[SETTINGS].service
        timeouts = Timeouts.of(service, runtime.model)
        # A stream from a worker is relayed by that worker (proxy/serving/leases.py). A whole answer
        # is relayed from here: a worker's send would bring it here all the same, for its checks
        # and its usage, at more cost (measured: tests/bench/bench_proxy_overhead.py).
        lessee = request.get(LESSEE) if body.get("stream") is True else None
        lease = lessee.http(request_id, strip, service.max_response_bytes, timeouts.first_byte_s, timeouts.idle_s) \
            if lessee is not None else None
        sent = upstream(outcomes, request.app[HTTP], runtime, request.path, body, request_id,
                        timeouts, affinity, raw, request.get(CACHE_SCOPE), lease, request.get(ADAPTER))
        async with sent as (replica, resp):
            request[REPLICA] = replica
            if sent.slot is not None:
                request[ENGINE_SLOT] = sent.slot
            if isinstance(resp, LeasedAnswer) and resp.streaming:
                return await _leased(request, outcomes, replica, resp, body, request_id)
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
    if not content_type.startswith("text/event-stream") or upstream.status != 200:
        limit = request.app[SETTINGS].service.max_response_bytes
        answer = await read_answer(outcomes, replica, upstream, timeouts, limit)
        metrics = request.app[METRICS]
        usage = usage_in(answer)
        request[USAGE] = metrics.count_usage(replica.model, metrics.key_label(request.get(FAIRNESS_KEY)), usage,
                                             replica)
        note_reuse(request, replica, usage)
        return web.Response(status=upstream.status, body=answer, headers={
            "Content-Type": content_type, "X-Request-Id": request_id, REPLICA_HEADER: str(replica.index)})
    headers = {"Content-Type": content_type, "Cache-Control": "no-cache", "X-Request-Id": request_id,
               REPLICA_HEADER: str(replica.index)}
    return await relay_stream(request, upstream, timeouts, PoolEnd(request, outcomes, replica, body, request_id),
                              strip, headers)


async def _leased(request: web.Request, outcomes: Outcomes, replica: Replica, answer: LeasedAnswer,
                  body: dict[str, Any], request_id: str) -> web.StreamResponse:
    """A stream its worker relayed (proxy/serving/leases.py), counted from the worker's report as
    one relayed here: the same PoolEnd, told what the worker's was told."""
    end = PoolEnd(request, outcomes, replica, body, request_id)
    tally = Tally(request.path)
    out = web.Response(status=answer.status, headers={RELAYED_HEADER: "1"})
    try:
        try:
            report, edges = await answer.ended()
        except WorkerGone as exc:
            # What went out before it died is unknown: the prompt is charged, as an estimate.
            log.warning("%s %s: %s; its stream is lost", request.method, request.path, exc)
            return out
        head = report.get("head")
        at = head if isinstance(head, int) and 0 <= head <= len(edges) else 0
        tally.head, tail = edges[:at], edges[at:]
        events = report.get("events")
        tally.events = events if isinstance(events, int) and events >= 0 else 0
        ttft = report.get("ttft")
        if isinstance(ttft, (int, float)) and ttft >= 0:
            end.first_after(float(ttft))
        error = report.get("error")
        if report.get("ended") is True:
            tally.ended = True
            end.ended(tally, tail, out)
        elif isinstance(error, dict):
            err = PoolError(str(error.get("message")), code=str(error.get("code")))
            log.warning("%s %s: %s", request.method, request.path, err.message)
            end.broke(err)
        elif report.get("whole") is True:
            end.whole()
        if not tally.settled:
            end.settle(tally, tail)
    finally:
        if not tally.settled:
            end.settle(tally, b"")   # the worker is gone, or this request was cancelled: the prompt still counts
    return out


class PoolEnd:
    """What a relayed stream's course means to the pool (stream_relay.StreamEnd): the replica's
    outcome, the request's usage and time to first token, and its metrics' error code."""

    __slots__ = ("request", "outcomes", "replica", "body", "request_id", "label")

    def __init__(self, request: web.Request, outcomes: Outcomes, replica: Replica, body: dict[str, Any],
                 request_id: str) -> None:
        self.request, self.outcomes, self.replica, self.body = request, outcomes, replica, body
        self.request_id, self.label = request_id, label(replica)

    def first(self, chunk: bytes) -> bytes:
        request = self.request
        self.first_after(time.perf_counter() - request[STARTED])
        return missing_message_start(request.path, chunk, self.replica.model, self.request_id)

    def first_after(self, seconds: float) -> None:
        metrics = self.request.app[METRICS]
        metrics.child(metrics.ttft, self.replica.model, self.request.path).observe(seconds)

    def ended(self, tally: Tally, tail: bytes, out: web.StreamResponse) -> None:
        self.outcomes.report_outcome(self.replica, None)
        settle_tally(tally, self.request, self.replica, self.body, tail)
        mark_ended(self.request, out)

    def broke(self, err: PoolError) -> None:
        self.request[STREAM_ERROR] = err.metric_code
        self.outcomes.report_outcome(self.replica, err.message)

    def settle(self, tally: Tally, tail: bytes) -> None:
        settle_tally(tally, self.request, self.replica, self.body, tail)

    def whole(self) -> None:
        self.outcomes.report_outcome(self.replica, None)
