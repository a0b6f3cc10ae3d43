"""The aiohttp application: routes, middleware, the pool's lifetime in cleanup_ctx, and serving it
on its listeners until a stop signal (`serve`)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from typing import IO, Any, AsyncIterator, Callable, Sequence

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from proxy.supervisord import managed
from proxy.serving import openapi
from proxy.serving import routes_admin
from proxy.serving import routes_public
from proxy.serving import routes_messages
from proxy.serving import routes_responses
from proxy.serving import routes_ollama
from proxy.serving import routes_tenants
from proxy.serving import routes_batches
from proxy.serving import ui
from proxy.config.settings import Settings
from proxy.errors import NotFound
from proxy.event_journal import EVENTS_FILE, EventJournal
from proxy.events import RELOAD
from proxy.serve_address import ServeAddress, remove_address, write_address
from proxy.serving.edge_guard import edge_guard_middleware
from proxy.batches.store import BatchStore
from proxy.fairness import FairnessPolicy
from proxy.serving.batch_runner import BATCHES, BatchRunner
from proxy.serving.errors_http import ERROR_CODE, error_middleware
from proxy.serving.fallbacks import model_header
from proxy.serving.forward import upstream_session
from proxy.serving.carried import parse, seed
from proxy.serving.handover import COUNTERS, EVENT, Inherited, Succession
from proxy.serving.keys import (ADAPTER, ADOPTING, FAIRNESS_KEY, HTTP, METRICS, MODEL, ON_ADMIN_LISTENER, POOL,
                                SETTINGS, STARTED, STREAM_ENDED, STREAM_ERROR, VOCABULARIES, VRAM)
from proxy.serving.metrics import ProxyMetrics
from proxy.serving.leases import LeaseDesk, lease_middleware
from proxy.serving.tenancy import TENANCY, Tenancy
from proxy.serving.workers import PROCESSES, Plane, Processes
from proxy.serving.vocabulary import Vocabularies
from proxy.serving.reload import Reloader
from proxy.serving.sd_notify import notify
from proxy.serving.shutdown import SHUTDOWN, STOP_SIGNALS, Shutdown, close_after_handover, shutdown_middleware
from proxy.supervisord.orphans import PidRecord
from proxy.lifecycle.pool import Pool
from proxy.supervisord.supervisor import SupervisorClient
from proxy.gpu.vram_estimate import Estimator

log = logging.getLogger(__name__)
STRAGGLERS_WAIT_S = 5.0
KEEPALIVE_TIMEOUT_S = 75.0
# A reload's old process closes a connection left idle this long after the handover.
IDLE_CLOSE_S = 2.0


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count and time every request that reached a served model, with its final status and error code."""
    started = time.perf_counter()
    request[STARTED] = started
    status = "cancelled"
    response: web.StreamResponse | None = None
    try:
        response = await handler(request)
        status = str(response.status)
        return response
    finally:
        ended = request.get(STREAM_ENDED)
        if response is None and ended is not None:
            # Its stream went out whole and the client closed before the handler returned, or
            # before the stream's last write: a success, not the client's cancellation.
            response, status = ended, str(ended.status)
        model = request.get(MODEL)
        if model is not None:
            metrics = request.app[METRICS]
            took = time.perf_counter() - started
            metrics.child(metrics.requests, model, request.path, status, _error_code(request, response),
                          metrics.key_label(request.get(FAIRNESS_KEY))).inc()
            metrics.child(metrics.latency, model, request.path).observe(took)
            adapter = request.get(ADAPTER)
            if adapter is not None:
                metrics.child(metrics.adapter_requests, model, adapter.name, status).inc()
            tenancy = request.app.get(TENANCY)
            if tenancy is not None:
                try:
                    tenancy.finished(request, request.app[POOL].models[model], response.status if response else 499,
                                     took)
                except Exception:
                    # The answer went out: a failure of the bookkeeping must not replace it.
                    log.exception("the usage of %s %s was not recorded", request.method, request.path)


