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
from proxy.config.files import REPO_ROOT
from proxy.config.loading import ConfigError, load_settings

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


def _settings_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **service: object) -> Path:
    monkeypatch.delenv("LLM_POOL_SETTINGS_PATH", raising=False)
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", str(tmp_path / "no-local.yaml"))
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"service": {"state_dir": str(tmp_path / "state"), **service},
                                    "engine": {"models": {"m": {"backend": "sim"}}}}))
    return path


def _serve(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`serve` in a process of its own: were it to start serving, the timeout ends it."""
    env = {k: v for k, v in os.environ.items() if k != "LLM_POOL_SETTINGS_PATH"}
    env["LLM_POOL_LOCAL_SETTINGS_PATH"] = str(path.parent / "no-local.yaml")
    return subprocess.run([sys.executable, "-m", "proxy.cli", "--config", str(path), "serve", *extra], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("service", "argv", "key", "address"), [
    ({"host": "0.0.0.0"}, (), "service.host", "0.0.0.0"),
    ({"host": "::"}, (), "service.host", "::"),
    ({"host": "192.0.2.7"}, (), "service.host", "192.0.2.7"),
    ({}, ("--host", "0.0.0.0"), "service.host", "0.0.0.0"),
    ({"admin_host": "0.0.0.0", "admin_port": 9001}, (), "service.admin_host", "0.0.0.0"),
], ids=["any-v4", "any-v6", "lan", "--host", "admin_host"])
def test_serve_refuses_an_admin_api_without_a_token_off_loopback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, service: dict[str, object], argv: tuple[str, ...],
        key: str, address: str) -> None:
    done = _serve(_settings_file(tmp_path, monkeypatch, **service), *argv)
    assert done.returncode == EXIT_CONFIG, done.stderr
    assert f"{key}: the admin API would listen on {address} (not loopback) without a token" in done.stderr
    assert "service.admin_allow_unauthenticated_remote: true" in done.stderr   # the way to mean it
    assert not (tmp_path / "state").exists()   # nothing started


def test_check_config_names_an_admin_api_without_a_token_off_loopback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = _settings_file(tmp_path, monkeypatch, host="0.0.0.0")
    with pytest.raises(SystemExit) as info:
        main(["--config", str(path), "check-config"])
    assert info.value.code == EXIT_CONFIG
    assert "service.host: the admin API would listen on 0.0.0.0 (not loopback) without a token" in \
        capsys.readouterr().err


@pytest.mark.parametrize("service", [
    {"host": "0.0.0.0", "admin_allow_unauthenticated_remote": True},   # meant, and said so
    {"host": "0.0.0.0", "admin_token_env": VAR},
    {"host": "0.0.0.0", "admin_host": "127.0.0.1", "admin_port": 9001},   # the admin API on loopback only
    {"host": "localhost"}, {"host": "127.0.0.2"}, {"host": "::1"},
], ids=["opt-in", "token", "admin-on-loopback", "localhost", "127/8", "::1"])
def test_an_admin_api_on_loopback_with_a_token_or_meant_passes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, service: dict[str, object]) -> None:
    monkeypatch.setenv(VAR, "s3cret-value")
    # --strict: an unknown key would be an error, so the opt-in is a setting this version knows.
    assert main(["--config", str(_settings_file(tmp_path, monkeypatch, **service)), "check-config", "--strict"]) == 0
