"""`llm-pool check-config` over vLLM models: a launcher's warnings (target_inflight above vLLM's
--max-num-seqs) leave the exit 0; an extra argument that repeats a flag llm-pool sets, or a model
that cannot start and loads without an admin (enabled or load_on_demand), make it 2; every
configured model is checked, a disabled one too (an admin may load it)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli import main

OK_MODEL = {"backend": "vllm_serve", "target_inflight": 8, "vllm_model": "org/m", "vllm_serve_binary": "/bin/true",
            "vllm_kv_cache_memory_bytes": 1 << 30}


def check(tmp_path: Path, models: dict[str, Any], *flags: str) -> int:
    config = tmp_path / "pool.yaml"
    config.write_text(yaml.safe_dump({"service": {"state_dir": str(tmp_path / "s")}, "engine": {"models": models}}))
    return main(["--config", str(config), "check-config", *flags])


def test_check_config_warns_when_target_inflight_exceeds_max_num_seqs(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert check(tmp_path, {"v": {**OK_MODEL, "enabled": True, "vllm_serve_extra_args": ["--max-num-seqs", "4"]}}) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("llm-pool: warning: engine.models.v.target_inflight: 8 is above --max-num-seqs 4")
    assert len(err.splitlines()) == 1


def test_a_disabled_model_is_checked_too_and_warned_of(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: a model that was not enabled was not looked at, and an admin's load of it failed later.
    off = {**OK_MODEL, "enabled": False, "vllm_serve_binary": str(tmp_path / "no-vllm"),
           "vllm_serve_extra_args": ["--max-num-seqs=1"]}
    assert check(tmp_path, {"off": off}) == 0
    out = capsys.readouterr()
    err = out.err.splitlines()
    assert any(line.startswith("llm-pool: warning: engine.models.off.target_inflight: 8 is above --max-num-seqs 1")
               for line in err), err
    assert any(line.startswith(f"llm-pool: warning: engine.models.off.vllm_serve_binary: {tmp_path / 'no-vllm'} does "
                               "not exist") and line.endswith("neither enabled nor load_on_demand) would fail")
               for line in err), err
    assert out.out.startswith("ok: 1 model(s), 0 enabled, 2 warning(s)")
    assert check(tmp_path, {"off": off}, "--strict") == 2   # for an admin's CI: an error
    assert "configuration problem(s):\n  engine.models.off.vllm_serve_binary:" in capsys.readouterr().err


def test_an_on_demand_model_that_cannot_start_fails_the_check(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # Before: it passed, and the first request for it got 409 model_not_loadable.
    assert check(tmp_path, {"d": {**OK_MODEL, "load_on_demand": True, "vllm_model": str(tmp_path / "no-model")}}) == 2
    err = capsys.readouterr().err
    assert f"configuration problem(s):\n  engine.models.d.vllm_model: {tmp_path / 'no-model'} does not exist" in err


@pytest.mark.parametrize("extra, given, field", [
    (["--max-model-len", "512"], "--max-model-len", "vllm_max_model_len"),
    (["-tp", "2"], "-tp (--tensor-parallel-size)", "vllm_tensor_parallel_size"),
    (["--max_model_len=512"], "--max_model_len (--max-model-len)", "vllm_max_model_len"),
])
def test_an_extra_arg_that_repeats_a_flag_llm_pool_sets_fails_the_check_naming_both(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], given: str, field: str) -> None:
    # Before: it passed, and vLLM took the last value given: the field was silently ignored.
    model = {**OK_MODEL, "enabled": True, "vllm_max_model_len": 4096, "vllm_tensor_parallel_size": 1,
             "vllm_serve_extra_args": extra}
    assert check(tmp_path, {"v": model}) == 2
    err = capsys.readouterr().err
    assert f"engine.models.v.vllm_serve_extra_args: {given} is set by llm-pool from {field}" in err
    assert f"set {field} instead" in err
