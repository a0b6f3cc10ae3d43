"""`llm-pool node`: a host's supervisord as a node of the pool (the plugin is proxy/supervisord/node.py).

It writes `<state>/supervisord.conf` (an `[inet_http_server]` on the address given, with a username
and the password from LLM_POOL_NODE_PASSWORD, stored only as its SHA-1, as supervisord accepts it;
the plugin; a programs folder; logs), stops what a previous supervisord of this folder left running
should it have been killed, and runs supervisord in the foreground in its place (exec), so that a
service manager (conf/systemd/llm-pool-node.service) signals supervisord itself.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from pathlib import Path
from typing import Mapping

import proxy
from proxy.atomic_file import write_atomic
from proxy.config.settings import DEFAULT_NODE_USERNAME
from proxy.supervisord.environment import PASSED, PASSED_PREFIXES
from proxy.supervisord.managed import running_supervisord, supervisord_sections
from proxy.supervisord.orphans import stop_orphans

PASSWORD_ENV = "LLM_POOL_NODE_PASSWORD"


class NodeError(Exception):
    """A node cannot start as asked; the message says which argument or variable to change."""


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise NodeError(f"--listen {listen!r}: expected HOST:PORT, e.g. 10.0.0.5:9001")
    return host.strip("[]"), int(port)


def node_conf(listen: str, state_dir: Path, username: str, password: str) -> str:
    host, port = parse_listen(listen)
    if not password:
        raise NodeError(f"{PASSWORD_ENV} is unset or empty: a node without a password would run any program "
                        "for anyone who reaches its port")
    if not username or any(c.isspace() for c in username):
        raise NodeError("--username: must be a non-empty name without spaces")
    state = state_dir.resolve()
    digest = hashlib.sha1(password.encode()).hexdigest()
    return "\n".join([
        "; written by llm-pool node; rewritten on every start",
        "[inet_http_server]",
        f"port={host}:{port}",
        f"username={username}",
        # supervisord compares the SHA-1 of what a client sends: the password itself is not stored.
        f"password={{SHA}}{digest}",
        "",
        *supervisord_sections(state),
        "[rpcinterface:llm_pool]",
        "supervisor.rpcinterface_factory = proxy.supervisord.node:make_rpcinterface",
        f"programs_dir={state / 'programs'}",
        f"log_dir={state / 'logs'}",
        f"state_dir={state}",
        "",
        "[supervisorctl]",
        f"serverurl=http://{host}:{port}",
        f"username={username}",
        "",
        "[include]",
        f"files={state / 'programs'}/*.conf",
        "",
    ])


def node_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """What supervisord (and so every model server on the node) runs with: the fixed few that
    model servers may see, never the password; PYTHONPATH so that supervisord finds the plugin
    in this installation."""
    out = {k: v for k, v in environ.items() if (k in PASSED or k.startswith(PASSED_PREFIXES)) and k != PASSWORD_ENV}
    out["PYTHONPATH"] = str(Path(proxy.__file__).resolve().parent.parent)
    return out


def prepare(listen: str, state_dir: Path, username: str, environ: Mapping[str, str]) -> Path:
    text = node_conf(listen, state_dir, username, environ.get(PASSWORD_ENV, ""))
    for sub in (state_dir, state_dir / "logs", state_dir / "programs"):
        sub.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    path = state_dir / "supervisord.conf"
    write_atomic(path, text, mode=0o600)   # it holds the password's hash
    return path


def run_node(listen: str, state_dir: Path, username: str = DEFAULT_NODE_USERNAME,
             environ: Mapping[str, str] | None = None) -> None:
    """Write the config, stop a dead predecessor's programs, and become supervisord (never returns)."""
    environ = os.environ if environ is None else environ
    path = prepare(listen, state_dir, username, environ)
    # Only a supervisord of this folder that is gone leaves orphans; one that runs still owns them.
    # Judged as managed mode judges its own: by the command line, since the PID of one killed with
    # -9 (or from before a reboot) may belong to another process by now.
    old = running_supervisord(state_dir / "supervisord.pid")
    if old:
        raise NodeError(f"{state_dir} already has a running supervisord (pid {old}); stop it first")
    asyncio.run(stop_orphans(state_dir))
    argv = [sys.executable, "-m", "supervisor.supervisord", "-n", "-c", str(path)]
    os.execve(sys.executable, argv, node_environ(environ))
