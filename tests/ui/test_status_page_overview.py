"""The status page with ten simulated models on two hosts (this machine's supervisord and a node), in a
real headless Chromium: the overview fits one 1920x1080 screen, the events feed explains what
happened (an eviction and what it made room for, a crash, an admin action and who), controls are
enabled only when they can work, the hosts are shown, and text that came from a request stays text.

Screenshots of the page go to $LLM_POOL_ARTIFACTS (docs/make_screenshots.sh points it at docs/).
"""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from helpers import Node, ProxyProcess, http, status_page, wait_for

pytestmark = pytest.mark.integration
expect = pytest.importorskip("playwright.sync_api", reason="the `playwright` package is not installed").expect

FAST = {"ttft_ms": 2, "decode_tokens_per_s": 400}
# Eight loaded at most: the two cold ones load on demand and evict the least recently used.
MODELS: dict[str, dict[str, Any]] = {
    **{f"chat-{i}": {"backend": "sim", "enabled": True, "load_on_demand": True, "sim": FAST} for i in range(5)},
    **{f"node-{i}": {"backend": "sim", "enabled": True, "hosts": ["b"], "sim": FAST} for i in range(2)},
    "duo": {"backend": "sim", "enabled": True, "replicas": 2, "replica_max": 2, "sim": FAST},
    "cold-a": {"backend": "sim", "enabled": False, "load_on_demand": True, "replica_max": 1, "sim": FAST},
    "cold-b": {"backend": "sim", "enabled": False, "load_on_demand": True, "sim": FAST},
}
ACTOR = "127.0.0.1 (no token needed)"


@pytest.fixture(scope="module")
def pool() -> Iterator[ProxyProcess]:
    node = Node("b", "node-b-password")
    proxy = ProxyProcess(MODELS, engine={"lifecycle": {"max_loaded_models": 8}})
    proxy.config["supervisor"]["hosts"] = {"b": {"url": node.url, "password_env": "NODE_B_PASSWORD"}}
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.env["NODE_B_PASSWORD"] = node.password
    try:
        node.start()
        proxy.start()
        for name, model in MODELS.items():
            if model["enabled"]:
                proxy.wait_replicas_ready(name, model.get("replicas", 1))
        proxy.node = node   # type: ignore[attr-defined]
        yield proxy
    finally:
        survivors = proxy.cleanup()
        node.stop()
        assert not survivors, f"processes outlived the tests and were killed: {survivors}"


@pytest.fixture
def page(browser: Any, pool: ProxyProcess) -> Iterator[Any]:
    with status_page(browser, pool.url, 1920, 1080) as tab:
        expect(tab.locator("#overview tbody tr")).to_have_count(len(MODELS))
        yield tab


def ask(pool: ProxyProcess, model: str) -> int:
    return http("POST", pool.url + "/v1/chat/completions",
                body={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})[0]


def details(page: Any, model: str) -> Any:
    """Open the model's details from its overview row; its card."""
    toggle = page.get_by_role("button", name=f"Details of {model}", exact=True)
    if toggle.get_attribute("aria-expanded") != "true":
        toggle.click()
    card = page.locator(f'section.model[data-model="{model}"]')
    expect(card).to_be_visible()
    return card


def event_rows(page: Any) -> Any:
    return page.locator("#events tbody tr")


