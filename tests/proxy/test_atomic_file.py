"""State files survive a kill mid-write: the old file or the new one, never half of one.

Each case runs the real writer in a child process whose file-size limit (RLIMIT_FSIZE) is below
the new file's size, with SIGXFSZ at its default action: the kernel kills the child in the middle
of writing, after exactly `LIMIT` bytes, every time. What is left under the file's name must then
be the old content, whole, and no temporary file may be mistaken for it.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from proxy.atomic_file import write_atomic

REPO = Path(__file__).resolve().parents[2]
LIMIT = 64          # bytes a child may write to any one file before the kernel kills it
OLD = "old and whole\n"

PRELUDE = """
import os, resource, signal, sys
from pathlib import Path
def limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)   # Python ignores it; the default kills
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
"""


def _killed_while(tmp_path: Path, code: str) -> None:
    """Run `code` (after PRELUDE; it calls limit() right before the write) and expect SIGXFSZ."""
    script = PRELUDE.format(limit=LIMIT) + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "TMP": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == -signal.SIGXFSZ, f"not killed mid-write (rc {done.returncode}): {done.stderr[-2000:]}"


def _config(tmp_path: Path) -> Path:
    doc = {"service": {"state_dir": str(tmp_path / "state")},
           "engine": {"models": {"m": {"backend": "sim"}}}}
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(doc))
    (tmp_path / "state").mkdir()
    return path


def test_write_atomic_killed_mid_write_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text(OLD)
    _killed_while(tmp_path, f"""
        from proxy.atomic_file import write_atomic
        limit()
        write_atomic(Path({str(target)!r}), "new " * 1000)
    """)
    assert target.read_text() == OLD


def test_supervisord_conf_killed_mid_write_leaves_the_old_file(tmp_path: Path) -> None:
    config = _config(tmp_path)
    conf = tmp_path / "state" / "supervisord.conf"
    conf.write_text(OLD)
    _killed_while(tmp_path, f"""
        from proxy.config.loading import load_settings
        from proxy.supervisord.managed import prepare_state_dir
        settings = load_settings({str(config)!r})
        limit()
        prepare_state_dir(settings)
    """)
    assert conf.read_text() == OLD


def test_pid_record_killed_mid_write_leaves_the_old_record(tmp_path: Path) -> None:
    record = tmp_path / "replica-pids.json"
    record.write_text(OLD)
    _killed_while(tmp_path, f"""
        from proxy.supervisord.orphans import PidRecord
        from proxy.supervisord.supervisor import ProcessInfo, ProcessState
        rec = PidRecord(Path({str(tmp_path)!r}))
        limit()
        rec.update([ProcessInfo("g", "r0", ProcessState.RUNNING, os.getpid(), 0, "")])
    """)
    assert record.read_text() == OLD


def test_footprints_killed_mid_write_leave_the_old_history(tmp_path: Path) -> None:
    config = _config(tmp_path)
    history = tmp_path / "footprints.json"
    old = json.dumps({"version": 1, "models": {}})
    history.write_text(old)
    _killed_while(tmp_path, f"""
        from proxy.config.loading import load_settings
        from proxy.lifecycle.placement.footprints import Footprints
        model = load_settings({str(config)!r}).models["m"]
        prints = Footprints(Path({str(history)!r}))
        limit()
        prints.record(model, {{"cpu": 123456789}})
    """)
    assert history.read_text() == old


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "missing-folder" / "x.json"
    with pytest.raises(OSError):
        write_atomic(target, "text")
    target.parent.mkdir()
    write_atomic(target, "text")
    assert target.read_text() == "text"
    assert [p.name for p in target.parent.iterdir()] == ["x.json"]


# Writes that are not the proxy's own state: build tooling (proxy/setup, run by `llm-pool setup`,
# which marks a finished build last) and the serve lock (opened for flock, never written).
NOT_STATE = ("proxy/setup/", "proxy/atomic_file.py")
WRITE = re.compile(r"\.write_text\(|\.write_bytes\(|\bopen\([^)\n]*[\"'][wx]")


def test_the_proxy_writes_its_files_only_through_write_atomic() -> None:
    found = []
    for path in [*(REPO / "proxy").rglob("*.py"), *(REPO / "launchers").rglob("*.py")]:
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(NOT_STATE):
            continue
        found += [f"{rel}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1) if WRITE.search(line)]
    assert found == []


def test_the_scan_sees_a_direct_write() -> None:
    assert WRITE.search('path.write_text(text)') and WRITE.search('open(p, "w")') and not WRITE.search('open(p)')
