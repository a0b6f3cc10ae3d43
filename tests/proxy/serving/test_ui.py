"""GET /ui: the status page's files, served from the package over real HTTP on loopback, on the
admin listener only when there is one, and carried by a build of the package. What the page does
in a browser is tests/ui/."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from proxy.serving import ui
from proxy.serving.app import admin_listener_middleware
from proxy.serving.errors_http import error_middleware

REPO = Path(__file__).resolve().parents[3]
STATIC = REPO / "proxy" / "serving" / "static"


@pytest.fixture
async def url() -> AsyncIterator[str]:
    app = web.Application(middlewares=[error_middleware])
    app.add_routes(ui.routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    await runner.cleanup()


async def test_the_page_and_every_file_it_links_are_served_with_their_types_and_a_strict_policy(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/ui") as resp:
            assert resp.status == 200 and resp.content_type == "text/html"
            html = await resp.text()
            policy = resp.headers["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
        linked = re.findall(r'(?:src|href)="(ui/[^"]+)"', html)
        assert sorted(linked) == ["ui/ui-api.js", "ui/ui-cards.js", "ui/ui-dom.js", "ui/ui-feed.js", "ui/ui-form.js",
                                  "ui/ui-usage.js", "ui/ui.css", "ui/ui.js"]
        for path in linked:
            kind = "text/css" if path.endswith(".css") else "text/javascript"
            async with session.get(f"{url}/{path}") as resp:
                assert (resp.status, resp.content_type) == (200, kind)
                assert resp.headers["X-Content-Type-Options"] == "nosniff"
                assert (await resp.read()) == (STATIC / Path(path).name).read_bytes()


def test_the_page_loads_nothing_from_another_origin() -> None:
    """No CDN, no font service: the machine running the proxy may have no internet."""
    for name in (ui.PAGE, *ui.ASSETS):
        text = (STATIC / name).read_text(encoding="utf-8")
        assert not re.search(r"""(?:src|href)\s*=\s*["'](?:https?:)?//""", text), name
        assert not re.search(r"""(?:fetch\(|url\()\s*["']?(?:https?:)?//""", text), name
        assert "@import" not in text, name


async def test_a_file_the_page_does_not_have_is_404_in_the_envelope_and_no_path_reaches_the_disk(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for path in ("/ui/app.py", "/ui/..%2Fui.py", "/ui/%2E%2E%2F%2E%2E%2Fapp.py"):
            async with session.get(url + path) as resp:
                body = await resp.json()
                assert (resp.status, body["error"]["code"]) == (404, "not_found"), path
        async with session.get(url + "/ui/", allow_redirects=False) as resp:
            # Relative, so that behind a reverse proxy's prefix it still lands on the page.
            assert (resp.status, resp.headers["Location"]) == (308, "../ui")


async def test_with_an_admin_listener_the_page_answers_there_and_not_on_the_public_one() -> None:
    admin_sock, public_sock = socket.socket(), socket.socket()
    for sock in (admin_sock, public_sock):
        sock.bind(("127.0.0.1", 0))
    admin_port = admin_sock.getsockname()[1]
    app = web.Application(middlewares=[error_middleware, admin_listener_middleware(admin_port)])
    app.add_routes(ui.routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for sock in (admin_sock, public_sock):
        await web.SockSite(runner, sock).start()
    public, admin = (f"http://127.0.0.1:{s.getsockname()[1]}" for s in (public_sock, admin_sock))
    try:
        async with aiohttp.ClientSession() as session:
            for path in ("/ui", "/ui/ui.js"):
                async with session.get(public + path) as resp:
                    assert resp.status == 404, path
                async with session.get(admin + path) as resp:
                    assert resp.status == 200, path
    finally:
        await runner.cleanup()


def test_a_build_of_the_package_carries_the_page(tmp_path: Path) -> None:
    """What a wheel (and `pip install .`) holds is what build_py copies: the page must be in it."""
    build = tmp_path / "lib"
    done = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q",
                           "egg_info", "--egg-base", str(tmp_path), "build_py", "--build-lib", str(build)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in (ui.PAGE, *ui.ASSETS):
        assert (build / "proxy" / "serving" / "static" / name).read_bytes() == (STATIC / name).read_bytes()


def _luminance(hex_colour: str) -> float:
    channels = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def test_every_text_colour_of_the_page_meets_wcag_aa_contrast_on_its_backgrounds() -> None:
    css = (STATIC / "ui.css").read_text(encoding="utf-8")
    colours = dict(re.findall(r"--([\w-]+):\s*(#[0-9a-fA-F]{6})", css))
    for text in ("text", "muted", "ok", "warn", "bad", "info"):
        for background in ("bg", "panel"):
            light, dark = sorted((_luminance(colours[text]), _luminance(colours[background])), reverse=True)
            ratio = (light + 0.05) / (dark + 0.05)
            assert ratio >= 4.5, f"--{text} on --{background}: {ratio:.2f}:1"
