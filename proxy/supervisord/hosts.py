"""The hosts replicas run on: each a supervisord, and how its program files get there.

`local` is this machine's supervisord (managed or external): its program files are written into the
programs folder directly, as always. Every other host is a node (`llm-pool node`): a supervisord
reached over its `[inet_http_server]` with a username and password, whose llm-pool plugin
(proxy/supervisord/node.py) writes and removes the files there and reports the host's devices.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from proxy.config.settings import LOCAL_HOST, HostSettings, Settings
from proxy.masking import shown_url
from proxy.supervisord.supervisor import ProcessInfo, SupervisorClient, SupervisorError


@dataclass
class Host:
    name: str
    client: SupervisorClient
    log_dir: Path | None                  # where its program logs go (a node's: read with getInfo)
    address: str | None = None            # where its replicas are reached; None: the launcher's (local)
    settings: HostSettings | None = None  # None: the local host
    processes: dict[str, ProcessInfo] = field(default_factory=dict)
    table_at: float = 0.0                 # monotonic: when the poll that read `processes` began
    devices: dict[str, Any] | None = None  # a node's getDevices, when it last answered
    down_since: float | None = None       # monotonic; None while it answers
    last_contact: float | None = None     # monotonic: when it last answered; None: never yet
    error: str | None = None

    @property
    def local(self) -> bool:
        return self.settings is None

    async def texts(self, programs_dir: Path) -> dict[str, str]:
        """Its llm-pool program files: text by program name."""
        if self.local:
            return _read_texts(programs_dir)
        return dict(await self.client.call("llm_pool.listPrograms"))

    async def snapshot(self) -> dict[str, ProcessInfo]:
        infos = await self.client.all_process_info() if self.local else \
            [ProcessInfo.from_rpc(i) for i in await self.client.call("llm_pool.getProcesses")]
        return {i.fullname: i for i in infos}

    async def refresh(self) -> None:
        """A node that answers again (or for the first time): its folders and devices."""
        if self.local:
            return
        info, devices = await asyncio.gather(self.client.call("llm_pool.getInfo"),
                                             self.client.call("llm_pool.getDevices"))
        self.log_dir = Path(info["log_dir"])
        self.devices = devices

    async def gpu_memory(self, programs: Mapping[str, str]) -> dict[str, Any]:
        """A node's part of GET /v1/admin/gpu-memory, read on the node now: its GPUs (NVML there),
        its CPU memory, and the measured footprint of each replica program it runs (`programs`:
        program name by the replica's admin name, e.g. `m/r0`)."""
        assert not self.local, "this machine's GPUs are the report's own (proxy/gpu/report.py)"
        try:
            devices = await self.client.call("llm_pool.getDevices")
            found = await asyncio.gather(*(self.client.call("llm_pool.getFootprint", p) for p in programs.values()))
        except SupervisorError as exc:
            return {"answering": False, "available": False, "reason": f"host {self.name} is not answering: {exc}",
                    "gpus": [], "replicas": []}
        gpus = [{"index": int(g["index"]), "name": g["name"], "used_mib": _mib(g["used_bytes"]),
                 "total_mib": _mib(g["total_bytes"]), "free_mib": _mib(g["total_bytes"] - g["used_bytes"])}
                for g in devices.get("gpus") or []]
        cpu = devices.get("cpu") or {}
        out: dict[str, Any] = {"answering": True, "available": bool(gpus), "gpus": gpus,
                               "cpu": {"total_mib": _mib(cpu.get("total_bytes", 0)),
                                       "available_mib": _mib(cpu.get("available_bytes", 0))},
                               "replicas": [{"replica": r, "program": p,
                                             "measured_mib": {d: _mib(b) for d, b in sorted(f.items())}}
                                            for (r, p), f in zip(programs.items(), found)]}
        if not gpus:
            out["reason"] = devices.get("gpu_reason") or f"host {self.name} has no GPU"
        return out

    def mark_down(self, exc: SupervisorError) -> bool:
        """True when it had answered until now."""
        self.error = str(exc)
        if self.down_since is None:
            self.down_since = time.monotonic()
            return True
        return False

    def down_for_s(self, now: float) -> float | None:
        return None if self.down_since is None else round(now - self.down_since, 1)

    def last_contact_s(self, now: float) -> float | None:
        """Seconds since it last answered; None before its first answer."""
        return None if self.last_contact is None else round(max(0.0, now - self.last_contact), 1)

    def describe(self) -> dict[str, Any]:
        devices: dict[str, Any] = dict(self.devices or {})
        now = time.monotonic()
        return {"name": self.name, "url": None if self.settings is None else shown_url(self.settings.url),
                "local": self.local, "answering": self.down_since is None, "down_for_s": self.down_for_s(now),
                "last_contact_s": self.last_contact_s(now), "error": self.error, "devices": devices}


def node_client(host: HostSettings, environ: Mapping[str, str], timeout: float) -> SupervisorClient:
    """The XML-RPC client of a node; its password is read from `environ` here and kept only in the client."""
    return SupervisorClient(host.url, timeout=timeout,
                            auth=(host.username, environ.get(host.password_env, "")))


def build_hosts(settings: Settings, local: SupervisorClient | None, environ: Mapping[str, str]) -> dict[str, Host]:
    hosts: dict[str, Host] = {}
    if local is not None and settings.supervisor.mode != "hosts":
        hosts[LOCAL_HOST] = Host(LOCAL_HOST, local, settings.service.state_dir / "logs")
    for name, conf in settings.supervisor.hosts.items():
        hosts[name] = Host(name, node_client(conf, environ, settings.supervisor.rpc_timeout_s), None,
                           address=conf.address, settings=conf)
    return hosts


def _mib(n: float) -> float:
    return round(float(n) / (1024 * 1024), 1)


def _read_texts(programs_dir: Path) -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(programs_dir.glob("*.conf"))}