def test_ten_models_with_hosts_memory_and_events_fit_one_1920x1080_screen(page: Any, pool: ProxyProcess) -> None:
    expect(page.locator('#overview tbody tr[data-key="duo"] td').nth(1)).to_have_text("loaded")
    # Not loaded, but its next request loads it: not "unloaded" as a model only an admin loads.
    expect(page.locator('#overview tbody tr[data-key="cold-a"] td').nth(1)).to_have_text("loads on demand")
    expect(event_rows(page).first).to_be_visible()
    height = page.evaluate("() => document.documentElement.scrollHeight")
    assert height <= 1080, f"the page is {height} px high"
    for row in page.locator("#overview tbody tr").all():
        assert row.is_visible() and row.bounding_box()["y"] + row.bounding_box()["height"] <= 1080
    # Hosts: this machine's supervisord and the node, each answering, with its replicas.
    expect(page.locator("#hosts tbody tr")).to_have_count(2)
    expect(page.locator('#hosts tbody tr[data-key="b"] td').nth(1)).to_have_text("answering")
    expect(page.locator('#hosts tbody tr[data-key="b"] td').nth(4)).to_contain_text("node-0/r0")
    # A replica's host is in the overview and in its row of the details.
    expect(page.locator('#overview tbody tr[data-key="node-1"] td').nth(12)).to_have_text("b")
    card = details(page, "node-1")
    expect(card.locator("table.replicas tbody tr td").nth(1)).to_have_text("b")


def test_an_eviction_says_what_it_made_room_for_and_an_admin_unload_who_asked(page: Any, pool: ProxyProcess) -> None:
    assert ask(pool, "cold-b") == 200   # the ninth: the least recently used is evicted for it
    events = page.locator("#events tbody")
    expect(events).to_contain_text("is evicted to make room for cold-b")
    expect(events).to_contain_text(re.compile(r"model \S+ unloaded \(evicted for cold-b\)"))
    expect(events).to_contain_text("model cold-b loaded (on_demand)")
    card = details(page, "cold-b")
    page.once("dialog", lambda dialog: dialog.accept())
    card.get_by_role("button", name="Unload").click()
    expect(card.locator('output[data-role="action-result"]')).to_contain_text("cold-b is unloaded")
    expect(events).to_contain_text(f"model cold-b unloaded (admin by {ACTOR})")
    expect(events).to_contain_text(f"unload cold-b by {ACTOR}: unloaded")
    # Newest first: the admin's own record of its unload heads the list.
    expect(event_rows(page).first.locator("td").nth(1)).to_have_text("admin")
    expect(card.get_by_role("button", name="Unload")).to_be_disabled()


def loaded(pool: ProxyProcess, prefix: str) -> tuple[str, dict[str, Any]]:
    """A model named `prefix`-N that is loaded (evictions pick theirs by use), with its first replica."""
    for name in MODELS:
        if name.startswith(prefix):
            model = pool.admin_model(name)
            if model["state"] == "loaded" and model["replicas"]:
                return name, model["replicas"][0]
    raise AssertionError(f"no {prefix}* model is loaded")


def test_a_sigkilled_replica_is_a_crash_in_the_feed(page: Any, pool: ProxyProcess) -> None:
    name, replica = loaded(pool, "chat-")
    os.kill(replica["pid"], signal.SIGKILL)
    expect(page.locator("#events tbody")).to_contain_text(
        f"model {name} replica 0 (pid {replica['pid']}) killed by SIGKILL", timeout=20_000)
    page.get_by_label("Model", exact=True).select_option(name)
    expect(event_rows(page).first.locator("td").nth(1)).to_have_text("crash")
    assert all(t.startswith(name) for t in page.locator("#events tbody tr td:nth-child(3)").all_inner_texts())
    page.get_by_label("Model", exact=True).select_option("")
    pool.wait_replicas_ready(name, 1)


def looks(button: Any) -> list[str]:
    return list(button.evaluate("b => ['color', 'borderColor', 'backgroundColor'].map((p) => getComputedStyle(b)[p])"))


