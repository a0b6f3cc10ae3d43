"""Stopping without refusing a connection: the proxy's state between a stop signal and its exit.

aiohttp's run_app closes the listening sockets first, then waits for the requests in flight and
runs the cleanup that unloads every model: for that whole time a client, or a load balancer's
health check, met a closed port (curl `000`) and could not tell a stopping proxy from a dead one.
Instead the listeners stay open until the models are unloaded (app.serve): new work is answered
503 `shutting_down` with Retry-After, reads (GET, HEAD: /health, /ready, /metrics, the admin views)
are still answered, and the requests that were in flight finish.
"""
from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.errors import Unavailable
from proxy.serving.errors_http import error_response

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# Reads are answered while stopping: an admin or a monitor watches the shutdown through them.
READS = ("GET", "HEAD")


class Shutdown:
    """Whether the proxy is stopping, whether it leaves the models running, and how many requests
    are in flight. The event loop is its only writer."""

    def __init__(self, keep_models: bool) -> None:
        # --keep-models from the start; SIGUSR1 decides it at exit (the systemd unit's reload).
        self.keep_models = keep_models
        self.started = False
        self.requested = asyncio.Event()
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.pool_released = False

    def on_signal(self, sig: signal.Signals) -> None:
        """SIGINT, SIGTERM: stop and unload the models; SIGUSR1: stop and leave them running.
        A later signal is ignored: the unload is bounded by each program's stop wait, so it is let
        finish, and the way out is said plainly."""
        if self.started:
            log.warning("%s ignored: already shutting down (%s); SIGKILL would leave supervisord and the "
                        "models running for the next serve to adopt", sig.name,
                        "keeping the models" if self.keep_models else "unloading the models")
            return
        if sig == signal.SIGUSR1:
            log.info("SIGUSR1: exiting, leaving supervisord and the models running for the next proxy")
            self.keep_models = True
        self.begin()

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


@web.middleware
async def shutdown_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse new work once stopping (503 shutting_down, and the connection is closed after the
    answer, so a client's pool reconnects, maybe elsewhere); count what runs, for the drain."""
    shutdown = request.app[SHUTDOWN]
    if shutdown.started and request.method not in READS:
        response = error_response(stopping_error())
        response.force_close()
        return response
    shutdown.enter()
    try:
        return await handler(request)
    finally:
        shutdown.leave()
