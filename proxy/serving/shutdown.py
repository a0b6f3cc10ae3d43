"""Stopping without refusing a connection: the proxy's state between a stop signal and its exit.

aiohttp's run_app closes the listening sockets first, then waits for the requests in flight and
runs the cleanup that unloads every model: for that whole time a client, or a load balancer's
health check, met a closed port (curl `000`) and could not tell a stopping proxy from a dead one.
Instead the listeners stay open until the models are unloaded (app.serve): new work is answered
503 `shutting_down` with Retry-After, reads (GET, HEAD: /health, /ready, /metrics, the admin views)
are still answered, and the requests that were in flight finish.

A reload (SIGUSR1, proxy/serving/reload.py) ends a process differently: once its successor took
over, it is `handed_over`. Nothing is refused then (the successor serves the same port): what
still comes on its open connections is answered as usual, with `Connection: close`, while its
requests in flight finish; but for an admin's action and /metrics (the counters are the
successor's to show now: routes_public.metrics), answered 503 so that the client asks again.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler

from proxy.errors import Unavailable
from proxy.serving.errors_http import error_response

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Reads are answered while stopping: an admin or a monitor watches the shutdown through them.
READS = ("GET", "HEAD")
ADMIN_PREFIX = "/v1/admin/"


class Shutdown:
    """Whether the proxy is stopping, whether it leaves the models running, and how many requests
    are in flight. The event loop is its only writer."""

    def __init__(self, keep_models: bool, successor: bool = False) -> None:
        # --keep-models; a handover keeps them too, and so does a reload's successor until it took
        # over (they are its predecessor's until then).
        self.keep_models = keep_models or successor
        self._keep_by_choice = keep_models
        self._successor_pending = successor
        self._stop_while_pending: signal.Signals | None = None
        self.started = False
        # A reload's successor took over: this process finishes and exits, keeping the models.
        self.handed_over = False
        self.requested = asyncio.Event()
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.pool_released = False

    @property
    def succeeding(self) -> bool:
        """A reload's successor that has not been handed the service yet."""
        return self._successor_pending

    def on_signal(self, sig: signal.Signals) -> None:
        """SIGINT, SIGTERM: stop, and unload the models unless they are kept.
        A later signal is ignored: the unload is bounded by each program's stop wait, so it is let
        finish, and the way out is said plainly."""
        if self._successor_pending:
            # Not the proxy yet: its predecessor serves on. It stops accepting and exits as a
            # handed-over process does, refusing nothing; should it be handed the service meanwhile,
            # the stop is carried out as the proxy's (took_over).
            log.warning("%s before this reload's successor took over: it exits, leaving the service to pid %d",
                        sig.name, os.getppid())
            self._stop_while_pending = sig
            self.hand_over()
            return
        if self.handed_over:
            log.warning("%s ignored: this process handed the service over and is finishing its requests; the "
                        "models stay with its successor", sig.name)
            return
        if self.started:
            log.warning("%s ignored: already shutting down (%s); SIGKILL would leave supervisord and the "
                        "models running for the next serve to adopt", sig.name,
                        "keeping the models" if self.keep_models else "unloading the models")
            return
        self.begin()

    def took_over(self) -> None:
        """A reload's successor was handed the service: its models now go the way --keep-models says,
        and a stop signal that came just before is a stop of the proxy (systemd's, say)."""
        self._successor_pending = False
        self.keep_models = self._keep_by_choice
        if self._stop_while_pending is not None:
            self.handed_over = False
            log.info("%s came as this process took over: stopping", self._stop_while_pending.name)
            self.begin()

    def hand_over(self) -> None:
        """The successor took over (proxy/serving/reload.py): finish what runs, keep the models, exit."""
        self.handed_over = True
        self.keep_models = True
        self.requested.set()

    def begin(self) -> None:
        if self.started:
            return
        self.started = True
        log.info("shutting down: new requests are answered 503 shutting_down, requests in flight finish, "
                 "then the models are %s", "left running" if self.keep_models else "unloaded")
        self.requested.set()

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, up to `timeout_s`; False if some still were."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()


SHUTDOWN = web.AppKey("shutdown", Shutdown)


def stopping_error() -> Unavailable:
    return Unavailable("llm-pool is shutting down: it finishes the requests in flight and takes no new ones; "
                       "send this one again later, or to another instance", code="shutting_down")


def handed_over_error() -> Unavailable:
    """What a handed-over process cannot do itself (an admin action, loading a model): the same
    port reaches its successor, on a new connection."""
    return Unavailable("llm-pool reloaded: this connection reached the old process, which only finishes what "
                       "it serves; send this again (a new connection reaches the new one)", code="shutting_down",
                       retry_after=1)


async def close_after_handover(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: once handed over, every answer ends its connection, so that the
    client's next request opens a new one, which the successor accepts."""
    if request.app[SHUTDOWN].handed_over:
        response.force_close()
        response.headers[hdrs.CONNECTION] = "close"


@web.middleware
async def shutdown_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse new work once stopping (503 shutting_down, and the connection is closed after the
    answer, so a client's pool reconnects, maybe elsewhere); count what runs, for the drain."""
    shutdown = request.app[SHUTDOWN]
    if request.method not in READS and (shutdown.started or shutdown.handed_over and
                                         request.path.startswith(ADMIN_PREFIX)):
        # Handed over, an admin's action is the successor's to take: this process changes nothing now.
        response = error_response(handed_over_error() if shutdown.handed_over else stopping_error(), request.path)
        response.force_close()
        return response
    shutdown.enter()
    try:
        return await handler(request)
    finally:
        shutdown.leave()
