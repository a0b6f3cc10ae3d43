"""Where a running `llm-pool serve` listens, recorded in its state folder (`serve.address.json`), so
that `llm-pool ctl` reaches it when the settings do not load (when an admin needs it most) or when
`serve --port` put it elsewhere than the settings say.

The serving process writes the file once it listens (a reload's successor once it has taken over)
and removes it at a clean exit; a killed one leaves it behind, so a reader trusts it only while the
process it names is alive. It holds addresses and a PID, never a secret: the admin token stays in
the environment.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from proxy.atomic_file import write_atomic

ADDRESS_FILE = "serve.address.json"
# A wildcard listen address is reached on loopback.
LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def url_for(host: str, port: int) -> str:
    """The URL a client on this machine reaches a listener at `host`:`port` by."""
    host = LOOPBACK.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(frozen=True)
class ServeAddress:
    pid: int
    public: tuple[str, int]
    admin: tuple[str, int] | None   # service.admin_port's listener, where there is one

    def admin_url(self) -> str:
        """Where the admin API answers: its own listener, else the public one."""
        return url_for(*(self.admin or self.public))


def address_path(state_dir: Path) -> Path:
    return state_dir / ADDRESS_FILE


def write_address(state_dir: Path, address: ServeAddress) -> None:
    """Record `address` (OSError when the folder cannot be written)."""
    doc = {"pid": address.pid, "public": list(address.public), "admin": list(address.admin) if address.admin else None}
    write_atomic(address_path(state_dir), json.dumps(doc) + "\n")


def remove_address(state_dir: Path, pid: int) -> None:
    """Remove the record if it is `pid`'s (a reload's successor has written its own over it)."""
    recorded = read_address(state_dir)
    if isinstance(recorded, ServeAddress) and recorded.pid == pid:
        address_path(state_dir).unlink(missing_ok=True)


def read_address(state_dir: Path) -> ServeAddress | str | None:
    """The record; None when there is none; a sentence saying why when it cannot be used."""
    path = address_path(state_dir)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return f"{path} cannot be read: {exc}"
    try:
        pid, public, admin = doc["pid"], _listener(doc["public"]), doc["admin"]
        if type(pid) is not int or pid <= 0:
            raise ValueError(f"pid {pid!r}")
        return ServeAddress(pid, public, None if admin is None else _listener(admin))
    except (KeyError, TypeError, ValueError) as exc:
        return f"{path} is not an address record ({exc})"


def _listener(value: object) -> tuple[str, int]:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and type(value[1]) is int):
        raise ValueError(f"listener {value!r}")
    return value[0], value[1]

