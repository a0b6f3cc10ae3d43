"""How a replica's process ended when nobody asked it to, in supervisord's words, for the proxy's
log and the events feed.

supervisord's process table says little of an exit: `exitstatus` is -1 for any signal (it never
names one) and is reset when the process starts again. Its main log says it all, one line per exit:
`exited: NAME (terminated by SIGKILL; not expected)`. So the end of that log is read once per crash;
where it cannot be read (an admin's supervisord that logs to syslog), the table's figures stand.
A node's log is a node's answer: only what the pattern below matches is taken from it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from proxy.supervisord.supervisor import ProcessInfo, ProcessState

# supervisord's process.py `finish()`, and options.py `decode_wait_status()` for the middle part.
_EXITED = re.compile(r"exited: (?P<name>[A-Za-z0-9_.-]+) \((?:exit status (?P<status>\d+)|terminated by "
                     r"(?P<signal>SIG[A-Z0-9+-]+|signal \d+))(?P<core> \(core dumped\))?; "
                     r"(?P<expected>not expected|expected)\)")
# How much of the main log's end is read: an exit line and the few lines a restart adds after it.
MAIN_LOG_TAIL = 16384
# Any end of a process: `stopped:` when supervisord was asked to stop it (supervisorctl stop or
# restart), `exited:` when it ended by itself (process.py `finish()`).
_END = re.compile(r"(?P<end>exited|stopped): (?P<name>[A-Za-z0-9_.-]+) \(")


@dataclass(frozen=True)
class Crash:
    how: str     # "killed by SIGKILL", "exited with status 3"
    after: str   # what supervisord does about it

    def sentence(self, who: str) -> str:
        return f"{who} {self.how}; {self.after}"


def asked_to_stop(program: str, main_log: str) -> bool:
    """Whether `program`'s last end in supervisord's main log (its end, "" if unreadable) was a
    stop supervisord was asked for, not an exit."""
    ends = [m["end"] for m in _END.finditer(main_log) if m["name"] == program]
    return bool(ends) and ends[-1] == "stopped"


def describe(program: str, info: ProcessInfo, replaced: bool, main_log: str) -> Crash:
    """The end of `program`'s last process. `info`: its table entry now (of the process that
    replaced it when `replaced`); `main_log`: the end of supervisord's own log ("" if unreadable)."""
    line = next((m for m in reversed(list(_EXITED.finditer(main_log))) if m["name"] == program), None)
    if line is not None:
        how = (f"killed by {line['signal']}" if line["signal"] else f"exited with status {line['status']}") + \
            (" (core dumped)" if line["core"] else "")
    elif replaced or info.state not in (ProcessState.EXITED, ProcessState.BACKOFF, ProcessState.FATAL):
        how = "exited (supervisord's log does not say how)"
    elif info.exitstatus == -1:
        how = "killed by a signal"
    else:
        how = f"exited with status {info.exitstatus}"
    if info.state == ProcessState.FATAL:
        after = f"supervisord gave up restarting it ({info.spawnerr or info.description or 'FATAL'})"
    elif replaced:
        after = f"supervisord restarted it (pid {info.pid})" if info.pid else "supervisord restarted it"
    elif info.state == ProcessState.BACKOFF:
        after = f"supervisord restarts it after a back-off ({info.spawnerr or 'exited too quickly'})"
    elif info.state in (ProcessState.STARTING, ProcessState.RUNNING) or \
            (line is not None and line["expected"] == "not expected"):
        after = "supervisord restarts it"
    else:
        # autorestart=unexpected (launchers/spec.py): an exit status in exitcodes is not restarted.
        after = "supervisord does not restart it (an expected exit status)"
    return Crash(how, after)