def test_controls_are_enabled_only_when_they_can_work(page: Any, pool: ProxyProcess) -> None:
    cold = details(page, "cold-a")
    expect(cold.get_by_role("button", name="Unload")).to_be_disabled()
    assert cold.get_by_role("button", name="Unload").get_attribute("title") == "cold-a is not loaded"
    expect(cold.get_by_role("button", name="Scale")).to_be_disabled()
    expect(cold.get_by_role("button", name="Load…")).to_be_enabled()
    duo = details(page, "duo")
    # A disabled Unload (red when it works) looks as every disabled button does.
    expect(duo.get_by_role("button", name="Unload")).to_be_enabled()
    assert looks(cold.get_by_role("button", name="Unload")) == looks(cold.get_by_role("button", name="Scale"))
    assert looks(cold.get_by_role("button", name="Unload")) != looks(duo.get_by_role("button", name="Unload"))
    # Requests that name no fairness key wait in a queue of their own, named as such, not a blank row.
    assert ask(pool, "duo") == 200
    expect(duo.locator('table.keys tbody tr[data-key=""] td').first).to_have_text("(none)")
    expect(duo.get_by_role("button", name="Load…")).to_be_disabled()
    assert "unload it first" in duo.get_by_role("button", name="Load…").get_attribute("title")
    expect(duo.get_by_role("button", name="Unload")).to_be_enabled()
    expect(duo.get_by_role("button", name="Scale")).to_be_enabled()
    # A loaded model with one replica at most cannot scale; its log buttons work.
    if pool.admin_model("cold-a")["state"] != "loaded":
        assert ask(pool, "cold-a") == 200
    expect(cold.locator("h3 .state")).to_have_text("loaded")
    expect(cold.get_by_role("button", name="Scale")).to_be_disabled()
    expect(cold.get_by_role("button", name="Scale")).to_have_attribute("title", "replica_max of cold-a is 1")
    expect(cold.get_by_role("button", name="Unload")).to_be_enabled()
    expect(cold.get_by_role("button", name="Load…")).to_be_disabled()
    expect(cold.get_by_role("button", name="Log of cold-a replica 0")).to_be_enabled()
    # The backend's reading says how old it is and how many of the proxy's requests it saw.
    expect(duo.locator("table.replicas tbody tr td").nth(6)).to_have_text(
        re.compile(r"^\d+(\.\d+)? / \d+(\.\d+)? \(\d+(\.\d+)? s ago, \d+ of ours then\)$"))


def test_text_from_a_request_is_shown_as_text_never_as_markup(page: Any, pool: ProxyProcess) -> None:
    name = '<img src=x id=injected onerror="document.title=1">'
    status, _, _ = http("POST", f"{pool.url}/v1/admin/models/{name.replace(' ', '%20')}/unload", body={})
    assert status == 404
    expect(page.locator("#events tbody")).to_contain_text("<img src=x id=injected")
    assert page.locator("#injected").count() == 0 and page.title() == "llm-pool status"


def test_screenshots_with_a_host_down(page: Any, pool: ProxyProcess, artifacts: Path) -> None:
    page.screenshot(path=str(artifacts / "status-page.png"))
    node: Node = pool.node   # type: ignore[attr-defined]
    name, _ = loaded(pool, "node-")
    node.kill_with_replicas()   # the whole host goes: its supervisord and its replicas
    b = page.locator('#hosts tbody tr[data-key="b"] td')
    expect(b.nth(1)).to_contain_text("not answering", timeout=30_000)
    # The host's error reads as lines of words, not a word (or a letter) per line: on a laptop's
    # 1366 px it took 16 lines for 22 words before its cell had a minimum width.
    error = b.nth(1).locator(".error-text")
    expect(error).to_contain_text(" s: ")
    page.set_viewport_size({"width": 1366, "height": 1080})
    lines, words = error.evaluate("e => [Math.round(e.getBoundingClientRect().height / parseFloat("
                                  "getComputedStyle(e).lineHeight)), e.textContent.trim().split(/\\s+/).length]")
    page.set_viewport_size({"width": 1920, "height": 1080})
    assert words >= 6 and lines <= words // 2, (lines, words, error.inner_text())
    wait_for(lambda: pool.admin_model(name)["replicas"][0]["state"] != "ready", what=f"{name} out of rotation")
    details(page, name)
    page.screenshot(path=str(artifacts / "status-page-host-down.png"), full_page=True)
    print(f"screenshots: {artifacts}")
