"""Admin settings: the token fails closed (a named variable that is unset or empty stops serve and
check-config), and a separate admin listener needs a port of its own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from proxy.cli import EXIT_CONFIG, main
from proxy.config import REPO_ROOT, ConfigError, load_settings

VAR = "LLM_POOL_TEST_ADMIN_TOKEN_UNIT"


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("LLM_POOL_SETTINGS_PATH", raising=False)
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", str(tmp_path / "no-local.yaml"))
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"service": {"admin_token_env": VAR, "state_dir": str(tmp_path / "state")},
                                    "engine": {"models": {"m": {"backend": "sim"}}}}))
    return path


@pytest.mark.parametrize("command", ["check-config", "serve"])
@pytest.mark.parametrize("value", [None, "", "  "], ids=["unset", "empty", "blank"])
def test_a_named_token_variable_that_is_unset_or_empty_stops_the_command(
        config: Path, command: str, value: str | None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    if value is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, value)
    if command == "serve":   # in a process of its own: were it to start serving, the timeout ends it
        env = dict(os.environ)
        env.pop(VAR, None)
        if value is not None:
            env[VAR] = value
        done = subprocess.run([sys.executable, "-m", "proxy.cli", "--config", str(config), command], cwd=REPO_ROOT,
                              env=env, capture_output=True, text=True, timeout=60)
        code, err = done.returncode, done.stderr
    else:
        with pytest.raises(SystemExit) as info:
            main(["--config", str(config), command])
        code, err = info.value.code, capsys.readouterr().err
    assert code == EXIT_CONFIG
    assert f"service.admin_token_env: {VAR} is unset or empty" in err
    assert not (config.parent / "state").exists()   # nothing started


def test_a_set_token_passes_and_is_never_printed(config: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(VAR, "s3cret-value")
    assert main(["--config", str(config), "check-config"]) == 0
    out = capsys.readouterr()
    assert "s3cret-value" not in out.out + out.err


def test_the_admin_listener_needs_a_port_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text(yaml.safe_dump({"service": {"port": 9000, "admin_port": 9000}}))
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert info.value.problems == ["service.admin_port: 9000 is service.port; the admin listener needs a port of its own"
                                   f" ({path}:2)"]
