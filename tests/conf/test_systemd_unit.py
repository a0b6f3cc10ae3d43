"""conf/systemd/llm-pool.service: its commands are real llm-pool commands, its stop and reload
semantics are the ones docs/operating.md promises, and systemd itself accepts it where systemd is installed."""
from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.cli import build_parser, cmd_check_config, cmd_serve
from proxy.config.settings import DEFAULT_SERVICE, DEFAULT_SUPERVISOR

UNIT = Path(__file__).resolve().parents[2] / "conf" / "systemd" / "llm-pool.service"
VENV_BIN = "%h/llm-pool/.venv/bin/"


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def command(line: str) -> list[str]:
    return shlex.split(line.lstrip("-@+!:"))  # systemd's command prefixes are not part of argv


def test_start_commands_are_llm_pool_commands() -> None:
    service = unit()["Service"]
    serve = command(service["ExecStart"])
    check = command(service["ExecStartPre"])
    assert serve[0] == check[0] == VENV_BIN + "llm-pool"
    args = build_parser().parse_args(serve[1:])
    # Managed mode, and the process unloads on stop: --keep-models would leave models behind on stop.
    assert args.func is cmd_serve and args.keep_models is False
    assert build_parser().parse_args(check[1:]).func is cmd_check_config
    assert service["WorkingDirectory"] + "/.venv/bin/" == VENV_BIN


def test_stop_reaches_the_proxy_alone_and_reload_keeps_the_models() -> None:
    service = unit()["Service"]
    # Only the proxy gets SIGTERM, and unloads the models itself; supervisord and the models share the
    # unit's cgroup, so any other KillMode would kill them when the proxy exits on reload.
    assert (service["KillMode"], service["KillSignal"]) == ("process", "SIGTERM")
    assert command(service["ExecReload"]) == ["/bin/kill", "-USR1", "$MAINPID"]
    assert service["Restart"] == "always"  # brings the proxy back after a crash
    assert int(service["TimeoutStopSec"]) > DEFAULT_SERVICE["drain_timeout_s"] + DEFAULT_SUPERVISOR["stopwaitsecs"]
    assert service["EnvironmentFile"].startswith("-%h/")  # secrets, optional
    assert unit()["Install"]["WantedBy"] == "default.target"  # a user unit


def test_a_reload_changes_the_main_pid_and_systemd_is_told() -> None:
    service = unit()["Service"]
    # The successor becomes the main process: systemd must follow MAINPID=, which the proxy sends
    # (proxy/serving/sd_notify.py) from the main process, as NotifyAccess=main requires.
    assert (service["Type"], service["NotifyAccess"]) == ("notify", "main")
    # A reload is waited for until READY=1: longer than the successor may take to adopt.
    assert int(service["TimeoutStartSec"]) > DEFAULT_SERVICE["reload_timeout_s"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_it(tmp_path: Path) -> None:
    # systemd checks that the commands exist: point them at this environment's llm-pool.
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "llm-pool").exists():
        pytest.skip(f"no llm-pool console script next to {sys.executable} (pip install -e . makes one)")
    text = UNIT.read_text().replace(VENV_BIN, f"{bin_dir}/").replace("WorkingDirectory=%h/llm-pool",
                                                                     f"WorkingDirectory={tmp_path}")
    rendered = tmp_path / "llm-pool.service"
    rendered.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(rendered)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys and only warns: any output is a problem too.
    assert result.returncode == 0 and (result.stdout + result.stderr).strip() == "", result.stdout + result.stderr
