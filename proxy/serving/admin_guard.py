"""What every admin request must be before its handler acts: the admin API is out of reach of a
browser page of another site (DESIGN.md, Trust boundaries).

A page on any site can make a browser send simple requests to loopback (a `text/plain` POST, or no
body at all: no preflight), and with DNS rebinding read the answers under its own host name. So:
- an `Origin`, when sent, is this listener's own (browsers send it on every cross-site POST);
- without a token, `Host` is a name this machine answers to: a literal address, `localhost`, the
  configured host (a rebinding page's requests carry the attacker's own name);
- with a token, the bearer token;
- a POST is `Content-Type: application/json`, which another site cannot send without a CORS
  preflight that this API never grants.
Only the admin handlers call `admit`: the data path pays nothing for it. The data plane of a pool
without tenants follows the same rules (proxy/serving/edge_guard.py).
"""
from __future__ import annotations

import hmac
import ipaddress
import os
from urllib.parse import urlsplit

from aiohttp import web

from proxy.config.settings import ServiceSettings
from proxy.errors import Forbidden, Unauthorized, UnsupportedMediaType
from proxy.serving.keys import SETTINGS

JSON = "application/json"


def admit(request: web.Request) -> None:
    """Raise the refusal an admin request earns (403, 401, 415), or return."""
    service = request.app[SETTINGS].service
    check_origin(request, "the admin API")
    if service.admin_token_env:
        _authorize(request, service.admin_token_env)
    elif not host_allowed(request.headers.get("Host", ""), service):
        raise Forbidden(f"Host {request.headers.get('Host', '')!r:.100} is not a name of this admin API: without a "
                        "token it answers only to an address, localhost, service.host/admin_host or "
                        "service.server_names (a DNS-rebinding page uses its own name); add the name to "
                        "service.server_names or set service.admin_token_env to reach it under another name",
                        code="host_not_allowed")
    if request.method == "POST":
        check_json(request, "admin POSTs")


def check_json(request: web.Request, what: str) -> None:
    """415 unless the body is declared JSON: a page of another site cannot declare it without a preflight."""
    if request.content_type != JSON:
        raise UnsupportedMediaType(f"{what} need `Content-Type: {JSON}` (this one has "
                                   f"{request.headers.get('Content-Type', 'none')!r:.80})")


def _authorize(request: web.Request, env: str) -> None:
    """`serve` refuses to start when the token's variable is unset or empty; should it become empty
    later, every call is refused."""
    token = os.environ.get(env, "").strip()
    if not token:
        raise Unauthorized(f"the admin API is closed: {env} is unset or empty")
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # aiohttp keeps a header's undecodable bytes as surrogates: compared as bytes that always encode,
    # such a header is a wrong token (401), never an encoding error (500).
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                                                             token.encode("utf-8", "surrogatepass")):
        raise Unauthorized("admin endpoints need `Authorization: Bearer <admin token>`")


def check_origin(request: web.Request, surface: str) -> None:
    """403 for an `Origin` that is not this listener's own (`surface` names what refuses it)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return
    # Behind a reverse proxy that rewrites Host, X-Forwarded-Host is the name the browser used; a page
    # of another site cannot set it (a custom header needs the preflight this API never grants).
    own = {h.strip().lower() for h in (request.headers.get("Host", ""),
                                       request.headers.get("X-Forwarded-Host", "").split(",")[0]) if h.strip()}
    try:
        parts = urlsplit(origin)
        netloc = parts.netloc.lower() if parts.scheme in ("http", "https") and not parts.path else ""
    except ValueError:
        netloc = ""
    if not netloc or netloc not in own:
        raise Forbidden(f"Origin {origin!r:.100} is not this listener's own: {surface} does not answer pages "
                        "of other sites", code="origin_not_allowed")


def host_allowed(host: str, service: ServiceSettings) -> bool:
    """Whether `host` (a Host header) is a name this machine answers to: a literal address (no DNS
    answer stands behind it), `localhost`, service.host/admin_host, or one of service.server_names."""
    name = _host_name(host)
    return name in {n.lower() for n in ("localhost", service.host, service.admin_host, *service.server_names) if n} \
        or _is_address(name)


def _host_name(host: str) -> str:
    """The Host header without its port: `[::1]:8011` is `::1`, `localhost:8011` is `localhost`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_address(name: str) -> bool:
    """A literal IP: no DNS answer stands behind it, so no rebinding can change where it leads."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
