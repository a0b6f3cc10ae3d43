"""Tenants on a real `llm-pool serve` (real supervisord, sim replicas) with its real SQLite ledger:
every refusal of the data plane with its status and code, the fairness share following the key and
not the body, usage in the ledger with its cost and across a restart, keys minted and revoked
through the admin API, and the OpenAI and Anthropic SDKs with their keys."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import anthropic
import openai
import pytest
import yaml

from helpers import ProxyProcess, http, wait_for

pytestmark = pytest.mark.integration

KEYS = {"WEBUI_KEY": "sk-webui-SECRET-1f2e3d", "LIMITED_KEY": "sk-limited-SECRET-9a8b", "BROKE_KEY": "sk-broke-SECRET-77"}
BATCH_KEY = "sk-batch-SECRET-4c5d6e"   # configured by its digest only
ADMIN_TOKEN = "admin-SECRET-0011"
WEBUI_KEY_ID = hashlib.sha256(KEYS["WEBUI_KEY"].encode()).hexdigest()[:12]   # the id usage's key_id shows
SIM = {"max_seqs": 8, "decode_tokens_per_s": 2000, "ttft_ms": 1}
PRICE = {"input": 2.0, "cached_input": 1.0, "output": 10.0}
TENANTS = {
    "webui": {"key_env": ["WEBUI_KEY", "ADMIN_TOKEN_VAR"], "fairness_key": "interactive", "weight": 4.0},
    "batch": {"key_sha256": [hashlib.sha256(BATCH_KEY.encode()).hexdigest()], "fairness_key": "batch",
              "models": ["sim-*"]},
    "limited": {"key_env": ["LIMITED_KEY"], "fairness_key": "limited", "limits": {"requests_per_minute": 2}},
    "broke": {"key_env": ["BROKE_KEY"], "fairness_key": "broke", "budget": {"period": "day", "tokens": 20}},
}
MODELS = {
    "sim-a": {"backend": "sim", "enabled": True, "target_inflight": 4, "sim": SIM, "price_per_mtok": PRICE},
    # One slot, slow: requests queue behind each other, under their fairness keys.
    "sim-slow": {"backend": "sim", "enabled": True, "target_inflight": 1, "sim": {**SIM, "ttft_ms": 1500}},
    "private": {"backend": "sim", "enabled": True, "sim": SIM},
    "remote": {"backend": "openai_remote", "remote_base_url": "http://127.0.0.1:9/v1", "remote_model": "x",
               "remote_api_key_env": None, "remote_health_check": "config_only", "enabled": True},
}
CHAT = [{"role": "user", "content": "hi"}]


def start(state_dir: Path | None = None, workers: int = 1) -> ProxyProcess:
    proxy = ProxyProcess(MODELS, service={"admin_token_env": "ADMIN_TOKEN_VAR", "workers": workers},
                         state_dir=state_dir, engine={"fairness": {"max_queue_wait_s": 60}})
    proxy.config["tenants"] = TENANTS
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.env = {**KEYS, "ADMIN_TOKEN_VAR": ADMIN_TOKEN}
    proxy.admin_headers = bearer(ADMIN_TOKEN)
    proxy.start()
    for name in ("sim-a", "sim-slow", "private", "remote"):
        proxy.wait_state(name, "loaded")
    return proxy


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def proxy(request: pytest.FixtureRequest) -> Iterator[ProxyProcess]:
    """Every test here with one process, and with two workers (docs/workers.md): limits, budgets and
    the ledger are the controller's, so they hold across the workers."""
    started = start(workers=request.param)
    try:
        yield started
    finally:
        survivors = started.cleanup()
        assert not survivors, survivors


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ADMIN = bearer(ADMIN_TOKEN)


def chat(proxy: ProxyProcess, key: str | None, model: str = "sim-a", **fields: Any) -> tuple[int, dict, Any]:
    return http("POST", proxy.url + "/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 4,
                                                             **fields}, headers=bearer(key) if key else None)


