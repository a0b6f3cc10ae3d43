"""What a reload keeps (proxy/lifecycle/kept.py): entries survive a write and a read whole, a bad
file is ignored, the kept overrides a new config refuses are dropped with a warning naming each,
and what changed is said by setting name, never by value."""
from __future__ import annotations

import json
import stat
from dataclasses import replace
from pathlib import Path

from launchers import llama_server, sim
from proxy.config.model import Adapter, Fallback, ModelConfig
from proxy.lifecycle.kept import KeptModels, entry, honoured
from proxy.lifecycle.state.indices import free_indices
from proxy.lifecycle.state.outdated import what_changed


def model(**options: object) -> ModelConfig:
    return ModelConfig(name="duo", backend="sim", enabled=True, replicas=2, replica_max=3, target_inflight=2,
                       modalities=("text",), gpus=(0,), options={"replicas": 2, "sim": {"ttft_ms": 1}, **options},
                       hosts=("local",), fallbacks=(Fallback("other"), Fallback("big", frozenset({"overloaded"}))),
                       adapters=(Adapter("sql", "duo:sql", "/l/sql.gguf", 0.5),))


def test_an_entry_is_what_the_admin_set_and_survives_a_write_and_a_read(tmp_path: Path) -> None:
    config = model()
    active = config.with_overrides({"sim": {"ttft_ms": 3}, "replicas": 1})
    kept = KeptModels(tmp_path / "kept.json")
    kept.write({"duo": entry(config, active)})
    assert stat.S_IMODE((tmp_path / "kept.json").stat().st_mode) == 0o600
    (back,) = kept.read().values()
    assert back.overrides == {"sim": {"ttft_ms": 3}, "replicas": 1}
    assert back.settings == active   # tuples and all


def test_no_file_or_a_bad_one_keeps_nothing(tmp_path: Path) -> None:
    path = tmp_path / "kept.json"
    assert KeptModels(path).read() == {}
    for text in ("{not json", json.dumps({"version": 99, "models": {}}), json.dumps([1])):
        path.write_text(text)
        assert KeptModels(path).read() == {}
    path.write_text(json.dumps({"version": 1, "models": {"duo": {"overrides": {"replicas": 1}, "settings": {"x": 1}}}}))
    (back,) = KeptModels(path).read().values()
    assert back.overrides == {"replicas": 1} and back.settings is None   # unreadable settings: only those lost


def test_overrides_the_config_still_takes_are_kept() -> None:
    kept, warnings = honoured(model(), {"sim": {"ttft_ms": 3}, "replicas": 3}, sim.LOAD_OVERRIDES, lambda m: [])
    assert kept == {"sim": {"ttft_ms": 3}, "replicas": 3} and warnings == []


def test_a_count_above_the_new_replica_max_is_dropped_with_a_warning_naming_it() -> None:
    kept, warnings = honoured(replace(model(), replica_max=2), {"replicas": 3, "sim": {"ttft_ms": 3}},
                              sim.LOAD_OVERRIDES, lambda m: [])
    assert kept == {"sim": {"ttft_ms": 3}}
    assert warnings == ["model duo: dropping the kept override replicas: replicas: must be an integer from 1 to "
                        "replica_max (2)"]


def test_an_override_the_new_backend_does_not_take_is_dropped_with_a_warning_naming_it() -> None:
    config = replace(model(), backend="llama_server")
    kept, warnings = honoured(config, {"sim": {"ttft_ms": 3}, "replicas": 1}, llama_server.LOAD_OVERRIDES,
                              lambda m: [])
    assert kept == {"replicas": 1}
    (warning,) = warnings
    assert warning.startswith("model duo: dropping the kept override sim: overrides.sim: not a live override")


def test_overrides_the_engine_would_refuse_together_are_dropped_and_the_count_kept() -> None:
    def refuse(m: ModelConfig) -> list[str]:
        return ["llama_server_n_ctx: 4 is below the 8 the prompt format needs"] if m.get("llama_server_n_ctx") else []
    kept, warnings = honoured(model(), {"llama_server_n_ctx": 4, "replicas": 1}, ("llama_server_n_ctx",), refuse)
    assert kept == {"replicas": 1}
    assert warnings == ["model duo: dropping the kept override(s) llama_server_n_ctx: llama_server_n_ctx: 4 is "
                        "below the 8 the prompt format needs"]


def test_what_changed_names_settings_never_values_and_not_how_many_run() -> None:
    old = model(api_key_env="OLD_KEY", idle_unload_s=5)
    new = replace(model(api_key_env="NEW_KEY", idle_unload_s=60, sim={"ttft_ms": 2}), replicas=1, gpus=(1,))
    names = what_changed(old, new)
    assert names == ["api_key_env", "gpus", "sim.ttft_ms"]
    assert what_changed(old, old) == []


def test_free_indices_are_the_lowest_not_in_use() -> None:
    assert free_indices([0, 1], 1) == [2]
    assert free_indices([1, 2], 1) == [0]
    assert free_indices([0, 2], 2) == [1, 3]
    assert free_indices([], 2) == [0, 1]


def test_saving_keeps_loaded_models_the_last_proxys_pending_ones_and_mid_roll_the_old_settings(tmp_path: Path) -> None:
    from helpers import ready_runtime
    from proxy.lifecycle.state.replicas import ModelState

    old, new = model(), model(sim={"ttft_ms": 2})
    rolling = ready_runtime(new, 2)
    rolling.state, rolling.active, rolling.kept = ModelState.LOADED, new.with_overrides({"replicas": 1}), old
    rolling.replicas[0].outdated = "settings changed: sim.ttft_ms"
    unloaded = ready_runtime(replace(new, name="gone"), 0)
    kept = KeptModels(tmp_path / "kept.json")
    kept.pending["later"] = entry(replace(old, name="later"), replace(old, name="later"))
    kept.save([rolling, unloaded])
    found = kept.read()
    assert sorted(found) == ["duo", "later"]
    assert found["duo"].overrides == {"replicas": 1} and found["duo"].settings == old   # what the old ones run
    rolling.replicas[0].outdated = None
    kept.settled("later")
    kept.save([rolling])
    assert sorted(kept.read()) == ["duo"] and kept.read()["duo"].settings == rolling.active


def test_an_entry_written_before_adapters_existed_is_read_with_none(tmp_path: Path) -> None:
    """A reload across the upgrade that brought `lora_adapters` keeps what the admin set."""
    kept = KeptModels(tmp_path / "kept.json")
    kept.write({"duo": entry(model(), model().with_overrides({"replicas": 1}))})
    doc = json.loads((tmp_path / "kept.json").read_text())
    del doc["models"]["duo"]["settings"]["adapters"]
    (tmp_path / "kept.json").write_text(json.dumps(doc))
    (back,) = kept.read().values()
    assert back.settings is not None and back.settings.adapters == () and back.settings.replicas == 1
