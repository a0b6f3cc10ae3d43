"""Each backend's options class against conf/schema.json: every field of its prefix is a field, every
field is a field of the schema, and a default is the schema's `default` (both ways: a default the
schema does not declare is a drift too). And what `from_config` makes of unset, null and set values."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from launchers import exllamav3, llama_cpp, llama_server, vllm_serve
from launchers.ct2 import Ct2Options
from launchers.exllamav3 import Exllamav3Options
from launchers.llama_cpp import LlamaCppOptions
from launchers.llama_server import LlamaServerOptions
from launchers.options import Options
from launchers.sim import SimOptions
from launchers.vllm_serve import VllmServeOptions
from proxy.config.model import ModelConfig
from proxy.lifecycle.kinds.remote_options import RemoteOptions

SCHEMA = Path(__file__).resolve().parents[2] / "conf" / "schema.json"
# Each class with the fields it owns: those starting with one of these (`device` and `compute_type`
# are CTranslate2's alone). Fields every backend may have (model_path, prompt_format,
# enable_thinking) are read by several classes, with a default of each backend's own.
OWNED: list[tuple[type[Options], tuple[str, ...]]] = [
    (LlamaServerOptions, ("llama_server_",)),
    (VllmServeOptions, ("vllm_",)),
    (RemoteOptions, ("remote_",)),
    (Ct2Options, ("ct2_", "device", "compute_type")),
    (Exllamav3Options, ("exllama_", "exllamav3_")),
    (LlamaCppOptions, ("gguf_", "llama_cpp_")),
    (SimOptions, ("sim",)),
]
SHARED = ("model_path", "prompt_format", "enable_thinking")
# The tables that map config fields to flags: each key must be a field of the backend's options.
TABLES: list[tuple[type[Options], tuple[tuple[str, str], ...]]] = [
    (LlamaServerOptions, llama_server.FLAGS + llama_server.SWITCHES + llama_server.ENUM_FIELDS),
    (VllmServeOptions, vllm_serve.FLAGS + vllm_serve.JSON_FLAGS + vllm_serve.SPECULATIVE_KEYS),
    (Exllamav3Options, exllamav3.FLAGS),
    (LlamaCppOptions, llama_cpp.FLAGS),
]


def properties() -> dict[str, Any]:
    return json.loads(SCHEMA.read_text(encoding="utf-8"))["$defs"]["model"]["properties"]


def owns(prefixes: tuple[str, ...], key: str) -> bool:
    return key.startswith(prefixes)


def default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def model(**options: Any) -> ModelConfig:
    return ModelConfig(name="m", backend="sim", enabled=True, replicas=1, replica_max=1, target_inflight=1,
                       modalities=("text",), gpus=(), options=options)


@pytest.mark.parametrize("cls, prefixes", OWNED, ids=[c.__name__ for c, _ in OWNED])
def test_every_schema_field_of_the_backend_is_a_field(cls: type[Options], prefixes: tuple[str, ...]) -> None:
    wanted = {k for k in properties() if owns(prefixes, k)}
    assert wanted - set(cls.keys()) == set()


@pytest.mark.parametrize("cls, prefixes", OWNED, ids=[c.__name__ for c, _ in OWNED])
def test_every_field_is_a_schema_field_of_the_backend(cls: type[Options], prefixes: tuple[str, ...]) -> None:
    schema = properties()
    for key in cls.keys():
        assert key in schema, f"{cls.__name__} reads {key}, which conf/schema.json does not define"
        assert owns(prefixes, key) or key in SHARED, f"{cls.__name__} reads {key} of another backend"


@pytest.mark.parametrize("cls, prefixes", OWNED, ids=[c.__name__ for c, _ in OWNED])
def test_defaults_agree_with_the_schema(cls: type[Options], prefixes: tuple[str, ...]) -> None:
    schema = properties()
    for field in dataclasses.fields(cls):
        key = cls.key_of(field)
        if not owns(prefixes, key):
            continue   # a shared field: each backend has its own default, the schema none
        ours = default_of(field)
        if "default" in schema[key]:
            theirs = schema[key]["default"]
            convert = field.metadata.get("llm_pool_convert")
            assert ours == (convert(theirs) if convert is not None else theirs), key
        else:
            assert ours is None, f"{key}: default {ours!r} in {cls.__name__}, none in conf/schema.json"


@pytest.mark.parametrize("cls, table", TABLES, ids=[c.__name__ for c, _ in TABLES])
def test_every_flag_table_key_is_a_field(cls: type[Options], table: tuple[tuple[str, str], ...]) -> None:
    assert {key for key, _ in table} - set(cls.keys()) == set()


def test_unset_and_null_give_the_default_and_values_are_converted() -> None:
    assert VllmServeOptions.from_config(model()) == VllmServeOptions()
    assert VllmServeOptions.from_config(model(vllm_serve_host=None)).serve_host == "127.0.0.1"
    opts = VllmServeOptions.from_config(model(vllm_serve_start_timeout_s=30, vllm_serve_extra_args=["--x", 1],
                                              vllm_dtype="half"))
    assert opts.serve_start_timeout_s == 30.0 and isinstance(opts.serve_start_timeout_s, float)
    assert opts.serve_extra_args == ("--x", "1") and opts.dtype == "half"
    assert opts.value("vllm_dtype") == "half"
    with pytest.raises(KeyError):
        opts.value("llama_server_host")
    assert Ct2Options.from_config(model(prompt_format="chatml")).prompt_format == "chatml"
    assert Ct2Options.from_config(model()).prompt_format == "generic"
    assert LlamaCppOptions.from_config(model()).prompt_format is None
    assert SimOptions.from_config(model(sim={"ttft_ms": 5})).params == {"ttft_ms": 5}


def test_the_options_are_frozen_and_never_show_the_base_url() -> None:
    opts = RemoteOptions.from_config(model(remote_base_url="https://user:pw-SECRET@h/v1", remote_max_retries=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.max_retries = 3  # type: ignore[misc]
    assert opts.base_url == "https://user:pw-SECRET@h/v1" and "pw-SECRET" not in repr(opts)
    assert opts.key({}) is None and opts.max_retries == 2