def _error_code(request: web.Request, response: web.StreamResponse | None) -> str:
    """"" for a success; else the error's code for the metrics (PoolError.metric_code), recorded
    where the error was answered, or read from a small error body built elsewhere."""
    failed = request.get(STREAM_ERROR) or request.get(ERROR_CODE)
    if failed is not None:
        return str(failed)
    if response is None or response.status < 400 or not isinstance(response, web.Response) or \
            not isinstance(response.body, bytes):
        return ""
    try:
        error = json.loads(response.body).get("error")
        code = error.get("code") if isinstance(error, dict) else None
    except (ValueError, AttributeError, RecursionError):
        code = None
    return code if isinstance(code, str) and code else "unknown"


def admin_listener_middleware(admin_port: int) -> Any:
    """With service.admin_port, the admin API and its status page (/ui) answer on that listener only,
    and nothing else does (but /health and /ready, which show failure reasons there only): a public
    port that never routes /v1/admin/* cannot expose it by mistake."""
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        on_admin = isinstance(sockname, tuple) and sockname[1] == admin_port
        request[ON_ADMIN_LISTENER] = on_admin
        admin_path = request.path.startswith("/v1/admin/") or ui.is_ui_path(request.path)
        if admin_path != on_admin and request.path not in ("/health", "/ready"):
            raise NotFound(f"no route {request.path} on this listener", code="not_found")
        return await handler(request)
    return middleware


def create_app(settings: Settings, *, keep_models: bool = False, successor: bool = False) -> web.Application:
    """The proxy app. When it stops it unloads every model and, in managed mode, stops supervisord,
    unless `keep_models`: then both keep running for the next proxy to adopt.

    `successor`: started by a reloading proxy, which still serves the same replicas until this one
    took over and it has exited (Pool.predecessor_gone). See `serve`."""
    # metrics outside errors: it sees the status the error middleware rendered.
    middlewares: list[Middleware] = [metrics_middleware, shutdown_middleware, error_middleware]
    if settings.service.admin_port is not None:
        middlewares.append(admin_listener_middleware(settings.service.admin_port))
    if not settings.tenants:
        # Without keys, the data plane is out of a browser's reach as the admin API is.
        middlewares.append(edge_guard_middleware(settings.service))
    desk = LeaseDesk() if settings.service.workers > 1 else None
    if desk is not None:
        middlewares.append(lease_middleware(desk))
    app = web.Application(client_max_size=settings.service.max_body_bytes, middlewares=middlewares)
    app[SETTINGS] = settings
    app[PROCESSES] = Processes()
    if desk is not None:
        app[PROCESSES].plane = Plane(settings.service.workers, desk)
    app[METRICS] = ProxyMetrics()
    app[VRAM] = Estimator()
    app[VOCABULARIES] = Vocabularies()
    app[SHUTDOWN] = Shutdown(keep_models, successor=successor)
    app.on_response_prepare.append(close_after_handover)
    app.on_response_prepare.append(model_header)
    app.add_routes(routes_public.routes)
    app.add_routes(routes_admin.routes)
    app.add_routes(routes_responses.routes)
    app.add_routes(routes_ollama.routes)
    app.add_routes(routes_messages.routes)
    app.add_routes(routes_tenants.routes)
    if settings.batches.enabled:
        app.add_routes(routes_batches.routes)
    app.add_routes(ui.routes)
    app.add_routes(openapi.routes)

    async def pool_ctx(app: web.Application) -> AsyncIterator[None]:
        http = upstream_session()
        # mode `hosts`: no supervisord on this machine; the client is never called (no local host).
        supervisor = SupervisorClient(settings.supervisor_url, timeout=settings.supervisor.rpc_timeout_s)
        try:
            if settings.supervisor.mode == "managed":
                if await managed.ensure_supervisord(settings, supervisor):
                    log.info("started supervisord: supervisorctl -c %s status", managed.conf_path(settings))
            managed_mode = settings.supervisor.mode == "managed"
            pool = Pool(settings, supervisor, http,
                        pid_record=PidRecord(settings.service.state_dir) if managed_mode else None,
                        managed=managed.ManagedSupervisord(settings, supervisor) if managed_mode else None)
            if successor:
                pool.predecessor_gone.clear()   # and the events journal is its predecessor's until it took over
            else:
                continue_events(pool)
            await pool.start()
            app[ADOPTING] = pool.adopting()
        except BaseException:
            await supervisor.close()
            await http.close()
            raise
        app[POOL] = pool
        app[HTTP] = http
        app[METRICS].watch(pool)
        pool.load_in_background()
        yield
        try:
            await release_pool(app)
        finally:
            pool.events.close()
            await supervisor.close()
            await http.close()

    app.cleanup_ctx.append(pool_ctx)
    if settings.tenants:
        app.cleanup_ctx.append(tenancy_ctx)
    if settings.batches.enabled:
        app.cleanup_ctx.append(batches_ctx)
    return app


