"""`GET /ui`: the status page, served from files in the package (proxy/serving/static/).

The page is plain HTML, CSS and JavaScript, no build step and nothing fetched from elsewhere (the
machine may have no internet). It holds no data of its own: the browser reads the admin API with
the token the admin types there, so serving the files needs no token, and the page answers on the
admin listener where one is configured (app.admin_listener_middleware). Only the files named here
are served: a request never names a path on disk.
"""
from __future__ import annotations

from importlib import resources

from aiohttp import web

from proxy.errors import NotFound

routes = web.RouteTableDef()

PAGE = "ui.html"
ASSETS = {"ui-dom.js": "text/javascript", "ui-api.js": "text/javascript", "ui-form.js": "text/javascript",
          "ui-cards.js": "text/javascript", "ui-feed.js": "text/javascript", "ui-usage.js": "text/javascript",
          "ui.js": "text/javascript", "ui.css": "text/css"}
# The page may run only its own script and style and talk only to this origin: a model id or a log
# line rendered into it can never load or run anything, and no other site may frame it (the admin
# token is typed into it).
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; form-action 'none'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Always asked again, so a proxy upgraded in place serves its own page, never a cached one.
    "Cache-Control": "no-cache",
}


def is_ui_path(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/")


def _read(name: str) -> bytes:
    return resources.files("proxy.serving").joinpath("static", name).read_bytes()


@routes.get("/ui")
async def page(request: web.Request) -> web.Response:
    return web.Response(body=_read(PAGE), content_type="text/html", charset="utf-8", headers=HEADERS)


@routes.get("/ui/")
async def page_slash(request: web.Request) -> web.Response:
    # The page's links are relative (so it works behind a reverse proxy under a prefix): they must
    # resolve from /ui, not /ui/.
    raise web.HTTPPermanentRedirect("../ui")


@routes.get("/ui/{asset}")
async def asset(request: web.Request) -> web.Response:
    name = request.match_info["asset"]
    content_type = ASSETS.get(name)
    if content_type is None:
        raise NotFound(f"no file {name!r} in the status page; it has {', '.join(sorted(ASSETS))}",
                       code="not_found")
    return web.Response(body=_read(name), content_type=content_type, charset="utf-8", headers=HEADERS)
