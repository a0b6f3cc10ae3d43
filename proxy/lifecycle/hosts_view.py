"""What the pool shows of its hosts: whether each one's supervisord answers (GET /health, /metrics),
each host with its memory and replicas (GET /v1/admin/hosts, `llm-pool ctl hosts`), and each
node's GPU memory (GET /v1/admin/gpu-memory).
Read-only views; the pool (proxy/lifecycle/pool.py) hands them its hosts, models and reports."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping, Sequence

from proxy.config.settings import LOCAL_HOST
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.supervisord.hosts import Host


def host_status(hosts: Mapping[str, Host], local: Mapping[str, object]) -> dict[str, dict[str, object]]:
    """Each host: whether its supervisord answers, for how long it has not and why, and the
    seconds since it last answered. This machine's (`local`: the monitor's view of its supervisord,
    Monitor.supervisord_status) is never marked down as a node is."""
    now = time.monotonic()
    out: dict[str, dict[str, object]] = {}
    for name, host in hosts.items():
        if host.local:
            answering, down_for, error = bool(local["answering"]), local["down_for_s"], local["error"]
        else:
            answering, down_for, error = host.down_since is None, host.down_for_s(now), host.error
        out[name] = {"answering": answering, "down_for_s": down_for, "error": error,
                     "last_contact_s": host.last_contact_s(now)}
    return out


def describe_hosts(hosts: Mapping[str, Host], models: Mapping[str, ModelRuntime],
                   memory: Sequence[Mapping[str, Any]], status: Mapping[str, Mapping[str, object]]
                   ) -> list[dict[str, object]]:
    """Each host, with its memory (`memory`: the memory report's devices, host-qualified), its
    status (host_status) and its replicas."""
    rows = []
    for name, host in hosts.items():
        replicas = [f"{rt.name}/r{r.index}" for rt in models.values() for r in rt.replicas if r.host == name]
        prefix = "" if host.local else f"{name}:"
        devices = [{**d, "device": d["device"][len(prefix):]} for d in memory
                   if (d["device"].startswith(prefix) if prefix else ":" not in d["device"])]
        rows.append({**host.describe(), **status[name], "memory": devices, "replicas": len(replicas),
                     "replica_names": replicas})
    return rows


def replica_programs(models: Mapping[str, ModelRuntime], host: str) -> dict[str, str]:
    """The program of each replica on `host`, by its admin name (`model/rN`)."""
    return {f"{rt.name}/r{r.index}": r.spec.program for rt in models.values() for r in rt.replicas
            if r.host == host and r.spec is not None}


async def gpu_memory_by_host(hosts: Mapping[str, Host], models: Mapping[str, ModelRuntime],
                             local: dict[str, Any]) -> dict[str, Any] | None:
    """GET /v1/admin/gpu-memory's `hosts`: this machine's devices (`local`, the report's own) beside
    each node's, read from it now; None where every host is this machine."""
    nodes = [h for h in hosts.values() if not h.local]
    if not nodes:
        return None
    found = await asyncio.gather(*(h.gpu_memory(replica_programs(models, h.name)) for h in nodes))
    return {**({"local": local} if LOCAL_HOST in hosts else {}), **{h.name: f for h, f in zip(nodes, found)}}
