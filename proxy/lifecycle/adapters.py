"""A replica's LoRA adapters changed at run time (docs/adapters.md): vLLM's
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING). A
llama-server replica holds every adapter of its command line from its start to its end: nothing
here applies to it (`changeable`).

What a replica answers is untrusted: its status decides, its body is only quoted (cut short) in
the error. An adapter's name and path come from the settings, never from a request.
"""
from __future__ import annotations

import asyncio

import aiohttp

from proxy.config.model import Adapter
from proxy.errors import BackendError
from proxy.lifecycle.state.replicas import Replica
from proxy.upstream.client import UpstreamHttp

# vLLM reads the adapter's files before it answers; a large one from a slow disk takes a while.
CHANGE_TIMEOUT_S = 120.0
MAX_QUOTED = 300


def changeable(replica: Replica) -> bool:
    """Whether the replica's engine loads and unloads adapters at run time."""
    adapters = replica.spec.adapters if replica.spec is not None else None
    return adapters is not None and adapters.load_path is not None


async def load(http: UpstreamHttp, replica: Replica, adapter: Adapter) -> None:
    """Load `adapter` into the replica (a request for it, or an admin's load); BackendError if the
    engine refuses. Two requests that find it missing at once load it once."""
    lock = replica.adapter_locks.setdefault(adapter.name, asyncio.Lock())
    async with lock:
        if replica.holds(adapter.name):
            return
        await _change(http, replica, "load", {"lora_name": _served_as(replica, adapter), "lora_path": adapter.path})
        replica.adapters_dropped.pop(adapter.name, None)


async def unload(http: UpstreamHttp, replica: Replica, adapter: Adapter) -> None:
    """Unload `adapter` from the replica, freeing its place in the engine's adapter cache."""
    lock = replica.adapter_locks.setdefault(adapter.name, asyncio.Lock())
    async with lock:
        if not replica.holds(adapter.name):
            return
        await _change(http, replica, "unload", {"lora_name": _served_as(replica, adapter)})
        replica.adapters_dropped[adapter.name] = replica.pid


def _served_as(replica: Replica, adapter: Adapter) -> str:
    adapters = replica.spec.adapters if replica.spec is not None else None
    return adapters.served_as(adapter.name) if adapters is not None else adapter.name


async def _change(http: UpstreamHttp, replica: Replica, action: str, payload: dict[str, str]) -> None:
    adapters = replica.spec.adapters if replica.spec is not None else None
    path = adapters.load_path if adapters is not None and action == "load" else \
        adapters.unload_path if adapters is not None else None
    what = f"replica {replica.index} of {replica.model!r}"
    if path is None:
        raise BackendError(f"{what} cannot {action} LoRA adapters at run time")
    headers = dict(getattr(replica.reach, "headers", {}))
    try:
        async with http.session.post(replica.reach.url(path), json=payload, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=CHANGE_TIMEOUT_S)) as resp:
            status = resp.status
            body = await resp.content.read(MAX_QUOTED)
    except asyncio.TimeoutError:
        raise BackendError(f"{what} did not {action} adapter {payload['lora_name']!r} within "
                           f"{CHANGE_TIMEOUT_S:g}s") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise BackendError(f"{what} could not {action} adapter {payload['lora_name']!r}: "
                           f"{type(exc).__name__}") from exc
    if status != 200:
        text = body.decode("utf-8", "replace").strip()
        raise BackendError(f"{what} refused to {action} adapter {payload['lora_name']!r} ({status}: {text})")
