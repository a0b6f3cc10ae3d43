"""Model and replica states move only along the transitions in replicas.py."""
from __future__ import annotations

import time

import pytest

from helpers import ready_runtime
from proxy.config.model import ModelConfig
from proxy.lifecycle.state.replicas import InvalidTransition, ModelState, model_transition
from proxy.lifecycle.state.runtime import ModelRuntime

CONFIG = ModelConfig(name="m", backend="sim", enabled=True, replicas=1, replica_max=1, target_inflight=1,
                     modalities=("text",), gpus=(), options={"backend": "sim"})


def test_a_model_goes_through_load_and_unload() -> None:
    runtime = ModelRuntime(config=CONFIG)
    for state in (ModelState.LOADING, ModelState.LOADED, ModelState.UNLOADING, ModelState.UNLOADED):
        runtime.move(state)
        assert runtime.state == state


def test_a_failed_model_can_be_loaded_or_unloaded_again() -> None:
    runtime = ModelRuntime(config=CONFIG)
    runtime.move(ModelState.FAILED, "backend 'x' cannot be run")
    assert runtime.last_error == "backend 'x' cannot be run"
    runtime.move(ModelState.LOADING)
    runtime.move(ModelState.FAILED)
    runtime.move(ModelState.UNLOADING)
    runtime.move(ModelState.UNLOADED)


@pytest.mark.parametrize("old, new", [
    (ModelState.UNLOADED, ModelState.LOADED),      # a load always passes through LOADING
    (ModelState.LOADED, ModelState.LOADING),       # loaded with other settings: unload first
    (ModelState.UNLOADING, ModelState.LOADING),
    (ModelState.LOADING, ModelState.UNLOADED),
])
def test_transitions_the_lifecycle_forbids_raise(old: ModelState, new: ModelState) -> None:
    with pytest.raises(InvalidTransition):
        model_transition("m", old, new)
    assert model_transition("m", old, old) == old   # staying put is always allowed


def test_a_backend_reading_in_the_admin_row_says_its_age_and_the_proxys_count_when_it_was_taken() -> None:
    runtime = ready_runtime(CONFIG, 1)
    replica = runtime.replicas[0]
    assert (replica.describe()["reported_age_s"], replica.describe()["inflight_at_scrape"]) == (None, None)
    replica.reported, replica.inflight_at_scrape, replica.inflight = {"running": 0.0, "waiting": 0.0}, 0, 2
    replica.scraped_at = time.monotonic() - 0.4
    row = replica.describe()
    assert row["reported"] == {"running": 0.0, "waiting": 0.0} and row["inflight"] == 2
    assert row["inflight_at_scrape"] == 0 and row["reported_age_s"] >= 0.4
