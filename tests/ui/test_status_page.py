"""The status page (GET /ui) in a real headless Chromium against a live `llm-pool serve`, with the
sim and the demo llama-server under a real supervisord, and an admin token; the proxy runs two
workers (service.workers: docs/workers.md), so every admin call the page makes goes through one.

One proxy serves the whole file (starting one costs more than a test here); each test opens its
own browser tab, types the token, and leaves the pool as it found it.
"""
from __future__ import annotations

import io
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from helpers import ProxyProcess, http, status_page

pytestmark = pytest.mark.integration
expect = pytest.importorskip("playwright.sync_api", reason="the `playwright` package is not installed").expect

TOKEN_ENV = "LLM_POOL_TEST_UI_TOKEN"
TOKEN = "ui-admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LOAD_S = 90_000   # ms: a llama-server load on a busy 2-core machine


@pytest.fixture(scope="module")
def pool(tiny_gguf: Path, llama_server_bin: Path) -> Iterator[ProxyProcess]:
    proxy = ProxyProcess({
        # One slot of a slow engine: a handful of requests builds a queue that lasts seconds.
        "sim": {"backend": "sim", "enabled": True, "target_inflight": 1, "replica_max": 2,
                "sim": {"max_seqs": 1, "ttft_ms": 5, "decode_tokens_per_s": 40}},
        "demo": {"backend": "llama_server", "model_path": str(tiny_gguf), "llama_server_binary": str(llama_server_bin),
                 "llama_server_n_ctx": 4096, "target_inflight": 2, "enabled": False},
        # Its GGUF is not there (moved, a typo): the page says so, not what the estimate of nothing is.
        "gone": {"backend": "llama_server", "model_path": str(tiny_gguf.parent / "gone.gguf"),
                 "llama_server_binary": str(llama_server_bin), "llama_server_n_gpu_layers": 0, "enabled": False},
    }, service={"admin_token_env": TOKEN_ENV, "workers": 2}, engine={"lifecycle": {"kv_store_mib": 64}})
    proxy.env[TOKEN_ENV] = TOKEN
    try:
        proxy.start()
        yield proxy
    finally:
        survivors = proxy.cleanup()
        assert not survivors, f"processes outlived the tests and were killed: {survivors}"


@pytest.fixture
def page(browser: Any, pool: ProxyProcess) -> Iterator[Any]:
    with status_page(browser, pool.url, 1366, 900) as tab:
        yield tab


def admin_model(pool: ProxyProcess, name: str) -> dict[str, Any]:
    """The model's admin row, read with the token (and its PIDs noted for the cleanup's check)."""
    status, _, body = http("GET", pool.url + "/v1/admin/models", headers=AUTH)
    assert status == 200, body
    (model,) = [m for m in body["data"] if m["id"] == name]
    pool.seen_pids.update(r["pid"] for r in model["replicas"] if r["pid"])
    return dict(model)


def sign_in(page: Any, token: str) -> None:
    page.get_by_label("Admin token").fill(token)
    page.get_by_role("button", name="Use token").click()


def card(page: Any, model: str) -> Any:
    """The model's details, opened from its overview row (the overview shows every model in a line)."""
    toggle = page.get_by_role("button", name=f"Details of {model}", exact=True)
    if toggle.get_attribute("aria-expanded") != "true":
        toggle.click()
    return page.locator(f'section.model[data-model="{model}"]')


def overview_cell(page: Any, model: str, column: int) -> Any:
    return page.locator(f'#overview tbody tr[data-key="{model}"] td').nth(column)


def test_a_wrong_admin_token_shows_the_401_message_and_the_right_one_lists_the_models(page: Any) -> None:
    banner = page.get_by_role("alert")
    expect(banner).to_contain_text("401 invalid_admin_token")
    expect(banner).to_contain_text("type the admin token")
    sign_in(page, "not-the-token")
    expect(banner).to_contain_text("the token typed above was refused")
    expect(page.locator("#overview tbody tr")).to_have_count(0)
    sign_in(page, TOKEN)
    expect(banner).to_be_hidden()
    expect(overview_cell(page, "sim", 1)).to_have_text("loaded")
    expect(overview_cell(page, "demo", 1)).to_have_text("unloaded")
    expect(overview_cell(page, "gone", 13)).to_have_text("file missing")
    expect(overview_cell(page, "gone", 13)).to_have_attribute("title", re.compile(r"^model_path /\S+/gone\.gguf$"))
    expect(page.locator("#usage")).to_be_hidden()   # no tenants: no usage view
    processes = page.locator("#processes")
    expect(processes).to_contain_text(re.compile(r"^controller pid \d+ · \d+ connections · \d+ requests · 2 workers: "
                                                 r"#0 pid \d+ · .*; #1 pid \d+"))
    # The token is kept for the tab: a reload needs no typing.
    page.reload()
    expect(overview_cell(page, "sim", 1)).to_have_text("loaded")
    expect(banner).to_be_hidden()


