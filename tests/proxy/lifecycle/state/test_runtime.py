"""What the admin view says of one model at run time."""
from __future__ import annotations

from proxy.config.model import ModelConfig
from proxy.lifecycle.state.runtime import ModelRuntime

SIM = {"ttft_ms": 100, "decode_tokens_per_s": 50.0, "max_seqs": 4}
CONFIG = ModelConfig(name="m", backend="sim", enabled=True, replicas=1, replica_max=2, target_inflight=1,
                     modalities=("text",), gpus=(), options={"backend": "sim", "sim": SIM})


def test_overrides_show_only_what_a_load_changed_inside_a_nested_field() -> None:
    runtime = ModelRuntime(config=CONFIG, active=CONFIG.with_overrides({"sim": {"ttft_ms": 5}, "replicas": 2}))
    assert runtime.describe()["overrides"] == {"sim": {"ttft_ms": 5}, "replicas": 2}


def test_an_override_to_the_configured_value_is_no_override() -> None:
    runtime = ModelRuntime(config=CONFIG, active=CONFIG.with_overrides({"sim": {"ttft_ms": 100}}))
    assert runtime.describe()["overrides"] == {}
