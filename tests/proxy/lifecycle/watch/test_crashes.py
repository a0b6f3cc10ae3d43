"""How a crash is told: supervisord's main log lines (the format of its process.py), else its table."""
from __future__ import annotations

from proxy.lifecycle.watch import crashes
from proxy.supervisord.supervisor import ProcessInfo, ProcessState

LOG = ("2026-12-02 04:00:00,001 INFO spawned: 'm-0123abcd-r0' with pid 41\n"
       "2026-12-02 04:00:01,001 WARN exited: m-0123abcd-r1 (exit status 3; not expected)\n"
       "2026-12-02 04:00:02,001 WARN exited: m-0123abcd-r0 (terminated by SIGKILL; not expected)\n"
       "2026-12-02 04:00:03,001 INFO spawned: 'm-0123abcd-r0' with pid 42\n")


def info(state: ProcessState, pid: int = 0, exitstatus: int = 0, spawnerr: str = "") -> ProcessInfo:
    return ProcessInfo("m-0123abcd-r0", "m-0123abcd-r0", state, pid, exitstatus, "", spawnerr)


def test_the_signal_comes_from_supervisords_log_line_for_that_program_and_the_restart_from_its_table() -> None:
    crash = crashes.describe("m-0123abcd-r0", info(ProcessState.STARTING, 42), True, LOG)
    assert crash == crashes.Crash("killed by SIGKILL", "supervisord restarted it (pid 42)")
    other = crashes.describe("m-0123abcd-r1", info(ProcessState.EXITED), False, LOG)
    assert other.how == "exited with status 3" and other.after == "supervisord restarts it"


def test_without_a_readable_log_the_table_says_what_it_can() -> None:
    assert crashes.describe("p", info(ProcessState.EXITED, exitstatus=-1), False, "").how == "killed by a signal"
    expected = crashes.describe("p", info(ProcessState.EXITED, exitstatus=0), False, "")
    assert expected.how == "exited with status 0" and "does not restart it" in expected.after
    gave_up = crashes.describe("p", info(ProcessState.FATAL, spawnerr="Exited too quickly"), False, "")
    assert gave_up.after == "supervisord gave up restarting it (Exited too quickly)"
    assert crashes.describe("p", info(ProcessState.RUNNING, 7), True, "").how.startswith("exited (")


def test_a_stop_supervisord_was_asked_for_is_told_from_an_exit_by_the_programs_last_line() -> None:
    stop = "2026-12-03 10:00:00,001 INFO stopped: m-0123abcd-r0 (terminated by SIGTERM)\n"
    assert crashes.asked_to_stop("m-0123abcd-r0", LOG + stop)
    assert not crashes.asked_to_stop("m-0123abcd-r0", LOG)                 # its last end was an exit
    assert not crashes.asked_to_stop("m-0123abcd-r0", stop + LOG)          # a stop, then a crash
    assert not crashes.asked_to_stop("m-0123abcd-r", stop) and not crashes.asked_to_stop("p", "")


def test_a_line_that_only_looks_like_an_exit_line_is_not_taken() -> None:
    forged = "exited: p (terminated by SIGKILL; rm -rf /)\nexited: p (exit status 1; not expected)\n"
    assert crashes.describe("p", info(ProcessState.EXITED), False, forged).how == "exited with status 1"
    assert crashes.describe("p", info(ProcessState.EXITED, exitstatus=2), False, "exited: px (exit status 9; "
                                                                                   "expected)").how == \
        "exited with status 2"
