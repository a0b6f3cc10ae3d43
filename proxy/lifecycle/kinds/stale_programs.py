"""The programs of models no longer configured: stopped and removed, on every host.

A model dropped from the settings (by an edit, before a restart or a reload) leaves its replicas'
program files behind: in this machine's programs folder, and on every other host, since a node
keeps its files across proxy restarts. A configured model's files are not touched here: its own
load adopts, restarts or removes them.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Iterable, Mapping

from launchers.spec import replica_index
from proxy.lifecycle.kinds.programs import Programs
from proxy.supervisord.hosts import Host
from proxy.supervisord.supervisor import SupervisorClient, SupervisorError

log = logging.getLogger(__name__)


async def remove_stale_programs(programs_dir: Path, models: Iterable[str], programs: Programs,
                                supervisor: SupervisorClient, hosts: Mapping[str, Host],
                                after: asyncio.Event) -> None:
    """Remove every program under `programs_dir` (here and on each host that answers) that is no
    replica of one of `models`, once `after` is set (a reload's predecessor has exited: it may
    still finish requests on a model the new settings dropped)."""
    await after.wait()
    names = list(models)
    # One listing of a folder of a few small files, on the event loop as it always was.
    for path in sorted(programs_dir.glob("*.conf")):  # noqa: ASYNC240
        if any(replica_index(name, path.stem) is not None for name in names):
            continue   # a configured model's replica: its load adopts, restarts or removes it
        log.warning("removing %s: its model is no longer configured", path.name)
        try:
            await programs.remove_group(path.stem)
            path.unlink(missing_ok=True)
            await supervisor.reload_config()
        except SupervisorError as exc:
            log.error("could not remove %s: %s", path.name, exc)
    for name, host in hosts.items():
        if host.local or host.down_since is not None:
            continue
        try:
            stale = [p for p in await host.texts(programs_dir)
                     if not any(replica_index(model, p) is not None for model in names)]
            for program in stale:
                log.warning("removing %s on host %s: its model is no longer configured", program, name)
            if stale:
                await programs.remove([(name, p) for p in stale])
        except SupervisorError as exc:
            log.error("could not remove stale programs on host %s: %s", name, exc)
