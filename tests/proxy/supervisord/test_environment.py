"""What model servers may see of the proxy's environment."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from proxy.config.loading import ConfigError, load_settings
from proxy.supervisord.environment import model_server_environ


def settings(tmp_path: Path, **supervisor: object):
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({
        "service": {"admin_token_env": "ADMIN_TOKEN", "state_dir": str(tmp_path)},
        "supervisor": supervisor,
        "engine": {"models": {"r": {"backend": "openai_remote", "remote_api_key_env": "PROVIDER_KEY",
                                     "remote_base_url": "http://127.0.0.1:9/v1", "remote_model": "m"}}}}))
    return load_settings(path)


def test_only_the_listed_variables_pass_and_never_a_secret(tmp_path: Path) -> None:
    environ = {"PATH": "/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_TIME": "C", "TMPDIR": "/tmp",
               "LD_LIBRARY_PATH": "/opt/lib", "CUDA_VISIBLE_DEVICES": "1", "ADMIN_TOKEN": "t", "PROVIDER_KEY": "k",
               "AWS_SECRET_ACCESS_KEY": "x", "HF_HOME": "/hf"}
    got = model_server_environ(settings(tmp_path, pass_env=["HF_HOME"]), environ)
    assert got == {"PATH": "/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_TIME": "C", "TMPDIR": "/tmp",
                   "LD_LIBRARY_PATH": "/opt/lib", "CUDA_VISIBLE_DEVICES": "1", "HF_HOME": "/hf"}


def test_passing_a_secret_on_purpose_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        settings(tmp_path, pass_env=["PROVIDER_KEY"])
    path = tmp_path / "pool.yaml"
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "pass_env" in text)
    assert info.value.problems == ["supervisor.pass_env: PROVIDER_KEY holds a secret of the proxy (named by "
                                   f"admin_token_env or a *_env field); model servers never get it ({path}:{line})"]


def test_a_tenants_key_variable_is_a_secret_too(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({
        "service": {"state_dir": str(tmp_path)}, "supervisor": {"pass_env": ["WEBUI_KEY"]},
        "tenants": {"webui": {"key_env": ["WEBUI_KEY"], "fairness_key": "ui"}},
        "engine": {"models": {"m": {"backend": "sim"}}}}))
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert "WEBUI_KEY holds a secret of the proxy" in info.value.problems[0]
