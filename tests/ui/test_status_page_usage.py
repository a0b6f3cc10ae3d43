"""The status page's usage view in a real headless Chromium: with tenants, each tenant's requests,
tokens and cost today per model, read from the ledger; without tenants the view is not shown."""
from __future__ import annotations

from typing import Any, Iterator

import pytest
import yaml

from helpers import ProxyProcess, http, status_page

pytestmark = pytest.mark.integration
expect = pytest.importorskip("playwright.sync_api", reason="the `playwright` package is not installed").expect

TOKEN_ENV, TOKEN = "LLM_POOL_TEST_UI_TOKEN", "ui-usage-admin-token"
KEY = "sk-ui-usage-SECRET-42"


@pytest.fixture(scope="module")
def pool() -> Iterator[ProxyProcess]:
    proxy = ProxyProcess({"sim": {"backend": "sim", "enabled": True, "price_per_mtok": {"input": 1.0, "output": 2.0},
                                  "sim": {"max_seqs": 4, "ttft_ms": 1, "decode_tokens_per_s": 2000}}},
                         service={"admin_token_env": TOKEN_ENV})
    proxy.config["tenants"] = {"notebook": {"key_env": ["NOTEBOOK_KEY"], "fairness_key": "notebook"}}
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.env = {TOKEN_ENV: TOKEN, "NOTEBOOK_KEY": KEY}
    proxy.admin_headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        proxy.start()
        proxy.wait_state("sim", "loaded")
        yield proxy
    finally:
        survivors = proxy.cleanup()
        assert not survivors, f"processes outlived the tests and were killed: {survivors}"


def test_the_usage_view_shows_what_each_tenant_used_today(browser: Any, pool: ProxyProcess) -> None:
    for _ in range(3):
        status, _, _ = http("POST", pool.url + "/v1/chat/completions",
                            {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
                            headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200
    with status_page(browser, pool.url, 1366, 900) as page:
        page.get_by_label("Admin token").fill(TOKEN)
        page.get_by_role("button", name="Use token").click()
        row = page.locator("#usage tbody tr").first
        expect(page.locator("#usage")).to_be_visible()
        expect(row.locator("td").nth(0)).to_have_text("notebook")
        expect(row.locator("td").nth(1)).to_have_text("sim")
        expect(row.locator("td").nth(2)).to_have_text("3")
        expect(row.locator("td").nth(6)).to_have_text("15")   # 3 answers of 5 tokens
        assert KEY not in page.content()
