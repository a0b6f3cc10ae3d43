"""`llm-pool check-config` names each tenant mistake (issue 39, item 10): a tenant with no key, a
key variable that is unset, one key in two tenants, a tenant key equal to the admin token, a model
glob that matches no model. An error (exit 2) where the tenant is left unable to serve a request, a
warning otherwise, and an error with --strict; no message shows a key or a whole digest."""
from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli import EXIT_CONFIG, main
from proxy.tenants.ledger import SqliteLedger
from proxy.tenants.keys import digest, key_id

SIM = {"backend": "sim", "enabled": False}
SECRET = "sk-tenant-secret-value"


def check(tmp_path: Path, tenants: dict[str, Any], *flags: str, service: dict[str, Any] | None = None) -> int:
    config = tmp_path / "pool.yaml"
    config.write_text(yaml.safe_dump({"service": {"state_dir": str(tmp_path / "s"), **(service or {})},
                                      "engine": {"models": {"chat-small": SIM, "chat-big": SIM}},
                                      "tenants": tenants}, sort_keys=False))
    return main(["--config", str(config), "check-config", *flags])


def lines(capsys: pytest.CaptureFixture[str]) -> tuple[list[str], str]:
    out = capsys.readouterr()
    assert SECRET not in out.err + out.out
    return out.err.splitlines(), out.out


def test_well_configured_tenants_pass_without_a_word(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("UI_KEY", SECRET)
    tenants = {"ui": {"fairness_key": "ui", "key_env": ["UI_KEY"], "models": ["chat-*"]},
               "batch": {"fairness_key": "batch", "key_sha256": [digest("other")]}}
    assert check(tmp_path, tenants, "--strict") == 0
    err, out = lines(capsys)
    assert err == [] and out.startswith("ok: 2 model(s)")


def test_a_tenant_with_no_key_at_all_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: exit 0 without a word, and every request of the tenant's clients was a 401. A warning,
    # not an error: its first key may be one an admin mints, which needs the proxy running (and
    # check-config is the systemd unit's ExecStartPre); an admin's CI (--strict) fails on it.
    assert check(tmp_path, {"ui": {"fairness_key": "ui"}}) == 0
    err, _ = lines(capsys)
    assert any(line.startswith("llm-pool: warning: tenants.ui: the tenant has no key (no key_env, no key_sha256, "
                               "no key minted)") and "ctl keys mint ui" in line for line in err), err
    assert check(tmp_path, {"ui": {"fairness_key": "ui"}}, "--strict") == EXIT_CONFIG
    assert "  tenants.ui: the tenant has no key" in capsys.readouterr().err


def test_a_key_minted_for_the_tenant_is_a_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "s").mkdir()
    ledger = SqliteLedger(tmp_path / "s" / "usage.sqlite3")
    try:
        sha = digest("minted")
        ledger.add_key("ui", key_id(sha), sha, time.time())
    finally:
        ledger.close()
    assert check(tmp_path, {"ui": {"fairness_key": "ui"}}, "--strict") == 0
    assert lines(capsys)[0] == []


def test_an_unset_key_variable_is_an_error_when_it_was_the_only_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("UI_KEY", raising=False)
    assert check(tmp_path, {"ui": {"fairness_key": "ui", "key_env": ["UI_KEY"]}}) == EXIT_CONFIG
    err, _ = lines(capsys)
    assert any(line.startswith("  tenants.ui.key_env.0: UI_KEY is unset or empty, so that key does not work; "
                               "the tenant has no other key") for line in err), err


def test_an_unset_key_variable_beside_a_working_key_is_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("UI_SPARE", raising=False)
    monkeypatch.setenv("UI_KEY", SECRET)
    tenants = {"ui": {"fairness_key": "ui", "key_env": ["UI_KEY", "UI_SPARE"]}}
    assert check(tmp_path, tenants) == 0
    err, out = lines(capsys)
    assert err[0].startswith("llm-pool: warning: tenants.ui.key_env.1: UI_SPARE is unset or empty"), err
    assert "1 warning(s)" in out
    assert check(tmp_path, tenants, "--strict") == EXIT_CONFIG   # an admin's CI: every tenant mistake fails it
    assert "  tenants.ui.key_env.1: UI_SPARE is unset" in capsys.readouterr().err


