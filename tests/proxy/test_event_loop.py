"""Which event loop `llm-pool serve` runs on (proxy/cli.py event_loop_factory): uvloop where it is
installed, asyncio on request, and a clear error for a value that cannot be honoured."""
from __future__ import annotations

import sys

import pytest

from proxy.cli import EVENT_LOOP_ENV, event_loop_factory


def test_uvloop_is_the_default_where_it_is_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    factory, name = event_loop_factory({})
    assert (factory, name) == (uvloop.new_event_loop, "uvloop")


def test_asyncio_on_request() -> None:
    assert event_loop_factory({EVENT_LOOP_ENV: "asyncio"}) == (None, "asyncio")


def test_auto_without_uvloop_is_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)   # as if not installed
    assert event_loop_factory({EVENT_LOOP_ENV: "auto"}) == (None, "asyncio")


def test_uvloop_required_but_missing_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)
    with pytest.raises(ValueError, match="LLM_POOL_EVENT_LOOP=uvloop: uvloop is not installed"):
        event_loop_factory({EVENT_LOOP_ENV: "uvloop"})


def test_an_unknown_value_names_the_variable_and_the_choices() -> None:
    with pytest.raises(ValueError, match="LLM_POOL_EVENT_LOOP='trio': must be one of auto, uvloop, asyncio"):
        event_loop_factory({EVENT_LOOP_ENV: "trio"})