def test_a_load_from_the_form_with_an_override_then_its_log_followed_then_an_unload(
        page: Any, pool: ProxyProcess) -> None:
    sign_in(page, TOKEN)
    demo = card(page, "demo")
    demo.get_by_role("button", name="Load…").click()
    form = demo.locator("form.load")
    result = form.get_by_role("status")
    n_ctx = form.get_by_label("llama_server_n_ctx", exact=True)
    unlabelled = page.evaluate("() => [...document.querySelectorAll('input, select, textarea')]"
                               ".filter((e) => !e.labels || !e.labels.length).map((e) => e.outerHTML)")
    assert unlabelled == []   # every control of the page and the form has its label
    # The schema's range, from load_constraints, is checked before anything is sent.
    n_ctx.fill("-1")
    form.get_by_role("button", name="Load demo").click()
    expect(result).to_contain_text("llama_server_n_ctx must be at least 0")
    expect(n_ctx).to_have_attribute("aria-invalid", "true")
    assert admin_model(pool, "demo")["state"] == "unloaded"

    n_ctx.fill("2048")
    form.get_by_role("button", name="Load demo").click()
    expect(result).to_contain_text("demo is loaded: 1 of 1 replicas ready", timeout=LOAD_S)
    expect(demo.locator('[data-field="overrides"]')).to_have_text("llama_server_n_ctx=2048")
    expect(demo.locator('[data-field="kv"]')).to_have_text(
        "0 stored (0.0 MiB); saved 0; restored 0 hit, 0 missed, 0 stale")   # its slot store (docs/lifecycle.md: KV cache)
    expect(demo.locator("table.replicas tbody tr")).to_have_count(1)
    expect(demo.locator("table.replicas tbody tr td").nth(1)).to_have_text("local")   # its host
    expect(demo.locator("table.replicas tbody tr td").nth(2)).to_have_text("ready")
    replica = admin_model(pool, "demo")["replicas"][0]
    argv = (Path("/proc") / str(replica["pid"]) / "cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--ctx-size") + 1] == b"4096"   # 2048 per request, 2 slots: the override ran

    # Loaded, it cannot be loaded with other settings (409 model_already_loaded): the form says so
    # and sends nothing, and the card's Load… is off too.
    expect(form.get_by_role("button", name="Load demo")).to_be_disabled()
    expect(form.locator('[data-role="load-refused"]')).to_have_text(
        "demo is loaded: unload it first to load it with other settings")
    expect(demo.get_by_role("button", name="Load…")).to_be_disabled()
    expect(demo.get_by_role("button", name="Unload")).to_be_enabled()

    # The replica's log: its start, then what is written to it after, as it comes.
    demo.get_by_role("button", name="Log of demo replica 0").click()
    log_text = page.locator("#log-text")
    expect(log_text).to_contain_text("model loaded", timeout=10_000)
    expect(log_text).to_contain_text(f"listening on http://127.0.0.1:{replica['port']}")
    log_file = pool.state_dir / "logs" / f"{replica['program']}.log"
    with log_file.open("a") as f:
        f.write("a line written after the log was opened\n")
    expect(log_text).to_contain_text("a line written after the log was opened")
    page.get_by_role("button", name="Close the log").click()
    expect(page.locator("#log")).to_be_hidden()

    page.once("dialog", lambda dialog: dialog.accept())
    demo.get_by_role("button", name="Unload").click()
    expect(demo.locator('output[data-role="action-result"]')).to_contain_text("demo is unloaded", timeout=LOAD_S)
    expect(overview_cell(page, "demo", 1)).to_have_text("unloaded")
    expect(demo.get_by_role("button", name="Unload")).to_be_disabled()   # unloaded: an unload would be 409
    expect(form.get_by_role("button", name="Load demo")).to_be_enabled()
    assert admin_model(pool, "demo")["replicas"] == []
    # Its memory row: a model on the CPU has no GPU figures (the GPU report's estimate is what its
    # file would take on a GPU, nothing it needs here).
    page.get_by_text("Memory per model").click()
    demo_memory = page.locator('#model-memory tbody tr[data-key="demo"] td')
    expect(demo_memory.nth(1)).to_have_text("cpu")
    expect(demo_memory.nth(6)).to_have_text("")
    expect(demo_memory.nth(5)).to_have_text("")