def usage(proxy: ProxyProcess, query: str = "group_by=tenant,model") -> list[dict[str, Any]]:
    status, _, body = http("GET", proxy.url + "/v1/admin/usage?" + query, headers=ADMIN)
    assert status == 200, body
    return list(body["data"])


# -- who is calling ----------------------------------------------------------------------------------

def test_a_request_without_a_key_it_knows_is_401(proxy: ProxyProcess) -> None:
    for key in (None, "sk-wrong", ADMIN_TOKEN):   # the admin token is never a data-plane key
        status, _, body = chat(proxy, key)
        assert (status, body["error"]["code"]) == (401, "invalid_api_key"), body
    status, _, body = http("GET", proxy.url + "/v1/models")
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    assert chat(proxy, KEYS["WEBUI_KEY"])[0] == 200
    assert chat(proxy, BATCH_KEY)[0] == 200                                     # a configured digest
    status, _, _ = http("POST", proxy.url + "/v1/chat/completions", {"model": "sim-a", "messages": CHAT},
                        headers={"x-api-key": KEYS["WEBUI_KEY"]})            # Anthropic clients' header
    assert status == 200


def test_a_tenant_uses_only_the_models_its_globs_allow_and_sees_only_those(proxy: ProxyProcess) -> None:
    status, _, body = chat(proxy, BATCH_KEY, model="private")
    assert (status, body["error"]["code"], body["error"]["param"]) == (403, "model_not_allowed", "model")
    status, _, listed = http("GET", proxy.url + "/v1/models", headers=bearer(BATCH_KEY))
    assert status == 200 and {m["id"] for m in listed["data"]} == {"sim-a", "sim-slow"}
    status, _, listed = http("GET", proxy.url + "/v1/models", headers=bearer(KEYS["WEBUI_KEY"]))
    assert {m["id"] for m in listed["data"]} == set(MODELS)


def test_a_tenant_without_allow_remote_gets_no_remote_model_whatever_the_body_says(proxy: ProxyProcess) -> None:
    status, _, body = chat(proxy, KEYS["WEBUI_KEY"], model="remote", allow_remote=True)
    assert (status, body["error"]["code"]) == (403, "remote_not_allowed")
    assert "allow_remote" in body["error"]["message"]


def test_a_limit_reached_is_429_rate_limited_with_retry_after(proxy: ProxyProcess) -> None:
    # A route the model is not served on is refused before it counts toward the limit.
    for _ in range(2):
        status, _, body = http("POST", proxy.url + "/infill", {"model": "sim-a", "input_prefix": "x"},
                               headers=bearer(KEYS["LIMITED_KEY"]))
        assert (status, body["error"]["code"]) == (400, "endpoint_unsupported")
    assert [chat(proxy, KEYS["LIMITED_KEY"])[0] for _ in range(2)] == [200, 200]
    status, headers, body = chat(proxy, KEYS["LIMITED_KEY"])
    assert (status, body["error"]["code"]) == (429, "rate_limited")
    assert 1 <= int(headers["Retry-After"]) <= 60


def test_a_spent_budget_is_429_budget_exceeded_until_the_period_ends(proxy: ProxyProcess) -> None:
    status = 200
    while status == 200:   # each answer's tokens are spent: the budget of 20 runs out within a few
        status, headers, body = chat(proxy, KEYS["BROKE_KEY"])
    assert (status, body["error"]["code"]) == (429, "budget_exceeded")
    assert 1 <= int(headers["Retry-After"]) <= 86400
    spent = [r for r in usage(proxy) if r["tenant"] == "broke" and r["model"] == "sim-a"]
    assert spent and spent[0]["prompt_tokens"] + spent[0]["output_tokens"] >= 20


