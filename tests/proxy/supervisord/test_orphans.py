"""The record of model-server processes, and stopping the ones a dead supervisord left: only
processes that are still the recorded ones (command line and start time)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from helpers import wait_for
from proxy.supervisord.orphans import PidRecord, identity, stop_orphans
from proxy.supervisord.supervisor import ProcessInfo, ProcessState


async def test_a_recorded_pid_now_used_by_another_process_is_left_alone(tmp_path: Path) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_for(lambda: identity(other.pid), 10, what="the child's exec")   # its command line, not an empty one
        PidRecord(tmp_path).update([ProcessInfo("g", "p", ProcessState.RUNNING, other.pid, 0, "")])
        record = tmp_path / "replica-pids.json"
        entries = json.loads(record.read_text())
        entries[0]["start"] -= 1              # as if the recorded process had ended and its PID been reused
        record.write_text(json.dumps(entries))
        assert await stop_orphans(tmp_path) == []
        assert other.poll() is None
        PidRecord(tmp_path).update([ProcessInfo("g", "p", ProcessState.RUNNING, other.pid, 0, "")])
        assert await stop_orphans(tmp_path) == [other.pid]
        assert other.wait(10) == -signal.SIGTERM
    finally:
        other.kill()
        other.wait()


async def test_a_process_still_starting_is_recorded_and_stopped(tmp_path: Path) -> None:
    # A replica may serve before supervisord's startsecs are over: a supervisord killed then must
    # not leave it running.
    starting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # Polled as the monitor does: just after the fork its command line reads empty and it is
        # not recorded until the exec is done.
        record = PidRecord(tmp_path)
        wait_for(lambda: record.update([ProcessInfo("g", "p", ProcessState.STARTING, starting.pid, 0, "")])
                 or record.path.exists() and json.loads(record.path.read_text()), 10, what="the starting process to be recorded")
        assert await stop_orphans(tmp_path) == [starting.pid]
        assert starting.wait(10) == -signal.SIGTERM
    finally:
        starting.kill()
        starting.wait()
