"""`llm-pool check-config` prints a launcher's warnings (here: target_inflight above vLLM's
--max-num-seqs) and still exits 0: the settings load."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from proxy.cli import main


def test_check_config_warns_when_target_inflight_exceeds_max_num_seqs(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "pool.yaml"
    config.write_text(yaml.safe_dump({"service": {"state_dir": str(tmp_path / "s")}, "engine": {"models": {
        "v": {"backend": "vllm_serve", "enabled": True, "target_inflight": 8, "vllm_model": "org/m",
              "vllm_serve_binary": "/bin/true", "vllm_kv_cache_memory_bytes": 1 << 30,
              "vllm_serve_extra_args": ["--max-num-seqs", "4"]},
        "off": {"backend": "vllm_serve", "enabled": False, "target_inflight": 8, "vllm_model": "org/m",
                "vllm_serve_extra_args": ["--max-num-seqs=1"]}}}}))
    assert main(["--config", str(config), "check-config"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("llm-pool: warning: engine.models.v.target_inflight: 8 is above --max-num-seqs 4")
    assert len(err.splitlines()) == 1
    assert "engine.models.off" not in err
