"""The proxy's routes served in the test's own process, on a loopback port, in front of replicas the
test sets up by hand: what `serve` builds, less supervisord and the pool's lifetime. For tests of the
edge and the data path against a replica that misbehaves on purpose (tests/fakes.py, a hostile
server), with real HTTP on both sides."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Sequence

from aiohttp import web

from fakes import FakeSupervisor
from proxy.config.loading import load_settings
from proxy.config.settings import Settings
from proxy.lifecycle.kinds.remote import RemoteReach
from proxy.lifecycle.kinds.remote_options import Secret
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState
from proxy.upstream.client import UpstreamHttp
from proxy.serving import routes_messages, routes_public, routes_responses
from proxy.serving.app import metrics_middleware
from proxy.serving.errors_http import error_middleware
from proxy.serving.keys import ADOPTING, HTTP, METRICS, POOL, SETTINGS, VOCABULARIES
from proxy.serving.metrics import ProxyMetrics
from proxy.serving.shutdown import SHUTDOWN, Shutdown
from proxy.serving.vocabulary import Vocabularies
from proxy.serving.forward import upstream_session
from proxy.serving.tenancy import LEDGER_FILE, TENANCY, Tenancy
from proxy.tenants.keys import Keys
from proxy.tenants.ledger import SqliteLedger


def in_rotation(pool: Pool, model: str, replicas: list[Replica]) -> None:
    """`model` loaded with `replicas`, each READY (as after its health check passed)."""
    runtime = pool.models[model]
    runtime.state = ModelState.LOADED
    runtime.replicas = list(replicas)
    for replica in replicas:
        runtime.set_replica_state(replica, ReplicaState.STARTING)
        runtime.set_replica_state(replica, ReplicaState.READY)


async def serve_routes(stack: contextlib.AsyncExitStack, settings: Settings, pool: Pool,
                       http: UpstreamHttp, *, tenancy: Tenancy | None = None,
                       metrics: ProxyMetrics | None = None, handler_cancellation: bool = False,
                       outer: Sequence[Any] = ()) -> str:
    """The public routes and /v1/responses on a loopback port until `stack` closes; their URL.
    `tenancy`: the tenants' keys and ledger (built on `metrics`' registry), as `serve` has them;
    `handler_cancellation`: a client that hangs up cancels its handler, as under `serve`; `outer`:
    middlewares of the test's, outside the app's own."""
    app = web.Application(middlewares=[*outer, metrics_middleware, error_middleware],
                          client_max_size=settings.service.max_body_bytes)
    app[SETTINGS], app[POOL], app[HTTP], app[METRICS] = settings, pool, http, metrics or ProxyMetrics()
    if tenancy is not None:
        app[TENANCY] = tenancy
    app[SHUTDOWN], app[ADOPTING] = Shutdown(keep_models=False), pool.adopting()
    app[VOCABULARIES] = Vocabularies()
    app.add_routes(routes_public.routes)
    app.add_routes(routes_responses.routes)
    app.add_routes(routes_messages.routes)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=handler_cancellation)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}"


async def tenant_proxy(stack: contextlib.AsyncExitStack, state_dir: Path, provider_url: str, provider_key: str,
                       tenants: dict[str, Any], model: dict[str, Any] | None = None,
                       handler_cancellation: bool = False) -> tuple[str, Tenancy, Pool]:
    """The routes with tenants (a real SQLite ledger in `state_dir`, the tenants' keys from their
    `key_env` variables as set here in `tenants[...]["key"]`) in front of one `openai_remote` model
    `r` at `provider_url`: the proxy's URL, its tenancy and its pool."""
    environ = {"PROVIDER_KEY": provider_key}
    configured = {}
    for name, tenant in tenants.items():
        var = f"KEY_{name.upper()}"
        environ[var] = tenant["key"]
        configured[name] = {"key_env": [var], "fairness_key": name, "allow_remote": True,
                            **{k: v for k, v in tenant.items() if k != "key"}}
    models = {"r": {"backend": "openai_remote", "remote_base_url": provider_url, "remote_model": "theirs",
                    "remote_api_key_env": "PROVIDER_KEY", "target_inflight": 16, **(model or {})}}
    (state_dir / "pool.yaml").write_text(json.dumps({"service": {"state_dir": str(state_dir)},
                                                     "engine": {"models": models}, "tenants": configured}))
    settings = load_settings(state_dir / "pool.yaml")
    http = await stack.enter_async_context(upstream_session())
    pool = Pool(settings, FakeSupervisor(), http, environ=environ)  # type: ignore[arg-type]
    in_rotation(pool, "r", [Replica(model="r", index=0, reach=RemoteReach(settings.models["r"], Secret(provider_key)))])
    metrics = ProxyMetrics()
    ledger = SqliteLedger(state_dir / LEDGER_FILE, flush_interval_s=0.05)
    tenancy = Tenancy(settings, Keys.configured(settings.tenants, environ), ledger, metrics.registry)
    stack.callback(tenancy.close)
    url = await serve_routes(stack, settings, pool, http, tenancy=tenancy, metrics=metrics,
                             handler_cancellation=handler_cancellation)
    return url, tenancy, pool
