"""A real browser for the status page's tests: Playwright's client driving the machine's Chromium.

Where there is none (no `playwright` package, no Chromium), every test here skips with the reason
and the way to get one; `llm-pool setup --all-engines` installs the browser where it can.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from proxy.setup.browser import find_browser

ARTIFACTS_ENV = "LLM_POOL_ARTIFACTS"


# Per module, not per session: Playwright's sync API keeps an event loop running in the main thread
# while it is open, and every later test that runs asyncio.run() would fail under it.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="the `playwright` package is not installed: pip install -e '.[test]'")
    path, why = find_browser()
    if path is None:
        pytest.skip(f"no browser for the status page's tests: {why}")
    with sync_api.sync_playwright() as playwright:
        # The system's Chromium by path: Playwright's own browser download is never needed.
        launched = playwright.chromium.launch(executable_path=str(path), headless=True)
        yield launched
        launched.close()


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: $LLM_POOL_ARTIFACTS (CI keeps it), else pytest's temporary folder."""
    given = os.environ.get(ARTIFACTS_ENV)
    folder = Path(given) if given else tmp_path_factory.mktemp("ui-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder
