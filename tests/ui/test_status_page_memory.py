"""The status page's memory card warns of models that take each other's room in turn (a `thrash`,
issue 40), in a real headless Chromium against a live `llm-pool serve` with sim replicas in room for
one: each charged its estimate, a sparse weights file of WEIGHTS_MIB."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers import ProxyProcess, http, sim_model, status_page

pytestmark = pytest.mark.integration
expect = pytest.importorskip("playwright.sync_api", reason="the `playwright` package is not installed").expect

MIB = 1024 * 1024
WEIGHTS_MIB = 200


def ask(pool: ProxyProcess, model: str) -> int:
    return http("POST", pool.url + "/v1/chat/completions",
                body={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})[0]


def test_two_models_swapping_in_room_for_one_are_a_warning_on_the_memory_card(
        browser: Any, proxies: list[ProxyProcess], tmp_path: Path) -> None:
    weights = tmp_path / "weights.bin"
    with open(weights, "wb") as f:
        f.truncate(WEIGHTS_MIB * MIB)
    pool = ProxyProcess({n: sim_model(model_path=str(weights), load_on_demand=True, enabled=n == "a") for n in "ab"},
                        engine={"lifecycle": {"memory": {"cpu_budget_mib": 300}, "min_residence_s": 0}})
    proxies.append(pool)
    pool.start()
    pool.wait_state("a", "loaded")
    with status_page(browser, pool.url, 1366, 900) as page:
        warning = page.locator("#memory-warning")
        expect(page.locator('#devices tbody tr[data-key="cpu"]')).to_be_visible()
        expect(warning).to_be_hidden()
        assert ask(pool, "b") == 200     # evicts a
        assert ask(pool, "a") == 200     # a is back within the window, evicting b: the two are in use
        expect(warning).to_be_visible(timeout=30_000)
        expect(warning).to_contain_text("Working set too big: model a is loaded again")
        expect(warning).to_contain_text("the models in use (a, b) need 400.0 MiB together on cpu, more than its "
                                        "budget of 300.0 MiB")
        expect(page.locator("#events tbody tr td:nth-child(2)", has_text="thrash")).to_have_count(1)
