"""The admin API's exposure: the token (required when configured, never written to the log), the
separate admin listener, and what keeps a page of another site out (Origin, Host, JSON-only POSTs)."""
from __future__ import annotations

from http.client import HTTPConnection
import json
from urllib.parse import urlsplit

import pytest

from helpers import ProxyProcess, free_port, http, wait_for

pytestmark = pytest.mark.integration

TOKEN = "s3cret-admin-token-for-tests"


def test_admin_endpoints_need_the_bearer_token_and_the_log_never_shows_it(proxies) -> None:
    proxy = ProxyProcess({"sim": {"backend": "sim", "enabled": False}},
                         service={"admin_token_env": "LLM_POOL_TEST_ADMIN_TOKEN", "log_level": "debug"})
    proxy.env["LLM_POOL_TEST_ADMIN_TOKEN"] = TOKEN
    proxies.append(proxy)
    proxy.start()
    for method, path in (("GET", "/v1/admin/models"), ("POST", "/v1/admin/models/sim/load"),
                         ("GET", "/v1/admin/gpu-memory"), ("GET", "/v1/admin/models/sim/logs"),
                         ("GET", "/v1/admin/traffic")):
        status, _, body = http(method, proxy.url + path)
        assert (status, body["error"]["code"]) == (401, "invalid_admin_token")
        status, _, body = http(method, proxy.url + path, headers={"Authorization": "Bearer wrong"})
        assert status == 401
    status, _, body = http("GET", proxy.url + "/v1/admin/models", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and body["data"][0]["state"] == "unloaded"
    status, _, _ = http("GET", proxy.url + "/v1/models")
    assert status == 200  # the public API needs no admin token
    proxy.stop()
    assert TOKEN not in proxy.log_path.read_text()


def test_a_separate_admin_listener_serves_the_admin_api_and_only_it(proxies) -> None:
    admin_port = free_port()
    proxy = ProxyProcess({"sim": {"backend": "sim", "enabled": False}},
                         service={"admin_host": "127.0.0.1", "admin_port": admin_port})
    proxies.append(proxy)
    proxy.start()
    admin = f"http://127.0.0.1:{admin_port}"
    status, _, body = http("GET", proxy.url + "/v1/admin/models")
    assert (status, body["error"]["code"]) == (404, "not_found")
    status, _, body = http("POST", proxy.url + "/v1/admin/models/sim/load")
    assert status == 404
    status, _, body = http("GET", admin + "/v1/admin/models")
    assert status == 200 and body["data"][0]["id"] == "sim"
    assert http("GET", admin + "/v1/models")[0] == 404
    assert http("GET", proxy.url + "/v1/models")[0] == 200
    assert http("GET", admin + "/health")[0] == 200
    # The status page reads the admin API, so it is served beside it and only there.
    assert http("GET", proxy.url + "/ui")[0] == 404
    assert http("GET", admin + "/ui")[0] == 200


def test_a_page_of_another_site_cannot_load_unload_or_scale(proxies) -> None:
    # What a browser sends cross-site without a preflight: text/plain or no type at all, with its Origin.
    proxy = ProxyProcess({"warm": {"backend": "sim", "enabled": True, "replica_max": 2},
                          "cold": {"backend": "sim", "enabled": False}})
    proxies.append(proxy)
    proxy.start()
    proxy.wait_state("warm", "loaded")
    evil = {"Origin": "http://evil.example"}
    for name, action, body in (("warm", "unload", None), ("warm", "scale", {"replicas": 2}), ("cold", "load", {})):
        url = f"{proxy.url}/v1/admin/models/{name}/{action}"
        raw = json.dumps(body).encode() if body is not None else b""
        status, _, answer = http("POST", url, raw=raw, headers={"Content-Type": "text/plain", **evil})
        assert (status, answer["error"]["code"]) == (403, "origin_not_allowed"), answer
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            status, _, answer = http("POST", url, raw=raw, headers={"Content-Type": content_type})
            assert (status, answer["error"]["code"]) == (415, "unsupported_media_type"), (content_type, answer)
        assert _post_without_a_type(url) == 415
        status, _, answer = http("POST", url, body, headers=evil)   # JSON, but from another site
        assert (status, answer["error"]["code"]) == (403, "origin_not_allowed"), answer
    warm, cold = proxy.admin_model("warm"), proxy.admin_model("cold")
    assert (warm["state"], len(warm["replicas"]), cold["state"]) == ("loaded", 1, "unloaded")
    # The status page's own requests: its Origin is the listener's.
    status, _, answer = http("POST", proxy.url + "/v1/admin/models/warm/scale", {"replicas": 2},
                             headers={"Origin": proxy.url})
    assert status == 200 and len(answer["replicas"]) == 2, answer
    status, _, answer = http("POST", proxy.url + "/v1/admin/models/warm/unload", headers={"Origin": proxy.url})
    assert (status, answer["state"]) == (200, "unloaded"), answer


def test_without_a_token_a_rebinding_host_is_refused_and_loopback_names_are_not(proxies) -> None:
    proxy = ProxyProcess({"sim": {"backend": "sim", "enabled": False}})
    proxies.append(proxy)
    proxy.start()
    # DNS rebinding: the attacker's name, now pointing at 127.0.0.1, with its own (matching) Origin.
    rebound = f"evil.example:{proxy.port}"
    for headers in ({"Host": rebound}, {"Host": rebound, "Origin": f"http://{rebound}"}):
        status, _, answer = http("GET", proxy.url + "/v1/admin/models", headers=headers)
        assert (status, answer["error"]["code"]) == (403, "host_not_allowed"), answer
    status, _, answer = http("POST", proxy.url + "/v1/admin/models/sim/load", {}, headers={"Host": rebound})
    assert (status, answer["error"]["code"]) == (403, "host_not_allowed"), answer
    for host in (f"localhost:{proxy.port}", f"127.0.0.1:{proxy.port}", f"[::1]:{proxy.port}"):
        assert http("GET", proxy.url + "/v1/admin/models", headers={"Host": host})[0] == 200, host
    assert http("GET", proxy.url + "/v1/models", headers={"Host": rebound})[0] == 200   # the public API is not guarded


def test_with_a_token_any_host_name_is_served_and_a_malformed_authorization_is_401(proxies) -> None:
    proxy = ProxyProcess({"sim": {"backend": "sim", "enabled": False}},
                         service={"admin_token_env": "LLM_POOL_TEST_ADMIN_TOKEN"})
    proxy.env["LLM_POOL_TEST_ADMIN_TOKEN"] = TOKEN
    proxies.append(proxy)
    proxy.start()
    # urllib sends header text as latin-1: "\xff" is the byte 0xff, which is no UTF-8.
    for value in ("Bearer \xff", f"Basic {TOKEN}", "Bearer", f"Bearer\xff{TOKEN}", f"Bearer {TOKEN}\xff"):
        status, _, answer = http("GET", proxy.url + "/v1/admin/models", headers={"Authorization": value})
        assert (status, answer["error"]["code"]) == (401, "invalid_admin_token"), (value, answer)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # A page that rebinds a name cannot know the token: behind one, any name the admin uses is fine.
    assert http("GET", proxy.url + "/v1/admin/models", headers={**auth, "Host": "pool.example"})[0] == 200
    status, _, answer = http("GET", proxy.url + "/v1/admin/models",
                             headers={**auth, "Origin": "http://evil.example"})
    assert (status, answer["error"]["code"]) == (403, "origin_not_allowed")
    proxy.stop()
    assert "Traceback" not in proxy.log_path.read_text()


def test_the_public_listener_shows_states_and_the_admin_listener_the_reasons(proxies, tiny_gguf, tmp_path) -> None:
    failing = tmp_path / "failing-server"
    failing.write_text("#!/bin/sh\necho 'failing-server: cannot open /srv/secret/model.gguf'\nexit 3\n")
    failing.chmod(0o755)
    admin_port = free_port()
    proxy = ProxyProcess({"fine": {"backend": "sim", "enabled": True},
                          "broken": {"backend": "llama_server", "model_path": str(tiny_gguf),
                                     "llama_server_binary": str(failing), "enabled": True}},
                         service={"admin_host": "127.0.0.1", "admin_port": admin_port,
                                  "load_retry_base_s": 3600, "load_retry_max_s": 3600})
    proxies.append(proxy)
    proxy.start()
    admin = f"http://127.0.0.1:{admin_port}"
    wait_for(lambda: http("GET", proxy.url + "/ready")[0] == 200, what="the startup loads")
    for path in ("/health", "/ready"):
        status, _, public = http("GET", proxy.url + path)
        assert status == 200 and "/srv/secret" not in json.dumps(public), public
        status, _, private = http("GET", admin + path)
        assert status == 200 and "/srv/secret" in json.dumps(private), private
    _, _, public = http("GET", proxy.url + "/health")
    assert public["models"] == {"fine": "loaded", "broken": "failed"} and set(public["errors"]) == {"broken"}
    _, _, public = http("GET", proxy.url + "/ready")
    assert public["models"]["broken"]["state"] == "failed" and "reason" not in public["models"]["broken"]


def _post_without_a_type(url: str) -> int:
    """A POST with no body and no Content-Type at all (what `fetch(url, {method: "POST"})` sends)."""
    parts = urlsplit(url)
    conn = HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("POST", parts.path)
        return conn.getresponse().status
    finally:
        conn.close()
