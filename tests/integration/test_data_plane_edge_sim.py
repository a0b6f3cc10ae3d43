"""Without tenants, a browser page of another site cannot drive the data plane (issue 39, item 5): on
a real `llm-pool serve` (real supervisord, a sim replica), raw HTTP requests with the exact headers a
browser or a DNS-rebinding page sends are refused as on the admin API, while API clients (no Origin,
a JSON body) and the page's own same-origin requests are served."""
from __future__ import annotations

import json
import socket
from typing import Any, Iterator

import pytest

from helpers import ProxyProcess

pytestmark = pytest.mark.integration

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "allow_remote": True}
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": {"model": "sim", "prompt": "hi", "max_tokens": 2},
          "/v1/responses": {"model": "sim", "input": "hi"},
          "/v1/messages": {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


@pytest.fixture(scope="module")
def proxy() -> Iterator[ProxyProcess]:
    import yaml

    p = ProxyProcess({"sim": {"backend": "sim", "enabled": True, "sim": {"ttft_ms": 1}}})
    p.config["service"]["server_names"] = ["gpu-box"]   # the LAN name its clients use
    p.config_path.write_text(yaml.safe_dump(p.config))
    p.start()
    try:
        p.wait_state("sim", "loaded")
        yield p
    finally:
        assert not p.cleanup()


def ask(proxy: ProxyProcess, headers: dict[str, str], path: str = "/v1/chat/completions",
        method: str = "POST") -> tuple[int, Any]:
    """One raw HTTP/1.1 request: the headers go out exactly as given (Host included, no other added)."""
    port = int(proxy.url.rsplit(":", 1)[1])
    body = json.dumps(BODIES[path]).encode() if method == "POST" else b""
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\n{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                     .encode() + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    payload = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    return status, (payload.get("error") or {}).get("code") if status >= 400 else None


def own(proxy: ProxyProcess) -> str:
    return proxy.url.split("//", 1)[1]   # 127.0.0.1:PORT


def test_api_clients_and_the_pages_own_requests_are_served(proxy: ProxyProcess) -> None:
    port = own(proxy).rsplit(":", 1)[1]
    json_type = {"Content-Type": "application/json"}
    for host in (own(proxy), f"localhost:{port}", f"[::1]:{port}"):
        assert ask(proxy, {"Host": host, **json_type}) == (200, None), host
    assert ask(proxy, {"Host": own(proxy), "Content-Type": "application/json; charset=utf-8"}) == (200, None)
    # The status page (and anything served from this origin): Origin is the listener's own.
    assert ask(proxy, {"Host": own(proxy), "Origin": f"http://{own(proxy)}", **json_type}) == (200, None)
    for path in BODIES:
        assert ask(proxy, {"Host": own(proxy), **json_type}, path)[0] == 200, path
    # Reading what is served stays open to monitors under any name.
    assert ask(proxy, {"Host": "pool.example"}, "/v1/models", "GET")[0] == 200


@pytest.mark.parametrize("path", list(BODIES))
def test_the_issues_request_is_refused_on_every_route(proxy: ProxyProcess, path: str) -> None:
    # A text/plain POST with a foreign Origin and a rebinding Host: each part alone is refused too.
    # (/v1/messages answers in Anthropic's shape, which has no code.)
    code = (lambda c: None) if path == "/v1/messages" else (lambda c: c)
    assert ask(proxy, {"Host": "evil.example:8011", "Origin": "http://attacker.example",
                       "Content-Type": "text/plain"}, path) == (403, code("origin_not_allowed"))
    assert ask(proxy, {"Host": own(proxy), "Content-Type": "text/plain"}, path) == (415, code("unsupported_media_type"))


@pytest.mark.parametrize("headers, refusal", [
    ({"Origin": "http://attacker.example", "Content-Type": "application/json"}, (403, "origin_not_allowed")),
    ({"Origin": "null", "Content-Type": "application/json"}, (403, "origin_not_allowed")),
    ({"Content-Type": "application/x-www-form-urlencoded"}, (415, "unsupported_media_type")),
    ({"Content-Type": "multipart/form-data; boundary=x"}, (415, "unsupported_media_type")),
    ({}, (415, "unsupported_media_type")),   # a Blob body without a type: no preflight either
])
def test_a_browsers_cross_site_post_is_refused(proxy: ProxyProcess, headers: dict[str, str],
                                              refusal: tuple[int, str]) -> None:
    assert ask(proxy, {"Host": own(proxy), **headers}) == refusal


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8011", "localhost.evil.example",
                                  "127.0.0.1.nip.io", "\xff"])
def test_a_dns_rebinding_page_is_refused_by_its_host(proxy: ProxyProcess, host: str) -> None:
    # After rebinding, the page is of the attacker's name: its Origin matches its Host.
    assert ask(proxy, {"Host": host, "Origin": f"http://{host}", "Content-Type": "application/json"}) == \
        (403, "host_not_allowed")


def test_with_tenants_a_key_is_the_guard_and_any_name_or_type_is_served() -> None:
    import yaml

    p = ProxyProcess({"sim": {"backend": "sim", "enabled": True, "sim": {"ttft_ms": 1}}})
    p.config["tenants"] = {"t": {"key_env": ["EDGE_TENANT_KEY"], "fairness_key": "t"}}
    p.config_path.write_text(yaml.safe_dump(p.config))
    p.env = {"EDGE_TENANT_KEY": "sk-edge-tenant"}
    p.start()
    try:
        p.wait_state("sim", "loaded")
        # A browser cannot send a key cross-site without the preflight this proxy never grants.
        assert ask(p, {"Host": "pool.example", "Content-Type": "text/plain"}) == (401, "invalid_api_key")
        assert ask(p, {"Host": "pool.example", "Content-Type": "text/plain",
                       "Authorization": "Bearer sk-edge-tenant"}) == (200, None)
    finally:
        assert not p.cleanup()


def test_a_name_the_admin_lists_in_server_names_is_served(proxy: ProxyProcess) -> None:
    port = own(proxy).rsplit(":", 1)[1]
    for host in ("gpu-box", f"gpu-box:{port}", f"GPU-BOX:{port}"):
        assert ask(proxy, {"Host": host, "Content-Type": "application/json"}) == (200, None)
    assert ask(proxy, {"Host": f"gpu-box.evil.example:{port}", "Content-Type": "application/json"}) == \
        (403, "host_not_allowed")