async def batches_ctx(app: web.Application) -> AsyncIterator[None]:
    """The Batch API's files and batches (docs/batches.md); `serve` starts running them once it listens."""
    settings = app[SETTINGS]
    store = await asyncio.to_thread(BatchStore, settings.service.state_dir / "batches",
                                    settings.batches.max_storage_bytes)
    app[BATCHES] = BatchRunner(app, store, settings.batches, app[POOL], FairnessPolicy.from_settings(settings.fairness))
    yield
    try:
        await app[BATCHES].close()
    finally:
        store.close()


async def tenancy_ctx(app: web.Application) -> AsyncIterator[None]:
    """The tenants' keys and ledger (docs/tenants.md), for as long as the app runs."""
    pool = app[POOL]
    tenancy = await asyncio.to_thread(Tenancy.open, app[SETTINGS], os.environ, app[METRICS].registry,
                                      pool.predecessor_gone)
    app[TENANCY] = tenancy
    watch = asyncio.create_task(tenancy.watch(pool.events), name="usage ledger watch")
    yield
    watch.cancel()
    await asyncio.gather(watch, return_exceptions=True)
    await asyncio.to_thread(tenancy.close)


async def release_pool(app: web.Application) -> None:
    """Unload every model and stop supervisord (managed mode), or leave both running when the
    models are kept. Once: `serve` calls it while the listeners still answer, the app's cleanup
    again (then a no-op) for any other way the app ends."""
    shutdown = app[SHUTDOWN]
    if shutdown.pool_released:
        return
    shutdown.pool_released = True
    pool, keep = app[POOL], shutdown.keep_models
    if not keep and not pool.predecessor_gone.is_set():
        # Stopped just after a reload: the old process may still finish requests on these models.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(app[SETTINGS].service.drain_timeout_s + STRAGGLERS_WAIT_S):
                await pool.predecessor_gone.wait()
    await pool.close(stop_models=not keep)
    await pool.close_nodes()
    if app[SETTINGS].supervisor.mode == "managed" and not keep:
        await managed.stop_supervisord(pool.supervisor)
        # A supervisord that died (and could not be started again) stopped nothing: what it left
        # running is stopped by its recorded PIDs, so that nothing outlives the proxy.
        await managed.stop_orphans_if_dead(app[SETTINGS])


