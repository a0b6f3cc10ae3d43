"""The admin API of tenants (docs/tenants.md): the usage ledger's report, the tenants and their keys
by id, and minting and revoking keys. Without `tenants` configured each answers 409
`tenants_not_configured`."""
from __future__ import annotations

import asyncio
import csv
import io
from datetime import datetime, timezone

from aiohttp import web

from proxy.errors import BadRequest, Conflict
from proxy.serving.admin_guard import admit
from proxy.serving.tenancy import TENANCY, Tenancy

routes = web.RouteTableDef()

GROUPS = ("tenant", "model", "day", "key_id", "backend", "host")
DEFAULT_GROUPS = ("tenant", "model", "day")
SUMS = ("requests", "errors", "prompt_tokens", "cached_tokens", "output_tokens", "cost", "estimated",
        "queue_wait_ms", "duration_ms")


def _tenancy(request: web.Request) -> Tenancy:
    admit(request)
    tenancy = request.app.get(TENANCY)
    if tenancy is None:
        raise Conflict("no tenants are configured (`tenants` in the settings): there are no keys and no ledger",
                       code="tenants_not_configured")
    return tenancy


def _time_param(request: web.Request, name: str) -> float | None:
    """Unix seconds, or an ISO 8601 date or time (UTC unless it says otherwise)."""
    raw = request.query.get(name)
    if raw is None or raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(raw)
    except ValueError:
        raise BadRequest(f"`{name}` must be unix seconds or an ISO 8601 date or time, like 2026-12-01",
                         code="invalid_usage_request", param=name) from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).timestamp()


@routes.get("/v1/admin/usage")
async def admin_usage(request: web.Request) -> web.StreamResponse:
    """The ledger's rows summed per `group_by` (comma-separated of GROUPS; default tenant,model,day)
    between `from` and `to`; `format=csv` the same rows as CSV."""
    tenancy = _tenancy(request)
    start, end = _time_param(request, "from"), _time_param(request, "to")
    groups = tuple(g for g in request.query.get("group_by", ",".join(DEFAULT_GROUPS)).split(",") if g)
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown or len(set(groups)) != len(groups):
        raise BadRequest(f"`group_by` must be distinct fields of {', '.join(GROUPS)} (comma-separated)",
                         code="invalid_usage_request", param="group_by")
    form = request.query.get("format", "json")
    if form not in ("json", "csv"):
        raise BadRequest("`format` must be json or csv", code="invalid_usage_request", param="format")
    rows = await asyncio.to_thread(tenancy.ledger.usage, start, end, groups)
    if form == "json":
        return web.json_response({"object": "list", "data": rows})
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[*groups, *SUMS], extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return web.Response(text=out.getvalue(), content_type="text/csv",
                        headers={"Content-Disposition": 'attachment; filename="usage.csv"'})


@routes.get("/v1/admin/tenants")
async def admin_tenants(request: web.Request) -> web.Response:
    tenancy = _tenancy(request)
    return web.json_response({"object": "list", "data": await asyncio.to_thread(tenancy.describe)})


@routes.post("/v1/admin/tenants/{tenant}/keys")
async def mint_key(request: web.Request) -> web.Response:
    """A new key for the tenant: `{"id", "key"}`, the key shown this once (the ledger keeps its digest)."""
    tenancy = _tenancy(request)
    if request.can_read_body and (await request.read()).strip() not in (b"", b"{}"):
        raise BadRequest("a key is minted from an empty body or {}", code="invalid_key_request")
    return web.json_response(await asyncio.to_thread(tenancy.mint, request.match_info["tenant"]))


@routes.delete("/v1/admin/tenants/{tenant}/keys/{key_id}")
async def revoke_key(request: web.Request) -> web.Response:
    """Revoke a minted key: its next request is refused (401)."""
    tenancy = _tenancy(request)
    await asyncio.to_thread(tenancy.revoke, request.match_info["tenant"], request.match_info["key_id"])
    return web.json_response({"id": request.match_info["key_id"], "revoked": True})
