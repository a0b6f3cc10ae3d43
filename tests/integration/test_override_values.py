"""Override values are data (issue 28): a load through the admin API may change a number or pick
from the engine's set, never choose what runs nor add a line to a program file; and program files,
which may hold keys, are readable by the proxy's user only. Real `llm-pool serve`, supervisord and
the simulated engine."""
from __future__ import annotations

import stat
from pathlib import Path

import pytest

from helpers import ProxyProcess, http, sim_model

pytestmark = pytest.mark.integration


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_load_cannot_choose_the_interpreter_nor_inject_a_command(proxies: list[ProxyProcess],
                                                                   tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    script = tmp_path / "not-python.sh"
    script.write_text(f"#!/bin/sh\ntouch {ran}\n")
    script.chmod(0o755)
    proxy = ProxyProcess({"sim1": sim_model(enabled=False)})
    proxies.append(proxy)
    proxy.start()
    # The two payloads: an executable of the caller's choosing, and a line break that gives
    # supervisord a second `command=` (it takes the last).
    for python in (str(script), f'x\ncommand=/bin/sh -c "touch {ran}"\n;'):
        status, _, body = http("POST", proxy.url + "/v1/admin/models/sim1/load",
                               {"overrides": {"sim": {"ttft_ms": 2, "python": python}}})
        assert (status, body["error"]["code"]) == (400, "invalid_load_request"), body
        assert body["error"]["message"].startswith("overrides.sim.python: set in the config files only")
    assert proxy.admin_model("sim1")["state"] == "unloaded"
    assert list((proxy.state_dir / "programs").glob("*.conf")) == []   # nothing written, nothing started
    assert not ran.exists()
    # The same override without the key is an ordinary load.
    status, _, body = http("POST", proxy.url + "/v1/admin/models/sim1/load", {"overrides": {"sim": {"ttft_ms": 2}}})
    assert status == 200 and body["state"] == "loaded", body
    assert not ran.exists()


def test_program_files_are_the_proxys_users_alone_and_an_adopted_ones_mode_is_tightened(
        proxies: list[ProxyProcess]) -> None:
    proxy = ProxyProcess({"sim1": sim_model()})
    proxies.append(proxy)
    proxy.start(keep_models=True)
    (replica,) = proxy.wait_state("sim1", "loaded")["replicas"]
    (program,) = (proxy.state_dir / "programs").glob("*.conf")
    assert mode(program) == 0o600
    program.chmod(0o644)   # as a version before this one wrote it
    proxy.stop()
    proxy.start()
    (adopted,) = proxy.wait_state("sim1", "loaded")["replicas"]
    assert adopted["pid"] == replica["pid"]   # adopted: its text did not change, so nothing restarted
    assert mode(program) == 0o600
