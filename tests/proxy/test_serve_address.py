"""Where a running proxy recorded it listens (proxy/serve_address.py), and how `llm-pool ctl` picks its
address (proxy/ctl_target.py): the record while the process it names lives, else the settings, else
the default, saying each time it falls back. (tests/integration/test_operating.py runs it against a
real proxy started with --port.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.cli import build_parser
from proxy.ctl_target import DEFAULT_URL, Target, resolve_target
from proxy.serve_address import ServeAddress, address_path, read_address, remove_address, write_address


@pytest.fixture(autouse=True)
def no_local_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", str(tmp_path / "no-local.yaml"))


def dead_pid() -> int:
    """The PID of a process that has exited (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def target(conf: Path, warned: list[str], *more: str) -> Target:
    args = build_parser().parse_args(["--config", str(conf), "ctl", *more, "models"])
    return resolve_target(args, {}, warned.append)


def test_a_record_reads_back_and_only_its_own_process_removes_it(tmp_path: Path) -> None:
    assert read_address(tmp_path) is None
    write_address(tmp_path, ServeAddress(4242, ("0.0.0.0", 8011), ("::1", 8012)))
    assert read_address(tmp_path) == ServeAddress(4242, ("0.0.0.0", 8011), ("::1", 8012))
    assert ServeAddress(1, ("0.0.0.0", 8011), None).admin_url() == "http://127.0.0.1:8011"
    assert ServeAddress(1, ("0.0.0.0", 8011), ("::1", 8012)).admin_url() == "http://[::1]:8012"
    remove_address(tmp_path, 4243)      # a reload's predecessor: the record is its successor's
    assert address_path(tmp_path).exists()
    remove_address(tmp_path, 4242)
    assert not address_path(tmp_path).exists()


@pytest.mark.parametrize("text", ["{not json", "[]", '{"pid": "7", "public": ["h", 1], "admin": null}',
                                  '{"pid": 7, "public": ["h", "80"], "admin": null}', '{"pid": 7}'])
def test_a_record_that_is_not_one_is_said_so(tmp_path: Path, text: str) -> None:
    address_path(tmp_path).write_text(text)
    why = read_address(tmp_path)
    assert isinstance(why, str) and why.startswith(str(address_path(tmp_path)))


def test_ctl_takes_the_live_proxys_record_over_the_settings_port(tmp_path: Path) -> None:
    conf = tmp_path / "pool.yaml"
    conf.write_text("service: {port: 9123, state_dir: %s}\n" % tmp_path)
    # What `serve --port 9555` records; this test's own process stands for the proxy.
    write_address(tmp_path, ServeAddress(os.getpid(), ("127.0.0.1", 9555), None))
    warned: list[str] = []
    assert target(conf, warned).url == "http://127.0.0.1:9555" and warned == []
    assert target(conf, warned, "--url", "http://127.0.0.1:1").url == "http://127.0.0.1:1"   # --url wins


@pytest.mark.parametrize("broken", ["service: {port: eighty, state_dir: %s, admin_token_env: MY_TOKEN}\n",
                                    "service: {state_dir: %s, admin_token_env: MY_TOKEN}\nengine: {models: 3}\n"])
def test_with_settings_that_do_not_load_ctl_finds_the_proxy_in_the_state_folder_they_name(
        tmp_path: Path, broken: str) -> None:
    conf = tmp_path / "pool.yaml"
    conf.write_text(broken % tmp_path)
    pid = os.getpid()
    write_address(tmp_path, ServeAddress(pid, ("127.0.0.1", 9555), ("127.0.0.1", 9556)))
    warned: list[str] = []
    found = resolve_target(build_parser().parse_args(["--config", str(conf), "ctl", "models"]), {"MY_TOKEN": "t"},
                           warned.append)
    assert (found.url, found.token, found.token_env) == ("http://127.0.0.1:9556", "t", "MY_TOKEN")
    (said,) = warned
    assert said.startswith("settings unusable (") and said.endswith(
        f"using the address the running proxy (pid {pid}) recorded in {address_path(tmp_path)}")


def test_a_record_of_a_process_that_is_gone_is_passed_over_saying_so(tmp_path: Path) -> None:
    conf = tmp_path / "pool.yaml"
    conf.write_text("service: {port: 9123, state_dir: %s}\n" % tmp_path)
    pid = dead_pid()
    write_address(tmp_path, ServeAddress(pid, ("127.0.0.1", 9555), None))
    warned: list[str] = []
    assert target(conf, warned).url == "http://127.0.0.1:9123"
    assert warned == [f"{address_path(tmp_path)} names pid {pid}, which is not running; using the settings' address"]
    conf.write_text("service: {port: [9123], state_dir: %s}\n" % tmp_path)    # and the settings do not load
    warned.clear()
    assert target(conf, warned).url == DEFAULT_URL
    (said,) = warned
    assert f"names pid {pid}, which is not running; trying {DEFAULT_URL}" in said


def test_settings_that_do_not_parse_send_ctl_to_the_default_state_folder(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    conf = tmp_path / "pool.yaml"
    conf.write_text("service: {port: [unclosed\n")
    warned: list[str] = []
    assert target(conf, warned).url == DEFAULT_URL
    (said,) = warned
    assert said.endswith(f"no running proxy recorded in {tmp_path / 'llm-pool' / 'serve.address.json'}; "
                         f"trying {DEFAULT_URL}")
    (tmp_path / "llm-pool").mkdir()
    write_address(tmp_path / "llm-pool", ServeAddress(os.getpid(), ("127.0.0.1", 9555), None))
    assert target(conf, warned).url == "http://127.0.0.1:9555"
