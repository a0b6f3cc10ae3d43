"""The proxy's routes served in the test's own process, on a loopback port, in front of replicas the
test sets up by hand: what `serve` builds, less supervisord and the pool's lifetime. For tests of the
edge and the data path against a replica that misbehaves on purpose (tests/fakes.py, a hostile
server), with real HTTP on both sides."""
from __future__ import annotations

import contextlib

from aiohttp import web

from proxy.config.settings import Settings
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState
from proxy.upstream.client import UpstreamHttp
from proxy.serving import routes_messages, routes_public, routes_responses
from proxy.serving.app import metrics_middleware
from proxy.serving.errors_http import error_middleware
from proxy.serving.keys import ADOPTING, HTTP, METRICS, POOL, SETTINGS
from proxy.serving.metrics import ProxyMetrics
from proxy.serving.shutdown import SHUTDOWN, Shutdown
from proxy.serving.tenancy import TENANCY, Tenancy


def in_rotation(pool: Pool, model: str, replicas: list[Replica]) -> None:
    """`model` loaded with `replicas`, each READY (as after its health check passed)."""
    runtime = pool.models[model]
    runtime.state = ModelState.LOADED
    runtime.replicas = list(replicas)
    for replica in replicas:
        runtime.set_replica_state(replica, ReplicaState.STARTING)
        runtime.set_replica_state(replica, ReplicaState.READY)


async def serve_routes(stack: contextlib.AsyncExitStack, settings: Settings, pool: Pool,
                       http: UpstreamHttp, tenancy: Tenancy | None = None) -> str:
    """The public routes and /v1/responses on a loopback port until `stack` closes; their URL.
    `tenancy`: the tenants' keys and ledger, where the test has tenants."""
    app = web.Application(middlewares=[metrics_middleware, error_middleware],
                          client_max_size=settings.service.max_body_bytes)
    app[SETTINGS], app[POOL], app[HTTP], app[METRICS] = settings, pool, http, ProxyMetrics()
    if tenancy is not None:
        app[TENANCY] = tenancy
    app[SHUTDOWN], app[ADOPTING] = Shutdown(keep_models=False), pool.adopting()
    app.add_routes(routes_public.routes)
    app.add_routes(routes_responses.routes)
    app.add_routes(routes_messages.routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}"
