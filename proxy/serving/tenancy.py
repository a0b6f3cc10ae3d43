"""The data plane's tenants at run time (docs/tenants.md): with `tenants` configured, every request
to a model needs a key, the key's tenant decides what it may use and whose queue it waits in, and
each finished request is a row of the usage ledger. Without `tenants` none of this is built and a
request costs what it did.

A key comes as `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key` (Anthropic's); it is
looked up by digest (proxy/tenants/keys.py) and never logged: logs, metrics and the admin view name
its id. The admin token is never a data-plane key, even if a tenant lists the same value.

A request's check is in memory (proxy/tenants/spending.py): no database query on the way in or out
but while a reload's predecessor may still record (then each admission reads the rows it wrote
since, one seek of the ledger's rowid). The ledger's writer is watched: a ledger that cannot write
makes /ready answer 503 and is an event, as is its recovery.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterator, Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.config.settings import Settings
from proxy.errors import Forbidden, NotFound, Unauthorized
from proxy.events import LEDGER, Events
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.serving.keys import ADAPTER, QUEUE_WAIT, REPLICA, USAGE, USAGE_ESTIMATED
from proxy.tenants.keys import Caller, Keys, digest, key_id, may_use, new_key
from proxy.tenants.ledger import Ledger, SqliteLedger, UsageRow
from proxy.tenants.limits import cost, output_limit, prompt_estimate
from proxy.tenants.spending import Spend

log = logging.getLogger(__name__)

LEDGER_FILE = "usage.sqlite3"


class Ticket:
    """A tenant's request from its key's check to its end: who sent it, and what it holds of its
    tenant's limits and budget (`held`: from its admission until it ends). One object per request,
    so that its end reads one request key, not one per figure."""

    __slots__ = ("caller", "held", "admitted", "tokens", "cost")

    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self.held = False
        self.admitted = False   # counted toward its limits once: a fallback's run is no new request
        self.tokens = 0
        self.cost = 0.0


# The request's ticket, once its key was checked; the app's tenancy, only where tenants are configured.
TICKET = web.RequestKey("tenant_ticket", Ticket)
TENANCY: web.AppKey["Tenancy"] = web.AppKey("tenancy")
# How often the ledger's writer is looked at, for /ready's sake and the events.
WATCH_S = 1.0
_NO_USAGE = (0, 0, 0)


class TenantMetrics(Collector):
    """Per tenant: requests by status, tokens by kind, cost. Labels only ever hold configured tenant
    names, so the label set is bounded by the settings. Plain sums, read at scrape time: a counter's
    increment takes a lock, and five of them ran for every request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests: dict[str, dict[int, int]] = {}    # tenant: status: requests
        # tenant: [prompt, cached, output tokens, cost]: a list per tenant, so a request's count is
        # four additions and no key built.
        self.sums: dict[str, list[Any]] = {}
        registry.register(self)

    def count(self, tenant: str, status: int, prompt: int, cached: int, output: int, spent: float) -> None:
        statuses = self.requests.get(tenant)
        if statuses is None:
            statuses = self.requests[tenant] = {}
            self.sums[tenant] = [0, 0, 0, 0.0]
        statuses[status] = statuses.get(status, 0) + 1
        sums = self.sums[tenant]
        sums[0] += prompt
        sums[1] += cached
        sums[2] += output
        sums[3] += spent

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("llm_pool_tenant_requests", "Requests of each tenant, by final status",
                                       labels=["tenant", "status"])
        tokens = CounterMetricFamily("llm_pool_tenant_tokens", "Tokens of each tenant's requests (usage)",
                                     labels=["tenant", "kind"])
        spent = CounterMetricFamily("llm_pool_tenant_cost", "What each tenant's requests cost (price_per_mtok)",
                                    labels=["tenant"])
        for tenant, statuses in list(self.requests.items()):
            for status, n in list(statuses.items()):
                requests.add_metric([tenant, str(status)], n)
            prompt, cached, output, cost = self.sums[tenant]
            for kind, value in (("prompt", prompt), ("cached", cached), ("output", output)):
                if value:
                    tokens.add_metric([tenant, kind], value)
            if cost:
                spent.add_metric([tenant], cost)
        yield from (requests, tokens, spent)


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
                 admin_token: str | None = None, clock: Callable[[], float] = time.time,
                 predecessor_gone: asyncio.Event | None = None) -> None:
        """`predecessor_gone`: set once a reload's predecessor, which records into the same ledger
        while it drains, has exited (unset only in a reload's successor)."""
        self.settings, self.keys, self.ledger, self.clock = settings, keys, ledger, clock
        if admin_token:
            # The admin token opens the admin API only: a tenant that lists it has that key dropped.
            keys.remove(digest(admin_token))
        self.spend = Spend(settings.tenants, ledger, clock())
        self.metrics = TenantMetrics(registry)
        self.closed = False
        self._allowed: dict[tuple[str, str], bool] = {}
        self._predecessor = predecessor_gone if predecessor_gone is not None and not predecessor_gone.is_set() else None
        default = settings.decoding.get("max_tokens")
        self._default_output = default if type(default) is int else None

    @classmethod
    def open(cls, settings: Settings, environ: Mapping[str, str], registry: CollectorRegistry,
             predecessor_gone: asyncio.Event | None = None) -> "Tenancy":
        """The tenancy of `settings` (which has tenants): its ledger file under the state dir, with
        the keys minted before that are not revoked."""
        ledger = SqliteLedger(settings.service.state_dir / LEDGER_FILE)
        keys = Keys.configured(settings.tenants, environ)
        keys.add_all((k.tenant, k.sha256) for k in ledger.keys() if k.revoked is None)
        admin_env = settings.service.admin_token_env
        return cls(settings, keys, ledger, registry, environ.get(admin_env) if admin_env else None,
                   predecessor_gone=predecessor_gone)

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
        if TICKET not in request:   # a fallback's run (proxy/serving/fallbacks.py) keeps the request's
            request[TICKET] = Ticket(caller)
        return caller

    def allow(self, caller: Caller, runtime: ModelRuntime, public: str | None = None) -> None:
        """What the tenant may never do with this model: 403 for a model outside its globs or a
        remote one it may not use. `public`: the id the request named where it is not the model's
        own, a LoRA adapter's (`demo:*` allows the adapters of demo, not demo itself)."""
        tenant = caller.tenant
        name = public or runtime.name
        allowed = self._allowed.get((tenant.name, name))
        if allowed is None:   # the globs are matched once per tenant and model
            allowed = self._allowed[(tenant.name, name)] = may_use(tenant, name)
        if not allowed:
            raise Forbidden(f"tenant {tenant.name!r} may not use model {name!r}", code="model_not_allowed",
                            param="model")
        if runtime.traits.remote and not tenant.allow_remote:
            raise Forbidden(f"tenant {tenant.name!r} may not use remote models (tenants.{tenant.name}.allow_remote)",
                            code="remote_not_allowed", param="model")

    def admit(self, request: web.Request, caller: Caller, runtime: ModelRuntime, body: Mapping[str, Any]) -> None:
        """What the tenant may not do now: 429 for a limit reached or a budget spent, its requests in
        flight counted at what they reserved. An admitted request counts toward requests_per_minute
        at once, and reserves what it may use (`body`'s output limit, or engine.decoding.max_tokens,
        and its prompt's estimate) until it ends (`finished`)."""
        tenant = caller.tenant
        now = self.clock()
        if self._predecessor is not None:
            self._read_predecessors_rows(now)
        tokens, reserved_cost = 0, 0.0
        if tenant.budget_tokens is not None or tenant.budget_cost is not None or tenant.tokens_per_minute is not None:
            prompt, output = prompt_estimate(body, request.content_length), output_limit(body, self._default_output)
            tokens = prompt + output
            price = runtime.model.get("price_per_mtok")
            reserved_cost = cost(price, prompt, 0, output) if price else 0.0
        ticket = request[TICKET]
        again = ticket.admitted   # a fallback's run (proxy/serving/fallbacks.py): the same request
        if ticket.held:
            ticket.held = False
            self.spend.release(tenant.name, ticket.tokens, ticket.cost)   # re-reserved at its model's price
        refused = self.spend.admit(tenant, now, tokens, reserved_cost, counted=not again)
        if refused is not None:
            raise refused
        ticket.held, ticket.admitted, ticket.tokens, ticket.cost = True, True, tokens, reserved_cost

    def _read_predecessors_rows(self, now: float) -> None:
        assert self._predecessor is not None
        # Read before reading: once it has exited, every row it recorded is on disk (it flushed at
        # its close), so the read after that is the last one needed.
        gone = self._predecessor.is_set()
        rows = self.ledger.others()
        if rows:
            self.spend.recorded_elsewhere(rows, now)
        if gone:
            self._predecessor = None

    def finished(self, request: web.Request, runtime: ModelRuntime, status: int, duration_s: float) -> None:
        """A request of a tenant ended, whichever way: what it reserved is released and replaced by
        what it used, a ledger row, and its counters."""
        ticket = request.get(TICKET)
        if ticket is None or self.closed:
            return
        caller = ticket.caller
        name = caller.tenant.name
        prompt, cached, output = request.get(USAGE, _NO_USAGE)
        price = runtime.model.get("price_per_mtok")
        spent = cost(price, prompt, cached, output) if price else 0.0
        now = self.clock()
        if ticket.held:
            ticket.held = False   # a second call releases nothing twice
            self.spend.ended(name, now, prompt + output, spent, ticket.tokens, ticket.cost)
        else:   # refused before it was admitted: it counts, as it always did, with what it used (nothing)
            self.spend.ended(name, now, prompt + output, spent)
        replica = request.get(REPLICA)
        adapter = request.get(ADAPTER)   # a LoRA adapter's row names the adapter's id, what was asked for
        self.ledger.record(UsageRow(
            now, name, caller.key_id, adapter.id if adapter is not None else runtime.name, runtime.model.backend,
            replica.host if replica is not None else "",
            status, prompt, cached, output, spent, request.get(QUEUE_WAIT, 0.0) * 1000, duration_s * 1000,
            request.get(USAGE_ESTIMATED, False)))
        self.metrics.count(name, status, prompt, cached, output, spent)

    async def watch(self, events: Events) -> None:
        """Until cancelled: an event when the ledger's writer starts failing (with why) and when it
        writes again (/ready reads `ledger.failing()` itself)."""
        failing: str | None = None
        while True:
            await asyncio.sleep(WATCH_S)
            now = self.ledger.failing()
            if now is not None and failing is None:
                events.record(LEDGER, f"usage ledger: {now}; requests are served and their rows kept in memory "
                              "until it writes again", reason="failed", level=logging.ERROR)
            elif now is None and failing is not None:
                events.record(LEDGER, "usage ledger: writing again; the rows kept in memory are on disk",
                              reason="recovered")
            failing = now

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
                        "key_env_ids": {var: self.keys.env_key_id(name, var) for var in t.key_env},
                        "minted_keys": [{"id": k.key_id, "created": k.created, "revoked": k.revoked}
                                        for k in minted if k.tenant == name]})
        return out
