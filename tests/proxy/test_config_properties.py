"""Properties of the settings: the deep merge (local wins per key, nothing else is lost), and any
document, however wrong, either loads or is refused with problems that each name where (a path in
the document, or the file), never with another exception."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.config.loading import ConfigError, load_settings
from proxy.config.merge import deep_merge
from proxy.config.settings import Settings

# Real keys, so that generated documents reach deep into the schema instead of stopping at the top.
KEYS = st.sampled_from(["service", "supervisor", "engine", "models", "m", "backend", "port", "host", "replicas",
                        "replica_max", "target_inflight", "sim", "fairness", "weights", "lifecycle", "memory",
                        "max_loaded_models", "decoding", "max_tokens", "mode", "port_range", "state_dir",
                        "enabled", "pinned", "idle_unload_s", "load_on_demand", "routing", "admin_port", "x"])
LEAVES = st.none() | st.booleans() | st.integers(-5, 70000) | st.floats(allow_nan=False, width=32) | \
    st.sampled_from(["sim", "llama_server", "managed", "", "affinity", "0.0.0.0", "a/b", "../x"])
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4),
                      max_leaves=12)
DOCS = st.dictionaries(KEYS, VALUES, max_size=4)
# A problem starts with where it is: a dotted path of the document, or a file.
WHERE = re.compile(r"^(\(root\)|service|supervisor|engine|/|[\w.-]+\.ya?ml)")


@given(DOCS, DOCS)
def test_the_merge_keeps_every_key_and_local_wins_per_key(base: dict[str, Any], local: dict[str, Any]) -> None:
    merged = deep_merge(base, local)
    for key, value in local.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            assert merged[key] == deep_merge(base[key], value)
        else:
            assert merged[key] == value
    for key in set(base) - set(local):
        assert merged[key] == base[key]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(DOCS, st.none() | DOCS)
def test_any_document_loads_or_names_where_it_is_wrong(base: dict[str, Any], local: dict[str, Any] | None) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "pool.yaml"
        path.write_text(yaml.safe_dump(base))
        if local is not None:
            (Path(folder) / "local.yaml").write_text(yaml.safe_dump(local))
        try:
            loaded = load_settings(path)
        except ConfigError as exc:
            assert exc.problems
            for problem in exc.problems:
                assert WHERE.match(problem), problem
        else:
            assert isinstance(loaded, Settings)
