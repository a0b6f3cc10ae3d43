"""The admin token: required when configured, and never written to the log."""
from __future__ import annotations

import pytest

from helpers import ProxyProcess, free_port, http

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