def _chat(url: str, key: str, priority: str | None = None) -> int:
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "fairness_key": key}
    return http("POST", url + "/v1/chat/completions", body,
                headers={"X-Priority-Class": priority} if priority is not None else None)[0]


def test_a_flood_shows_waiting_counts_per_key_and_the_request_rate(page: Any, pool: ProxyProcess,
                                                                    artifacts: Path) -> None:
    sign_in(page, TOKEN)
    expect(overview_cell(page, "sim", 1)).to_have_text("loaded")
    before = int(overview_cell(page, "sim", 11).inner_text())
    sim = card(page, "sim")
    some = re.compile(r"^[1-9]\d*$")
    with ThreadPoolExecutor(16) as pool_of_clients:
        flood = [pool_of_clients.submit(_chat, pool.url, "batch") for _ in range(10)]
        flood += [pool_of_clients.submit(_chat, pool.url, "alice") for _ in range(3)]
        flood += [pool_of_clients.submit(_chat, pool.url, "nightly", "batch") for _ in range(2)]
        # Fairness keys' rows: key, active, waiting, weight, running time.
        expect(sim.locator('table.keys tbody tr[data-key="batch"] td').nth(2)).to_have_text(some)
        expect(sim.locator('table.keys tbody tr[data-key="alice"] td').nth(0)).to_have_text("alice")
        expect(overview_cell(page, "sim", 4)).to_have_text(some)          # waiting
        # Priority classes: the batch class's requests wait behind the default class's.
        expect(sim.locator('[data-field="classes"]')).to_contain_text(re.compile(r"batch 0 active, [12] waiting"))
        expect(overview_cell(page, "sim", 6)).not_to_have_text(re.compile(r"^(–|0\.00)$"))   # requests/s
        page.screenshot(path=str(artifacts / "status-page-under-load.png"), full_page=True)
        print(f"screenshot: {artifacts / 'status-page-under-load.png'}")
        assert [f.result() for f in flood] == [200] * 15
    expect(overview_cell(page, "sim", 11)).to_have_text(str(before + 15))   # requests, the proxy's counter
    expect(overview_cell(page, "sim", 8)).to_have_text(re.compile(r"\d+ (ms|s)$"))   # latency p50
    expect(sim.locator('table.keys tbody tr[data-key="batch"] td').nth(2)).to_have_text("0")


def test_scale_from_the_page_up_and_back_down(page: Any, pool: ProxyProcess) -> None:
    sign_in(page, TOKEN)
    sim = card(page, "sim")
    replicas = sim.get_by_label("Replicas", exact=True)
    result = sim.locator('output[data-role="action-result"]')
    expect(sim.locator("table.replicas tbody tr")).to_have_count(1)
    replicas.fill("3")
    sim.get_by_role("button", name="Scale").click()
    expect(result).to_contain_text("replicas must be a whole number from 1 to 2")
    replicas.fill("2")
    sim.get_by_role("button", name="Scale").click()
    expect(result).to_contain_text("sim is loaded: 2 of 2 replicas ready", timeout=LOAD_S)
    expect(sim.locator("table.replicas tbody tr")).to_have_count(2)
    assert len(admin_model(pool, "sim")["replicas"]) == 2
    replicas.fill("1")
    replicas.press("Enter")   # the keyboard works as the button does
    expect(result).to_contain_text("sim is loaded: 1 of 1 replicas ready", timeout=LOAD_S)
    expect(sim.locator("table.replicas tbody tr")).to_have_count(1)


def test_a_running_batch_shows_its_progress_and_the_batch_class_queue(page: Any, pool: ProxyProcess) -> None:
    """The sim's one slot, 40 tokens a second: six lines of 20 tokens run for about 3 s, the last
    ones waiting in the batch class meanwhile."""
    lines = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "sim", "max_tokens": 20, "messages": [{"role": "user",
                                                                                         "content": "hi"}]}}) + "\n"
                    for i in range(6))
    sdk = openai.OpenAI(base_url=pool.url + "/v1", api_key="none", max_retries=0)
    upload = sdk.files.create(file=("lines.jsonl", io.BytesIO(lines.encode())), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    sign_in(page, TOKEN)
    line = page.locator("#batches")
    expect(line).to_contain_text(re.compile(rf"{batch.id} \(no tenant, sim\) [0-5]/6 done"))
    expect(line).to_contain_text(re.compile(r"sim: batch class 1 running"))
    expect(line).to_contain_text(re.compile(r"batches: none running · [1-9]\d* ended"), timeout=LOAD_S)
    assert sdk.batches.retrieve(batch.id).status == "completed"
