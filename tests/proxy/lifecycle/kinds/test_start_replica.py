"""A start supervisord refuses says why (issue 39's busy-machine run): a server that exits at once is,
by the machine's timing, an exit during the start (the monitor adds the log tail) or supervisord's
SPAWN_ERROR to startProcess, which said only "SPAWN_ERROR: group:name (fault 50)"."""
from __future__ import annotations

from typing import Any, cast

import pytest

from fakes import FakeSupervisor
from launchers.spec import ProgramSpec
from proxy.lifecycle.kinds.programs import start_replica
from proxy.lifecycle.state.replicas import Replica
from proxy.supervisord.supervisor import SpawnError
from proxy.upstream.reach import ProgramReach

SPEC = ProgramSpec(program="m-r0", argv=(), env=(), host="127.0.0.1", port=1, health_path="/health",
                   models_path=None, served_model="m", start_timeout_s=5, stopwaitsecs=5)


def replica() -> Replica:
    return Replica(model="m", index=0, spec=SPEC, fullname="m:m-r0", reach=ProgramReach(SPEC))


async def test_a_refused_start_carries_the_programs_log_tail() -> None:
    supervisor = FakeSupervisor()
    supervisor.refuse_starts = True
    supervisor.log = "failing-server: cannot open /srv/secret/model.gguf\n"
    with pytest.raises(SpawnError) as refused:
        await start_replica(cast(Any, supervisor), replica())
    assert refused.value.code == 50
    assert str(refused.value) == ("SPAWN_ERROR: m:m-r0; log tail:\nfailing-server: cannot open "
                                  "/srv/secret/model.gguf (fault 50)")


async def test_a_refused_start_with_an_empty_log_is_supervisords_word_alone() -> None:
    supervisor = FakeSupervisor()
    supervisor.refuse_starts, supervisor.log = True, ""
    with pytest.raises(SpawnError, match=r"^SPAWN_ERROR: m:m-r0 \(fault 50\)$"):
        await start_replica(cast(Any, supervisor), replica())


async def test_a_start_takes_the_pid_at_once() -> None:
    supervisor = FakeSupervisor()
    started = replica()
    await start_replica(cast(Any, supervisor), started)
    assert (started.pid, started.alive) == (300, True)
