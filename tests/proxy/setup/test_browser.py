"""Finding and installing the browser of the status page's tests (`llm-pool setup --all-engines`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from fakes import FakeApt
from proxy.setup import browser
from proxy.setup.browser import BROWSER_ENV, ensure_browser, find_browser


def test_the_variable_wins_and_a_wrong_one_is_named() -> None:
    path, why = find_browser({BROWSER_ENV: "/no/such/chromium"}, which=lambda name: "/usr/bin/chromium")
    assert path is None and f"{BROWSER_ENV}=/no/such/chromium is not an executable file" in why
    path, why = find_browser({}, which=lambda name: "/usr/bin/chromium-browser" if name == "chromium-browser" else None)
    assert (path, why) == (Path("/usr/bin/chromium-browser"), "")
    path, why = find_browser({}, which=lambda name: None)
    assert path is None and "llm-pool setup --all-engines" in why and BROWSER_ENV in why


@pytest.fixture(autouse=True)
def no_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BROWSER_ENV, raising=False)


def test_a_browser_already_there_installs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    apt = FakeApt(installs_on=None)
    assert ensure_browser(run=apt.run, is_root=True, which=lambda name: "/opt/chromium") == Path("/opt/chromium")
    assert apt.calls == []


def test_without_root_nothing_is_installed_and_the_reason_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    apt = FakeApt(installs_on=1)
    assert ensure_browser(run=apt.run, is_root=False, which=apt.which) is None
    assert apt.calls == [] and "not root" in capsys.readouterr().out


def test_as_root_it_installs_debians_chromium_reading_the_package_lists_when_the_first_try_fails() -> None:
    apt = FakeApt(installs_on=2)
    assert ensure_browser(run=apt.run, is_root=True, which=apt.which) == Path("/usr/bin/chromium")
    assert apt.calls == [["apt-get", "install", "-y", "-q", browser.APT_PACKAGE], ["apt-get", "update", "-q"],
                         ["apt-get", "install", "-y", "-q", browser.APT_PACKAGE]]


def test_a_failed_install_does_not_fail_the_setup_and_says_the_tests_will_skip(capsys: pytest.CaptureFixture[str]) -> None:
    apt = FakeApt(installs_on=None)
    assert ensure_browser(run=apt.run, is_root=True, which=apt.which) is None
    out = capsys.readouterr().out
    assert "failed (exit 100)" in out and "Unable to locate package" in out and "will skip" in out
