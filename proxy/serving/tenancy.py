"""The data plane's tenants at run time (README: Tenants): with `tenants` configured, every request
to a model needs a key, the key's tenant decides what it may use and whose queue it waits in, and
each finished request is a row of the usage ledger. Without `tenants` none of this is built and a
request costs what it did.

A key comes as `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key` (Anthropic's); it is
looked up by digest (proxy/tenants/keys.py) and never logged: logs, metrics and the admin view name
its id. The admin token is never a data-plane key, even if a tenant lists the same value.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from proxy.config.settings import Settings
from proxy.errors import Forbidden, NotFound, Unauthorized
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.serving.keys import QUEUE_WAIT, REPLICA, USAGE
from proxy.tenants.keys import Caller, Keys, digest, key_id, may_use, new_key
from proxy.tenants.ledger import Ledger, SqliteLedger, UsageRow
from proxy.tenants.limits import cost, refusal
from proxy.tenants.spending import Spend

log = logging.getLogger(__name__)

LEDGER_FILE = "usage.sqlite3"
# The request's caller, once its key was checked; the app's tenancy, only where tenants are configured.
CALLER = web.RequestKey("caller", Caller)
TENANCY: web.AppKey["Tenancy"] = web.AppKey("tenancy")


class TenantMetrics:
    """Per tenant: requests by status, tokens by kind, cost. Labels only ever hold configured tenant
    names, so the label set is bounded by the settings. Each child is bound once: `labels()` costs
    more than the increment, and it runs for every request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("llm_pool_tenant_requests", "Requests of each tenant, by final status",
                                ["tenant", "status"], registry=registry)
        self.tokens = Counter("llm_pool_tenant_tokens", "Tokens of each tenant's requests (usage)",
                              ["tenant", "kind"], registry=registry)
        self.cost = Counter("llm_pool_tenant_cost", "What each tenant's requests cost (price_per_mtok)",
                            ["tenant"], registry=registry)
        self._children: dict[tuple[Counter, str, str], Any] = {}

    def inc(self, counter: Counter, tenant: str, label: str | None, value: float = 1.0) -> None:
        key = (counter, tenant, label or "")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = counter.labels(tenant, label) if label is not None else counter.labels(tenant)
        child.inc(value)


def _presented_key(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    key = value.strip() if scheme.lower() == "bearer" and value.strip() else request.headers.get("x-api-key") or None
    if key is not None and not key.isascii():
        try:
            key.encode()
        except UnicodeEncodeError:
            # aiohttp keeps a header's undecodable bytes as surrogates, which no key holds: a wrong
            # key (401), not an encoding error of its digest (500).
            raise Unauthorized("the API key is not valid for this pool", code="invalid_api_key") from None
    return key


class Tenancy:
    """The keys, the spending in memory, the ledger and the counters, for one app."""

    def __init__(self, settings: Settings, keys: Keys, ledger: Ledger, registry: CollectorRegistry,
                 admin_token: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self.settings, self.keys, self.ledger, self.clock = settings, keys, ledger, clock
        if admin_token:
            # The admin token opens the admin API only: a tenant that lists it has that key dropped.
            keys.remove(digest(admin_token))
        self.spend = Spend(settings.tenants, ledger, clock())
        self.metrics = TenantMetrics(registry)
        self.closed = False
        self._allowed: dict[tuple[str, str], bool] = {}

    @classmethod
    def open(cls, settings: Settings, environ: Mapping[str, str], registry: CollectorRegistry) -> "Tenancy":
        """The tenancy of `settings` (which has tenants): its ledger file under the state dir, with
        the keys minted before that are not revoked."""
        ledger = SqliteLedger(settings.service.state_dir / LEDGER_FILE)
        keys = Keys.configured(settings.tenants, environ)
        keys.add_all((k.tenant, k.sha256) for k in ledger.keys() if k.revoked is None)
        admin_env = settings.service.admin_token_env
        return cls(settings, keys, ledger, registry, environ.get(admin_env) if admin_env else None)

    def close(self) -> None:
        self.closed = True   # a request that ends after this is not recorded: the ledger is shut
        self.ledger.close()

    # -- a request -----------------------------------------------------------------------------

    def caller(self, request: web.Request) -> Caller:
        """The request's tenant, from its key: 401 `invalid_api_key` without one it knows."""
        key = _presented_key(request)
        if key is None:
            raise Unauthorized("this pool needs an API key: `Authorization: Bearer <key>` or `x-api-key: <key>`",
                               code="invalid_api_key")
        caller = self.keys.identify(key)
        if caller is None:
            raise Unauthorized("the API key is not valid for this pool", code="invalid_api_key")
        request[CALLER] = caller
        return caller

    def allow(self, caller: Caller, runtime: ModelRuntime) -> None:
        """What the tenant may never do with this model: 403 for a model outside its globs or a
        remote one it may not use."""
        tenant = caller.tenant
        allowed = self._allowed.get((tenant.name, runtime.name))
        if allowed is None:   # the globs are matched once per tenant and model
            allowed = self._allowed[(tenant.name, runtime.name)] = may_use(tenant, runtime.name)
        if not allowed:
            raise Forbidden(f"tenant {tenant.name!r} may not use model {runtime.name!r}", code="model_not_allowed",
                            param="model")
        if runtime.traits.remote and not tenant.allow_remote:
            raise Forbidden(f"tenant {tenant.name!r} may not use remote models (tenants.{tenant.name}.allow_remote)",
                            code="remote_not_allowed", param="model")

    def admit(self, caller: Caller) -> None:
        """What the tenant may not do now: 429 for a limit reached or a budget spent. An admitted
        request counts toward requests_per_minute at once."""
        tenant = caller.tenant
        now = self.clock()
        minute, oldest = self.spend.minute(tenant.name, now)
        refused = refusal(tenant, minute, self.spend.period(tenant.name, now), now, oldest)
        if refused is not None:
            raise refused
        self.spend.started(tenant.name, now)

    def finished(self, request: web.Request, runtime: ModelRuntime, status: int, duration_s: float) -> None:
        """A request of a tenant ended: a ledger row, its spending and its counters."""
        caller = request.get(CALLER)
        if caller is None or self.closed:
            return
        prompt, cached, output = request.get(USAGE, (0, 0, 0))
        spent = cost(runtime.model.get("price_per_mtok"), prompt, cached, output)
        now = self.clock()
        replica = request.get(REPLICA)
        name = caller.tenant.name
        self.spend.ended(name, now, prompt + output, spent)
        self.ledger.record(UsageRow(
            time=now, tenant=name, key_id=caller.key_id, model=runtime.name, backend=runtime.model.backend,
            host=replica.host if replica is not None else "", status=status, prompt_tokens=prompt, cached_tokens=cached,
            output_tokens=output, cost=spent, queue_wait_ms=request.get(QUEUE_WAIT, 0.0) * 1000,
            duration_ms=duration_s * 1000))
        m = self.metrics
        m.inc(m.requests, name, str(status))
        for kind, value in (("prompt", prompt), ("cached", cached), ("output", output)):
            if value:
                m.inc(m.tokens, name, kind, value)
        if spent:
            m.inc(m.cost, name, None, spent)

    def allowed_models(self, request: web.Request, names: list[str]) -> list[str]:
        """The model ids of `names` the request's tenant may use (GET /v1/models shows only those)."""
        caller = self.caller(request)
        return [n for n in names if may_use(caller.tenant, n)]

    # -- the admin's keys ----------------------------------------------------------------------

    def mint(self, tenant: str) -> dict[str, str]:
        """A new key for `tenant`, usable at once: its id and the key, shown this once."""
        if tenant not in self.settings.tenants:
            raise NotFound(f"tenant {tenant!r} is not configured", code="tenant_not_found", param="tenant")
        key = new_key()
        sha = digest(key)
        self.ledger.add_key(tenant, key_id(sha), sha, self.clock())
        self.keys.add(tenant, sha)
        log.info("minted a key (id %s) for tenant %r", key_id(sha), tenant)
        return {"id": key_id(sha), "key": key}

    def revoke(self, tenant: str, kid: str) -> None:
        """Revoke a minted key of `tenant`: its next request is refused."""
        if tenant not in self.settings.tenants:
            raise NotFound(f"tenant {tenant!r} is not configured", code="tenant_not_found", param="tenant")
        minted = {k.key_id: k for k in self.ledger.keys() if k.tenant == tenant and k.revoked is None}
        if kid not in minted or not self.ledger.revoke_key(tenant, kid, self.clock()):
            raise NotFound(f"tenant {tenant!r} has no live minted key {kid!r} (configured keys are revoked in the "
                           "settings)", code="key_not_found", param="key_id")
        self.keys.remove(minted[kid].sha256)
        log.info("revoked key %s of tenant %r", kid, tenant)

    def describe(self) -> list[dict[str, Any]]:
        """GET /v1/admin/tenants: each tenant's settings and its keys by id (never a key)."""
        minted = self.ledger.keys()
        out = []
        for name, t in self.settings.tenants.items():
            configured = [key_id(d) for d in t.key_sha256]
            out.append({"name": name, "fairness_key": t.fairness_key, "weight": t.weight, "models": list(t.models),
                        "allow_remote": t.allow_remote,
                        "limits": {"requests_per_minute": t.requests_per_minute,
                                   "tokens_per_minute": t.tokens_per_minute},
                        "budget": {"period": t.budget_period, "tokens": t.budget_tokens, "cost": t.budget_cost},
                        "key_env": list(t.key_env), "key_sha256_ids": configured,
                        "minted_keys": [{"id": k.key_id, "created": k.created, "revoked": k.revoked}
                                        for k in minted if k.tenant == name]})
        return out
