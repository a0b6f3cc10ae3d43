"""What a data-plane request must be when the pool has no tenants: out of reach of a browser page of
another site, as the admin API is (proxy/serving/admin_guard.py, its rules and settings).

Without tenants no key is asked for, so whatever reaches the listener may use every model, a paid
remote one too (`allow_remote`). A page on any site can make a visitor's browser send it simple
requests (a `text/plain` or form POST: no preflight), and with DNS rebinding read the answers under
its own host name. So every POST that is not the admin API's (which admin_guard checks) must have:
- an `Origin`, when sent, of this listener's own (the status page's own requests have it);
- a `Host` this machine answers to: a literal address, `localhost`, service.host/admin_host,
  service.server_names;
- `Content-Type: application/json` (or a form, for a Batch API file: `POST /v1/files`).
API clients (no Origin, a JSON body, the address or name they were given) are not affected. With
tenants a request needs a key, which a page of another site cannot send without the CORS preflight
this proxy never grants: none of this applies then. GETs (health, readiness, metrics, the model
list) act on nothing and stay open to monitors under any name.
"""
from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from proxy.config.settings import ServiceSettings
from proxy.errors import Forbidden
from proxy.serving.admin_guard import check_json, check_origin, host_allowed

ADMIN_PREFIX = "/v1/admin/"
FILES_PATH = "/v1/files"
# Host headers seen allowed: most requests carry one of a few, checked once. Only allowed ones are
# kept, so what a client sends cannot grow it past the names this machine answers to.
KNOWN_HOSTS_MAX = 64


def edge_guard_middleware(service: ServiceSettings) -> Middleware:
    """The data plane's guard, for a pool without tenants (create_app installs it only then)."""
    allowed: set[str] = set()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST" and not request.path.startswith(ADMIN_PREFIX):
            check_origin(request, "the data plane of a pool without tenants")
            host = request.headers.get("Host", "")
            if host not in allowed:
                if not host_allowed(host, service):
                    raise Forbidden(f"Host {host!r:.100} is not a name of this proxy: without tenants (keys) its "
                                    "data plane answers only to an address, localhost, service.host or "
                                    "service.server_names (a DNS-rebinding page uses its own name); add the name "
                                    "to service.server_names, or configure tenants, to reach it under that name",
                                    code="host_not_allowed")
                if len(allowed) < KNOWN_HOSTS_MAX:
                    allowed.add(host)
            # A file for the Batch API comes as a form (OpenAI's upload); the Origin and Host checks above
            # are what keep a page of another site from sending one.
            if not (request.path == FILES_PATH and request.content_type == "multipart/form-data"):
                check_json(request, "requests to a pool without tenants")
        return await handler(request)
    return middleware