def test_one_key_in_two_tenants_is_named_by_where_it_is_set_and_its_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("UI_KEY", SECRET)
    monkeypatch.setenv("BATCH_KEY", "batch-own-key")
    sha = hashlib.sha256(SECRET.encode()).hexdigest()
    tenants = {"ui": {"fairness_key": "ui", "key_env": ["UI_KEY"]},
               "batch": {"fairness_key": "batch", "key_env": ["BATCH_KEY"], "key_sha256": [sha]}}
    assert check(tmp_path, tenants) == 0   # batch keeps a key of its own: a warning
    err, _ = lines(capsys)
    assert err[0].startswith(f"llm-pool: warning: tenants.batch.key_sha256.0: this digest's key is tenant ui's "
                             f"key too (tenants.ui.key_env.0, key id {sha[:12]}); it stays ui's, so tenant batch "
                             "cannot use it"), err
    assert sha not in "\n".join(err)   # the id, never the whole digest
    # Without a key of its own, batch can serve nothing: an error.
    del tenants["batch"]["key_env"]
    assert check(tmp_path, tenants) == EXIT_CONFIG
    assert "  tenants.batch.key_sha256.0: this digest's key is tenant ui's key too" in capsys.readouterr().err


def test_a_tenant_key_equal_to_the_admin_token_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ADMIN_TOKEN", SECRET)
    monkeypatch.setenv("UI_KEY", SECRET)
    monkeypatch.setenv("UI_SPARE", "ui-spare-key")
    service = {"admin_token_env": "ADMIN_TOKEN"}
    tenants = {"ui": {"fairness_key": "ui", "key_env": ["UI_KEY"]}}
    assert check(tmp_path, tenants, service=service) == EXIT_CONFIG
    err, _ = lines(capsys)
    assert any(line.startswith("  tenants.ui.key_env.0: the key in UI_KEY is the admin token (ADMIN_TOKEN), which "
                               "opens the admin API only: that key is dropped; the tenant has no other key")
               for line in err), err
    tenants["ui"]["key_env"] = ["UI_KEY", "UI_SPARE"]
    assert check(tmp_path, tenants, service=service) == 0
    assert lines(capsys)[0][0].startswith("llm-pool: warning: tenants.ui.key_env.0: the key in UI_KEY is the admin token")


def test_a_model_glob_that_matches_no_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("UI_KEY", SECRET)
    tenants = {"ui": {"fairness_key": "ui", "key_env": ["UI_KEY"], "models": ["chat-small", "gpt-*"]}}
    assert check(tmp_path, tenants) == 0
    err, _ = lines(capsys)
    assert err == ["llm-pool: warning: tenants.ui.models.1: 'gpt-*' matches no configured model "
                   f"({tmp_path / 'pool.yaml'}:16)"], err
    tenants["ui"]["models"] = ["gpt-*"]
    assert check(tmp_path, tenants) == EXIT_CONFIG
    assert "  tenants.ui.models.0: 'gpt-*' matches no configured model; the tenant may use no model" \
        in capsys.readouterr().err


def test_a_llama_server_ram_cache_turned_back_on_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # With tenants the pool runs llama-server without its RAM prompt cache (one tenant's cached count
    # would show what another sent); an extra arg that turns it back on is named.
    monkeypatch.setenv("UI_KEY", SECRET)
    config = tmp_path / "pool.yaml"
    llama = {"backend": "llama_server", "enabled": False, "model_path": str(tmp_path / "m.gguf"),
             "llama_server_extra_args": ["--cache-ram", "512"]}
    config.write_text(yaml.safe_dump({"service": {"state_dir": str(tmp_path / "s")},
                                      "engine": {"models": {"chat-small": llama}},
                                      "tenants": {"ui": {"fairness_key": "ui", "key_env": ["UI_KEY"]}}}))
    main(["--config", str(config), "check-config"])
    err, _ = lines(capsys)
    assert any("engine.models.chat-small.llama_server_extra_args: --cache-ram turns llama-server's RAM prompt "
               "cache back on" in line for line in err), err
