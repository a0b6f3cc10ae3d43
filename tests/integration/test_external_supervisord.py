"""External mode: the proxy drives an admin's own supervisord and leaves it running."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from helpers import ProxyProcess, http, pid_alive, sim_model, supervisord_shows_running, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def admin_supervisord():
    """An admin's supervisord with its own socket and an [include] of a programs folder."""
    home = Path(tempfile.mkdtemp(prefix="lp-admin-", dir="/tmp"))
    (home / "programs").mkdir()
    conf = home / "supervisord.conf"
    conf.write_text("\n".join([
        "[unix_http_server]", f"file={home}/admin.sock", "chmod=0700",
        "[supervisord]", f"logfile={home}/supervisord.log", f"pidfile={home}/supervisord.pid",
        "[rpcinterface:supervisor]", "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "[supervisorctl]", f"serverurl=unix://{home}/admin.sock",
        "[include]", f"files={home}/programs/*.conf", ""]))
    subprocess.run([sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)], check=True, timeout=30)
    pidfile = home / "supervisord.pid"
    pid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), what="supervisord's pidfile"))
    try:
        yield home, conf, pid
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: not pid_alive(pid), what="the admin's supervisord to stop")


def test_external_supervisord_runs_the_models_and_outlives_the_proxy(admin_supervisord, llama_model,
                                                                      proxies) -> None:
    home, conf, supervisord_pid = admin_supervisord
    proxy = ProxyProcess({"tiny": llama_model()})
    proxy.config["supervisor"].update(mode="external", url=f"unix://{home}/admin.sock",
                                      programs_dir=str(home / "programs"))
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxies.append(proxy)
    proxy.start()
    replica = proxy.wait_state("tiny", "loaded")["replicas"][0]
    status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                           body={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert status == 200, body
    supervisord_shows_running(lambda: subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c", str(conf),
                                                      "status"], capture_output=True, text=True, timeout=30).stdout,
                              replica["program"])
    assert not (proxy.state_dir / "supervisord.conf").exists()  # no managed supervisord of its own

    proxy.stop()
    assert not pid_alive(replica["pid"])          # its models are unloaded...
    assert list((home / "programs").iterdir()) == []
    assert pid_alive(supervisord_pid)             # ...but the admin's supervisord is the admin's


def test_program_files_in_the_admins_programs_folder_are_the_proxys_users_alone(admin_supervisord, proxies) -> None:
    # Here only the file's own mode keeps a program's environment (API keys, tokens) from others:
    # the folder is the admin's, not the managed state folder (0700).
    home, _conf, _pid = admin_supervisord
    proxy = ProxyProcess({"sim": sim_model()})
    proxy.config["supervisor"].update(mode="external", url=f"unix://{home}/admin.sock",
                                      programs_dir=str(home / "programs"))
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxies.append(proxy)
    proxy.start()
    proxy.wait_state("sim", "loaded")
    (program,) = (home / "programs").glob("*.conf")
    assert stat.S_IMODE(program.stat().st_mode) == 0o600