def test_the_share_follows_the_key_not_the_body(proxy: ProxyProcess) -> None:
    # A flood under batch's key that names webui's fairness key waits in batch's queue.
    answers: list[int] = []
    flood = [threading.Thread(target=lambda: answers.append(
        chat(proxy, BATCH_KEY, model="sim-slow", fairness_key="interactive")[0])) for _ in range(3)]
    for t in flood:
        t.start()
    try:
        def busy() -> dict[str, Any] | None:
            keys = proxy.admin_model("sim-slow")["keys"]
            return keys if sum(k["active"] + k["waiting"] for k in keys.values()) >= 3 else None
        keys = wait_for(busy, what="the flood to be queued and running")
        assert set(keys) == {"batch"} and keys["batch"]["active"] + keys["batch"]["waiting"] == 3
    finally:
        for t in flood:
            t.join(60)
    assert answers == [200] * 3


# -- what each spent -------------------------------------------------------------------------------

def test_usage_is_in_the_ledger_with_its_cost_as_json_and_csv(proxy: ProxyProcess) -> None:
    before = {r["tenant"]: r for r in usage(proxy) if r["model"] == "sim-a"}.get("webui", {})
    status, _, answer = chat(proxy, KEYS["WEBUI_KEY"])
    assert status == 200
    row = {r["tenant"]: r for r in usage(proxy) if r["model"] == "sim-a"}["webui"]
    prompt = row["prompt_tokens"] - before.get("prompt_tokens", 0)
    output = row["output_tokens"] - before.get("output_tokens", 0)
    assert (prompt, output) == (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"])
    cost = row["cost"] - before.get("cost", 0.0)
    assert cost == pytest.approx((prompt * PRICE["input"] + output * PRICE["output"]) / 1e6)
    status, headers, text = http("GET", proxy.url + "/v1/admin/usage?group_by=tenant,day&format=csv", headers=ADMIN)
    assert status == 200 and headers["Content-Type"].startswith("text/csv")
    lines = text.decode().splitlines()
    assert lines[0].startswith("tenant,day,requests,") and any(line.startswith("webui,") for line in lines[1:])
    status, _, body = http("GET", proxy.url + "/v1/admin/usage?group_by=colour", headers=ADMIN)
    assert (status, body["error"]["code"], body["error"]["param"]) == (400, "invalid_usage_request", "group_by")


def test_metrics_per_tenant_and_no_key_anywhere(proxy: ProxyProcess) -> None:
    assert chat(proxy, KEYS["WEBUI_KEY"])[0] == 200
    _, _, text = http("GET", proxy.url + "/metrics")
    metrics = text.decode()
    assert 'llm_pool_tenant_requests_total{status="200",tenant="webui"}' in metrics
    assert 'llm_pool_tenant_cost_total{tenant="webui"}' in metrics
    _, _, tenants = http("GET", proxy.url + "/v1/admin/tenants", headers=ADMIN)
    # A key from a variable is named by its id, as a minted one; the admin token's variable holds none.
    assert {t["name"]: t["key_env_ids"] for t in tenants["data"]}["webui"] == {"WEBUI_KEY": WEBUI_KEY_ID,
                                                                             "ADMIN_TOKEN_VAR": None}
    shown = metrics + str(tenants) + proxy.log_path.read_text()
    for key in (*KEYS.values(), BATCH_KEY, ADMIN_TOKEN):
        assert key not in shown


# -- keys an admin mints -----------------------------------------------------------------------

def test_a_minted_key_works_at_once_and_a_revoked_one_fails_on_its_next_request(proxy: ProxyProcess) -> None:
    status, _, minted = http("POST", proxy.url + "/v1/admin/tenants/batch/keys", {}, headers=ADMIN)
    assert status == 200 and minted["key"].startswith("lp-") and minted["id"] not in minted["key"][:3]
    assert chat(proxy, minted["key"])[0] == 200
    status, _, _ = http("DELETE", f"{proxy.url}/v1/admin/tenants/batch/keys/{minted['id']}", headers=ADMIN)
    assert status == 200
    status, _, body = chat(proxy, minted["key"])
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    status, _, body = http("DELETE", f"{proxy.url}/v1/admin/tenants/batch/keys/{minted['id']}", headers=ADMIN)
    assert (status, body["error"]["code"]) == (404, "key_not_found")
    status, _, body = http("POST", proxy.url + "/v1/admin/tenants/nobody/keys", {}, headers=ADMIN)
    assert (status, body["error"]["code"]) == (404, "tenant_not_found")
    assert http("POST", proxy.url + "/v1/admin/tenants/batch/keys", {})[0] == 401   # admin token needed


def test_the_sdks_work_with_their_keys(proxy: ProxyProcess) -> None:
    oai = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEYS["WEBUI_KEY"], max_retries=0)
    assert oai.chat.completions.create(model="sim-a", messages=CHAT, max_tokens=3).usage.completion_tokens == 3  # type: ignore[arg-type, union-attr]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    claude = anthropic.Anthropic(base_url=proxy.url, api_key=KEYS["WEBUI_KEY"], max_retries=0)
    assert claude.messages.create(model="sim-a", max_tokens=3, messages=CHAT).usage.output_tokens == 3  # type: ignore[arg-type]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=proxy.url, api_key="sk-wrong", max_retries=0).messages.create(
            model="sim-a", max_tokens=3, messages=CHAT)  # type: ignore[arg-type]


