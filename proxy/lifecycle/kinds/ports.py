"""Which port each replica program listens on: stable across reloads, apart from every other program's.

The fixed port of the backend's PORT_FIELD (plus the replica index) when one is configured; else
the port the replica had (its program file says), else the first free one in supervisor.port_range.
Pure but for `port_free`, which asks the kernel.
"""
from __future__ import annotations

import socket
from typing import Callable, Iterable, Mapping, Sequence

from launchers.spec import Launcher, ports_in_file, program_name, replica_index
from proxy.config.model import ModelConfig
from proxy.errors import Unavailable


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on `port` now. SO_REUSEADDR as servers set it: sockets left in
    TIME_WAIT by a replica that exited (an unload) must not make its port look taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def ports_of_other_groups(name: str, texts: Mapping[str, Mapping[str, str]], held: Iterable[int]) -> set[int]:
    """The ports other models' programs were given: in `texts` (every answering host's program
    files, this machine's folder included: hosts on one machine, as in tests and benchmarks, share
    its ports) and `held` (those other models' replicas run on now)."""
    taken: set[int] = set(held)
    for by_name in texts.values():
        for stem, text in by_name.items():
            if replica_index(name, stem) is None:
                taken.update(ports_in_file(text).values())
    return taken


def assign_ports(config: ModelConfig, launcher: Launcher, previous: Mapping[str, int], taken: set[int],
                 port_range: tuple[int, int], indices: Sequence[int],
                 runs: Callable[[str], bool]) -> dict[int, int]:
    """Stable ports, by replica index: the fixed port (plus the index) if configured, else the
    one this replica had (`previous`, by program), else the first free one in `port_range`. Ports
    in `taken` (ports_of_other_groups), of this model's other replicas (running ones included) and
    ports in use are skipped; `runs(program)`: whether this model's program runs on some host (its
    own port then looks in use, and is kept)."""
    fixed = config.get(launcher.PORT_FIELD)
    if fixed:
        return {i: int(fixed) + i for i in indices}
    lo, hi = port_range
    ports: dict[int, int] = {}
    candidates = iter(range(lo, hi + 1))
    for i in indices:
        program = program_name(config.name, i)
        old = previous.get(program)
        if old and old not in taken and old not in ports.values() and (runs(program) or port_free(old)):
            ports[i] = old
            continue
        for port in candidates:
            if port not in taken and port not in ports.values() and port not in previous.values() \
                    and port_free(port):
                ports[i] = port
                break
        else:
            raise Unavailable(f"no free port left in supervisor.port_range {lo}-{hi}", code="no_free_port")
    return ports
