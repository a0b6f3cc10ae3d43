"""A reload keeps a tenant's budget (issue 39, item 8): what the old process spends on the requests it
finishes while it drains counts in its successor, which records into the same ledger file. Real
`llm-pool serve` processes under a real supervisord with a sim replica, SIGUSR1 as an admin sends it."""
from __future__ import annotations

import threading
from typing import Any

import pytest
import yaml

from helpers import ProxyProcess, http, sim_model, wait_for

pytestmark = pytest.mark.integration
KEY = "sk-tenant-SECRET-81"
BUDGET = 100
LONG = 200       # the output of the request the old process drains: more than the whole budget


def chat(proxy: ProxyProcess, max_tokens: int) -> tuple[int, Any]:
    status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                           {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    return status, body


def test_what_the_old_process_spends_while_it_drains_counts_in_its_successor(proxies: list) -> None:
    # 20 tokens a second: the long request is still running when the successor has started.
    proxy = ProxyProcess({"sim": sim_model(sim={"ttft_ms": 1, "decode_tokens_per_s": 20})})
    proxy.config["tenants"] = {"t": {"key_env": ["TENANT_KEY"], "fairness_key": "t",
                                     "budget": {"period": "day", "tokens": BUDGET}}}
    proxy.env = {"TENANT_KEY": KEY}
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxies.append(proxy)
    proxy.start()
    proxy.wait_state("sim", "loaded")
    answers: list[tuple[int, Any]] = []
    long = threading.Thread(target=lambda: answers.append(chat(proxy, LONG)))
    long.start()
    try:
        wait_for(lambda: any(k["active"] for k in proxy.admin_model("sim")["keys"].values()),
                 what="the long request to run")
        proxy.reload()   # returns once the old process, having finished the long request, has exited
    finally:
        long.join(120)
    assert answers and answers[0][0] == 200 and answers[0][1]["usage"]["completion_tokens"] == LONG
    status, body = chat(proxy, 4)   # the budget was spent in the old process, before it exited
    assert status == 429 and body["error"]["code"] == "budget_exceeded", body
    status, _, usage = http("GET", proxy.url + "/v1/admin/usage?group_by=tenant")
    assert status == 200
    (row,) = usage["data"]
    assert row["output_tokens"] == LONG and row["requests"] == 2   # the long one, and the 429
