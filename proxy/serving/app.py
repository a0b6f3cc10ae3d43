"""The aiohttp application: routes, middleware, and the pool's lifetime in cleanup_ctx."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from typing import Any, AsyncIterator

from aiohttp import web

from proxy.supervisord import managed
from proxy.serving import routes_admin
from proxy.serving import routes_public
from proxy.serving import routes_responses
from proxy.config import Settings
from proxy.errors import ERROR_CODE, NotFound, error_middleware
from proxy.serving.forward import upstream_session
from proxy.serving.keys import FAIRNESS_KEY, HTTP, METRICS, MODEL, POOL, SETTINGS, STARTED, STREAM_ERROR, VRAM
from proxy.serving.metrics import ProxyMetrics
from proxy.supervisord.orphans import PidRecord
from proxy.lifecycle.pool import Pool
from proxy.supervisord.supervisor import SupervisorClient
from proxy.gpu.vram_estimate import Estimator

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@web.middleware
async def metrics_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
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
        model = request.get(MODEL)
        if model is not None:
            metrics = request.app[METRICS]
            metrics.requests.labels(model, request.path, status, _error_code(request, response),
                                    metrics.key_label(request.get(FAIRNESS_KEY))).inc()
            metrics.latency.labels(model, request.path).observe(time.perf_counter() - started)


def _error_code(request: web.Request, response: web.StreamResponse | None) -> str:
    """"" for a success; else the error's code for the metrics (PoolError.metric_code), recorded
    where the error was answered, or read from a small error body built elsewhere."""
    failed = request.get(STREAM_ERROR) or request.get(ERROR_CODE)
    if failed is not None:
        return failed
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
    """With service.admin_port, the admin API answers on that listener only, and nothing else does
    (but /health): a public port that never routes /v1/admin/* cannot expose it by mistake."""
    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        on_admin = bool(sockname) and sockname[1] == admin_port
        if request.path.startswith("/v1/admin/") != on_admin and request.path != "/health":
            raise NotFound(f"no route {request.path} on this listener", code="not_found")
        return await handler(request)
    return middleware


def create_app(settings: Settings, *, keep_models: bool = False) -> web.Application:
    """The proxy app. On cleanup it unloads every model and, in managed mode, stops supervisord,
    unless `keep_models`: then both keep running for the next proxy to adopt.

    SIGUSR1 makes a running proxy exit as if started with `--keep-models`: an upgrade or a settings
    change without unloading anything (the systemd unit's `reload`)."""
    # metrics outside errors: it sees the status the error middleware rendered.
    middlewares = [metrics_middleware, error_middleware]
    if settings.service.admin_port is not None:
        middlewares.append(admin_listener_middleware(settings.service.admin_port))
    app = web.Application(client_max_size=settings.service.max_body_bytes, middlewares=middlewares)
    app[SETTINGS] = settings
    app[METRICS] = ProxyMetrics()
    app[VRAM] = Estimator()
    app.add_routes(routes_public.routes)
    app.add_routes(routes_admin.routes)
    app.add_routes(routes_responses.routes)

    keep = [keep_models]   # SIGUSR1 sets it

    def already_stopping(sig: signal.Signals) -> None:
        # A second Ctrl-C used to interrupt the unload half-way; the unload is bounded by each
        # program's stop wait, so it is let finish, and the way out is said plainly.
        log.warning("%s ignored: already shutting down (%s); SIGKILL would leave supervisord and the "
                    "models running for the next serve to adopt", sig.name,
                    "keeping the models" if keep[0] else "unloading the models")

    async def ignore_further_signals(_: web.Application) -> None:
        # on_shutdown runs before in-flight requests are waited for and before pool_ctx's exit
        # unloads the models: from here on, one more signal must not cut the shutdown short.
        log.info("shutting down: requests in flight finish, then the models are %s",
                 "left running" if keep[0] else "unloaded")
        for sig in STOP_SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                asyncio.get_running_loop().add_signal_handler(sig, already_stopping, sig)

    async def pool_ctx(app: web.Application) -> AsyncIterator[None]:
        http = upstream_session()
        supervisor = SupervisorClient(settings.supervisor_url, timeout=settings.supervisor.rpc_timeout_s)
        try:
            if settings.supervisor.mode == "managed":
                if await managed.ensure_supervisord(settings, supervisor):
                    log.info("started supervisord: supervisorctl -c %s status", managed.conf_path(settings))
            managed_mode = settings.supervisor.mode == "managed"
            pool = Pool(settings, supervisor, http,
                        pid_record=PidRecord(settings.service.state_dir) if managed_mode else None)
            await pool.start()
        except BaseException:
            await supervisor.close()
            await http.close()
            raise
        app[POOL] = pool
        app[HTTP] = http
        app[METRICS].watch(pool)
        pool.load_in_background()

        def exit_keeping_models() -> None:
            log.info("SIGUSR1: exiting, leaving supervisord and the models running for the next proxy")
            keep[0] = True
            raise web.GracefulExit()  # what aiohttp's own SIGTERM handler raises

        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(signal.SIGUSR1, exit_keeping_models)
        yield
        keep_models_now = keep[0]
        try:
            await pool.close(stop_models=not keep_models_now)
            if settings.supervisor.mode == "managed" and not keep_models_now:
                await managed.stop_supervisord(supervisor)
        finally:
            await supervisor.close()
            await http.close()
            for sig in STOP_SIGNALS:
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)

    app.on_shutdown.append(ignore_further_signals)
    app.cleanup_ctx.append(pool_ctx)
    return app
