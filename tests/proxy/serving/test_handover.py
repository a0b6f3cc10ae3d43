"""What a reload hands its successor (proxy/serving/handover.py), read and checked, and systemd's
notification datagram (proxy/serving/sd_notify.py). The whole handover, with real processes, is
tests/integration/test_reload_sim.py."""
from __future__ import annotations

import fcntl
import os
import socket
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from proxy.serving import handover
from proxy.serving.handover import (COUNTERS, EVENT, GO, HANDOVER_ENV, LISTEN_FDS_ENV, READY, HandoverError, Inherited,
                                    Succession, handover_environ, message, take_inherited)
from proxy.serving.sd_notify import notify
from proxy.supervisord.managed import claim_state_dir, inherited_lock


@pytest.fixture
def handed(tmp_path: Path) -> Iterator[dict[str, int]]:
    """The descriptors a predecessor passes, opened here (this test plays the predecessor's side
    by naming its own parent as the predecessor)."""
    listener = socket.create_server(("127.0.0.1", 0))
    mine, theirs = socket.socketpair()
    lock = open(tmp_path / "serve.lock", "a+")
    fds = {"listen": listener.detach(), "control": theirs.detach(), "lock": lock.fileno(), "stdout": os.dup(1),
           "stderr": os.dup(2)}
    yield fds
    for name in ("listen", "control", "stdout", "stderr"):
        try:
            os.close(fds[name])
        except OSError:
            pass
    lock.close()
    mine.close()


def environ_for(fds: dict[str, int], **changes: str) -> dict[str, str]:
    env = handover_environ({"PATH": "/bin"}, [fds["listen"]], os.getppid(), fds["control"], fds["lock"],
                           fds["stdout"], fds["stderr"])
    return {**env, **changes}


def test_a_process_started_otherwise_has_nothing_handed() -> None:
    assert take_inherited({"PATH": "/bin"}) is None


def test_the_handed_descriptors_are_taken_and_the_variables_removed(handed: dict[str, int]) -> None:
    environ = environ_for(handed)
    inherited = take_inherited(environ)
    assert inherited is not None and environ == {"PATH": "/bin"}   # nothing started from here sees them
    assert inherited.predecessor == os.getppid() and inherited.lock_fd == handed["lock"]
    # Nothing this process starts (supervisord) may hold the listening socket: the port would outlive it.
    assert not any(os.get_inheritable(fd) for fd in handed.values())
    port = inherited.listeners[0].getsockname()[1]
    assert inherited.take_listener("127.0.0.1", port + 1) is None   # moved: that one is bound anew
    sock = inherited.take_listener("localhost", port)              # the same address, however it is named
    assert sock is not None and sock.fileno() == handed["listen"] and inherited.listeners == []
    handed["listen"] = -1   # the socket object owns it now
    sock.close()


@pytest.mark.parametrize("changes, message", [
    ({LISTEN_FDS_ENV: None}, "come together"),
    ({HANDOVER_ENV: "predecessor=1"}, "must give"),
    ({LISTEN_FDS_ENV: "three"}, "not what a reloading llm-pool serve sets"),
    ({"predecessor": "1"}, "did not start this process"),
    ({LISTEN_FDS_ENV: "lock"}, "is not a listening TCP socket"),
    ({LISTEN_FDS_ENV: "999"}, "descriptor 999"),
])
def test_handover_variables_that_do_not_describe_a_handover_fail_clearly(handed: dict[str, int], changes: dict,
                                                                          message: str) -> None:
    environ = environ_for(handed)
    for key, value in changes.items():
        if key == "predecessor":
            environ[HANDOVER_ENV] = environ[HANDOVER_ENV].replace(f"predecessor={os.getppid()}", f"predecessor={value}")
        elif value is None:
            del environ[key]
        elif value == "lock":
            environ[key] = str(handed["lock"])
        else:
            environ[key] = value
    with pytest.raises(HandoverError, match=message):
        take_inherited(environ)


def test_the_state_folder_lock_is_handed_over_not_claimed_again(tmp_path: Path) -> None:
    held = claim_state_dir(tmp_path)
    passed = os.dup(held.fileno())    # what the successor gets: the same open file, so the same flock
    lock = inherited_lock(tmp_path, passed)
    assert lock is not None
    held.close()                      # the predecessor exits...
    with open(tmp_path / "serve.lock") as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)   # ...and the folder is still held, by the successor
    lock.close()
    stray = open(tmp_path / "other.lock", "a+")
    assert inherited_lock(tmp_path, stray.fileno()) is None   # not this folder's lock: claimed afresh
    stray.close()


@pytest.mark.parametrize("abstract", [False, True])
def test_sd_notify_sends_one_datagram_to_the_socket_systemd_names(tmp_path: Path, abstract: bool) -> None:
    name = f"@llm-pool-test-{uuid.uuid4().hex}" if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name[1:] if abstract else name)
        sock.settimeout(5)
        assert notify("READY=1", "STATUS=serving", environ={"NOTIFY_SOCKET": name})
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving"
    assert not notify("READY=1", environ={})                              # not under systemd: nothing
    assert not notify("READY=1", environ={"NOTIFY_SOCKET": str(tmp_path / "gone")})   # logged, not raised


def succession_on(control: socket.socket) -> Succession:
    """A successor's side of the control socket (its stdout and stderr stay where they are)."""
    return Succession(Inherited(predecessor=os.getppid(), listeners=[], control=control, lock_fd=-1,
                                stdout_fd=os.dup(1), stderr_fd=os.dup(2)))


async def test_the_successor_takes_the_counters_with_go_then_the_predecessors_record_until_it_closes() -> None:
    predecessor, theirs = socket.socketpair()
    with predecessor:
        # All at once, as the predecessor's buffered writes may arrive; a line that is not a message is skipped.
        predecessor.sendall(GO + message(COUNTERS, [{"name": "x"}]) + message(EVENT, {"id": 4}) + b"junk\n"
                            + message(COUNTERS, [{"name": "y"}]))
        predecessor.shutdown(socket.SHUT_WR)   # it exited
        succession = succession_on(theirs)
        assert await succession.take_over()
        assert succession.counters == [{"name": "x"}]
        assert [m async for m in succession.messages()] == [(EVENT, {"id": 4}), (COUNTERS, [{"name": "y"}])]
        assert predecessor.recv(100) == READY


async def test_a_predecessor_that_sends_no_counters_still_hands_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """An older version's `go` comes alone: the successor takes over with nothing to go on from."""
    monkeypatch.setattr(handover, "COUNTERS_WAIT_S", 0.05)
    predecessor, theirs = socket.socketpair()
    with predecessor:
        predecessor.sendall(GO)
        succession = succession_on(theirs)
        assert await succession.take_over() and succession.counters is None