# -- across a restart --------------------------------------------------------------------------

def test_usage_budgets_and_minted_keys_survive_a_restart() -> None:
    first = start()
    try:
        status, _, minted = http("POST", first.url + "/v1/admin/tenants/webui/keys", {}, headers=ADMIN)
        assert status == 200
        status = 200
        while status == 200:
            status, _, body = chat(first, KEYS["BROKE_KEY"])
        assert body["error"]["code"] == "budget_exceeded"
        before = usage(first)
        first.stop()
        second = start(first.state_dir)
        try:
            assert usage(second) == before                       # every row made it to the file
            assert chat(second, KEYS["BROKE_KEY"])[2]["error"]["code"] == "budget_exceeded"
            assert chat(second, minted["key"])[0] == 200
        finally:
            second.cleanup()
    finally:
        assert not first.cleanup()


# -- from a shell ----------------------------------------------------------------------------------

def ctl(proxy: ProxyProcess, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "--config", str(proxy.config_path), "ctl", *argv],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ADMIN_TOKEN_VAR": ADMIN_TOKEN,
                               "LLM_POOL_LOCAL_SETTINGS_PATH": str(proxy.state_dir / "no-local.yaml")})


def test_ctl_mints_lists_and_revokes_keys_and_reports_usage(proxy: ProxyProcess) -> None:
    minted = ctl(proxy, "keys", "mint", "webui")
    assert minted.returncode == 0, minted.stderr
    key = minted.stdout.splitlines()[0]
    assert key.startswith("lp-") and chat(proxy, key)[0] == 200
    kid = minted.stdout.split("(id ")[1].split(";")[0]
    listed = ctl(proxy, "keys")
    assert listed.returncode == 0 and f"key {kid} minted" in listed.stdout and key not in listed.stdout
    assert f"  key {WEBUI_KEY_ID} from $WEBUI_KEY\n" in listed.stdout
    assert "  key from $ADMIN_TOKEN_VAR: none in use (" in listed.stdout
    assert ctl(proxy, "keys", "revoke", "webui", kid).returncode == 0
    assert chat(proxy, key)[0] == 401
    assert ctl(proxy, "keys", "revoke", "webui").returncode == 2          # no id: a usage error
    assert ctl(proxy, "keys", "revoke", "webui", kid).returncode == 1     # refused: 404 key_not_found
    report = ctl(proxy, "usage", "--group-by", "tenant")
    assert report.returncode == 0 and report.stdout.startswith("TENANT") and "webui" in report.stdout
    as_csv = ctl(proxy, "usage", "--group-by", "tenant,model", "--csv")
    assert as_csv.stdout.splitlines()[0].startswith("tenant,model,requests,errors,")