async def serve(app: web.Application, socks: Sequence[socket.socket], on_listening: Callable[[], None],
                lock: IO[str] | None = None, inherited: Inherited | None = None, loop_name: str = "asyncio") -> None:
    """Serve `app` on `socks` until SIGINT or SIGTERM; then, with the listeners still open and
    answering new work 503 shutting_down (proxy/serving/shutdown.py), let the requests in flight
    finish (up to service.drain_timeout_s), unload the models (or keep them, with --keep-models),
    and only then close the listeners.

    SIGUSR1 reloads (proxy/serving/reload.py, given the state folder's `lock`): a successor takes
    over and this process ends as `_finish_handed_over` says. `inherited`: this process is such a
    successor; it starts accepting once it has adopted the running replicas, and takes over.

    With service.workers > 1, socks[0] (the public listener) is the workers' (proxy/serving/workers.py):
    this process, their controller, serves them on its own socket and the admin listener itself."""
    shutdown = app[SHUTDOWN]
    plane = app[PROCESSES].plane
    loop = asyncio.get_running_loop()
    reloader = Reloader(app, socks, lock) if lock is not None else None
    # Before the startup (supervisord, the pool): a signal then stops the proxy the same way.
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, shutdown.on_signal, sig)
    loop.add_signal_handler(signal.SIGUSR1, reloader.request if reloader is not None else _no_reload)
    # handler_cancellation: a client that disconnects cancels its handler, which closes the
    # upstream request so the backend stops generating for nobody. shutdown_timeout: what is still
    # running when the listeners close outlived the drain and lost its model; it is not waited for long.
    # keepalive_timeout: run_app's, not the runner's hour-long default.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=STRAGGLERS_WAIT_S,
                           keepalive_timeout=KEEPALIVE_TIMEOUT_S)
    watching: asyncio.Task[None] | None = None
    await runner.setup()
    try:
        succession = Succession(inherited) if inherited is not None else None
        if succession is not None:
            # Not accepting before: the predecessor serves everything meanwhile, and a successor
            # that fails now has taken no connection with it.
            await _until_adopted(app)
        if not shutdown.requested.is_set():
            sites = [web.SockSite(runner, sock) for sock in (socks[1:] if plane is not None else socks)]
            for site in sites:
                await site.start()
            app[PROCESSES].server = runner.server
            if plane is not None:
                service = app[SETTINGS].service
                await plane.start(runner, list(socks[:1]), service.log_level, loop_name, service.drain_timeout_s,
                                  app[POOL].events, (inherited.stdout_fd, inherited.stderr_fd) if inherited else None)
            on_listening()
            if succession is None:
                notify("READY=1", f"STATUS=serving (pid {os.getpid()})")
                _record_address(app, socks, lock)
            elif await succession.take_over():
                if plane is not None:
                    plane.output_switched()
                # Before anything else reads them: the counters and the events go on from the predecessor's.
                counters = parse(succession.counters)
                app[METRICS].carried.carry(counters)
                seed(app[POOL].models, counters)
                continue_events(app[POOL])
                shutdown.took_over()
                app[POOL].events.record(RELOAD, f"reload: took over from pid {succession.inherited.predecessor}; "
                                        f"pid {os.getpid()} serves now", reason="took_over")
                if lock is not None:
                    managed.record_owner(lock)
                _record_address(app, socks, lock)
                watching = asyncio.create_task(_follow(succession, app))
            else:
                # Never handed the service (called off as it got ready): the predecessor serves on,
                # so this one stops accepting at once and ends as a handed-over process does.
                shutdown.hand_over()
            if reloader is not None:
                reloader.serving = True   # a successor reloads in turn once it is the proxy
            batches = app.get(BATCHES)
            if batches is not None and not shutdown.handed_over:
                batches.start(_own_url(socks[0]))
            await shutdown.requested.wait()
            if batches is not None:
                batches.stop_claiming()   # its lines in flight end in the drain, as every request
            if reloader is not None:
                await reloader.cancel()   # a stop signal during a reload: the successor goes first
            if shutdown.handed_over:
                await _finish_handed_over(app, runner, sites, socks)
                if reloader is not None:
                    await reloader.finish()   # drained: what its requests counted goes to the successor
                return
        drain_timeout_s = app[SETTINGS].service.drain_timeout_s
        if not await shutdown.drained(drain_timeout_s):
            log.warning("%d request(s) still in flight after service.drain_timeout_s (%ss); stopping anyway",
                        shutdown.inflight, drain_timeout_s)
        await release_pool(app)
    finally:
        if lock is not None and not shutdown.handed_over:
            # A handed-over process leaves the record alone: its successor's is, or will be, there.
            remove_address(app[SETTINGS].service.state_dir, os.getpid())
        if plane is not None:
            await plane.stop()   # by PID, after the drain: nothing they relay is still in flight
        await runner.cleanup()
        for sig in (*STOP_SIGNALS, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
        if watching is not None:
            watching.cancel()


def _record_address(app: web.Application, socks: Sequence[socket.socket], lock: IO[str] | None) -> None:
    """Record where this process serves, for `llm-pool ctl` (proxy/serve_address.py): only by the
    holder of the state folder's lock, and only once it serves. socks[1], where there is one, is
    service.admin_port's listener (cli.cmd_serve)."""
    if lock is None:
        return
    public, *admin = (sock.getsockname()[:2] for sock in socks)
    try:
        write_address(app[SETTINGS].service.state_dir, ServeAddress(os.getpid(), public, admin[0] if admin else None))
    except OSError as exc:
        log.warning("cannot record this proxy's address for `llm-pool ctl`: %s", exc)


def _own_url(sock: socket.socket) -> str:
    """Where this proxy's own requests reach its public listener (a batch's lines)."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _no_reload() -> None:
    log.warning("SIGUSR1 ignored: this proxy holds no state folder lock to hand over")


async def _until_adopted(app: web.Application) -> None:
    """Until every model whose replicas were running at startup has finished its first load
    (adopted, or failed), or a stop signal."""
    pool, shutdown = app[POOL], app[SHUTDOWN]
    names: frozenset[str] = app[ADOPTING]
    for name in sorted(names):
        runtime = pool.models[name]
        while name in pool.startup_pending and not shutdown.requested.is_set():
            await runtime.wait_changed(0.1)
    adopted = {n: pool.models[n].state.value for n in sorted(names)}
    log.info("reload: adoption done (%s); accepting", ", ".join(f"{n}: {s}" for n, s in adopted.items()) or "none")


def continue_events(pool: Pool) -> None:
    """The events feed goes on from the state folder's journal, and writes it from now on. Read on
    the event loop: at most the feed's capacity of lines, once per start or takeover."""
    events = pool.events
    journal = EventJournal(pool.settings.service.state_dir / EVENTS_FILE, events.capacity)
    events.continue_from(journal.read(), journal)


async def _follow(succession: Succession, app: web.Application) -> None:
    """Until the predecessor has exited: its events go into this feed, its last counters under this
    process's; then the pool may act on the replicas alone."""
    pool = app[POOL]
    async for kind, body in succession.messages():
        if kind == EVENT:
            pool.events.received(body)
        elif kind == COUNTERS:
            app[METRICS].carried.carry(parse(body))
    await succession.predecessor_exited()
    pool.predecessor_gone.set()


async def _finish_handed_over(app: web.Application, runner: web.AppRunner, sites: list[web.SockSite],
                              socks: Sequence[socket.socket]) -> None:
    """A reload's old process, once the successor took over: stop accepting (the kernel's queue is the
    successor's alone), make no more lifecycle decisions, answer what still comes on open
    connections with `Connection: close` (proxy/serving/shutdown.py), close the connections that
    stay idle, let the requests in flight finish (service.drain_timeout_s), and return: the
    models and supervisord keep running."""
    shutdown = app[SHUTDOWN]
    plane = app[PROCESSES].plane
    if plane is not None:
        plane.stop_accepting()   # the workers finish what they relay, through this process
    for site in sites:
        await site.stop()
    for sock in socks:
        sock.close()
    open_now = len(runner.server.connections) if runner.server is not None else 0
    log.info("reload: pid %d stopped accepting; %d connection(s) open, %d request(s) in flight", os.getpid(),
             open_now, shutdown.inflight)
    await release_pool(app)   # keep_models: only this process's own tasks end
    loop = asyncio.get_running_loop()
    started = loop.time()
    drain_s = app[SETTINGS].service.drain_timeout_s
    await shutdown.drained(drain_s)
    # A connection that carries another request within IDLE_CLOSE_S is answered and closed by it;
    # one that stays idle that long is closed by the cleanup (as its keep-alive timeout would).
    linger = started + IDLE_CLOSE_S - loop.time()
    if linger > 0 and runner.server is not None and runner.server.connections:
        await asyncio.sleep(linger)
        await shutdown.drained(max(0.0, started + drain_s - loop.time()))
    if shutdown.inflight:
        log.warning("%d request(s) still in flight after service.drain_timeout_s (%ss); exiting anyway",
                    shutdown.inflight, app[SETTINGS].service.drain_timeout_s)
    log.info("reload: pid %d done after %.1fs; exiting, supervisord and the models keep running",
             os.getpid(), loop.time() - started)
