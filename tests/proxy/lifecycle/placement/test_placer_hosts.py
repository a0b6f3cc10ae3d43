"""Footprints of replicas on other hosts: measured there, through the node plugin, with a real node
(`llm-pool node`, a real supervisord on loopback) running a real sim replica."""
from __future__ import annotations

from pathlib import Path

import yaml

from fakes import RecordingPlacerActions
from helpers import Node, free_port
from launchers import sim
from launchers.spec import render_replica
from proxy.admission import Admission
from proxy.config.loading import load_settings
from proxy.gpu.footprint import GpuTotals
from proxy.gpu.vram_estimate import Estimator
from proxy.lifecycle.placement.footprints import Footprints
from proxy.lifecycle.placement.memory import CPU, Memory
from proxy.lifecycle.placement.placer import Placer
from proxy.upstream.reach import ProgramReach
from proxy.lifecycle.state.replicas import Replica, ReplicaState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.supervisord.hosts import build_hosts




async def test_a_replica_on_another_host_is_measured_on_that_host_through_its_node(tmp_path: Path) -> None:
    node = Node("b", "pb").start()
    try:
        (tmp_path / "pool.yaml").write_text(yaml.safe_dump({
            "service": {"state_dir": str(tmp_path)},
            "supervisor": {"mode": "hosts", "hosts": {"b": {"url": node.url, "password_env": "NODE_B_PASSWORD"}}},
            "engine": {"models": {"m": {"backend": "sim", "hosts": ["b"]}}}}))
        settings = load_settings(tmp_path / "pool.yaml")
        hosts = build_hosts(settings, None, {"NODE_B_PASSWORD": "pb"})
        host = hosts["b"]
        await host.refresh()
        assert host.log_dir is not None
        config = settings.models["m"]
        spec = sim.launch(config, 0, free_port(), 5, {})
        await host.client.call("llm_pool.writeProgram", spec.program, render_replica("m", spec, host.log_dir))
        await host.client.start_process(f"{spec.program}:{spec.program}")
        node.remember()

        memory = Memory(settings.lifecycle, Footprints(tmp_path / "footprints.json"), Estimator(), GpuTotals({}),
                        hosts=hosts)
        runtime = ModelRuntime(config=config, admission=Admission())
        replica = Replica(model="m", index=0, spec=spec, fullname=f"{spec.program}:{spec.program}",
                          reach=ProgramReach(spec), host="b")
        # Its PID is the node's: on another machine it names nothing (or another process) here.
        replica.pid, replica.alive = 2 ** 22 - 1, True
        runtime.replicas = [replica]
        runtime.set_replica_state(replica, ReplicaState.STARTING)
        runtime.set_replica_state(replica, ReplicaState.READY)
        assert memory.footprints.measured(config, (CPU,)) is None
        await Placer(settings, {"m": runtime}, memory, RecordingPlacerActions({"m": runtime})).measure(runtime)
        measured = memory.footprints.measured(config, (CPU,))
        assert measured is not None and measured.raw[CPU] > 1024 * 1024, measured
        await host.client.close()
    finally:
        node.stop()
