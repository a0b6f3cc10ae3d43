"""Evicted into sleep, and woken again (vllm_sleep_on_evict; docs/engines.md: "Sleep instead of stop").

A model whose replicas were started able to sleep (their spec's `sleep`, vLLM's sleep mode) is
put to sleep when placement evicts it, instead of stopped: each replica moves its weights to host
RAM and drops its KV cache (POST /sleep?level=1), its process runs on, and the model is ASLEEP,
charged its weights on the CPU budget instead of its GPU (placer.fell_asleep). Only an eviction
sleeps: an idle unload means nobody wants the model, and holding host RAM for it then serves no one.
A request or an admin load wakes it (POST /wake_up), through the same admission as a load, and it
is READY again once its health check passes, as after a start.

Neither a sleep nor a wake ever fails where a stop or a start would not: a sleep that does not
go through (a replica refuses, times out, or does not say it sleeps) is an ordinary stop, and a wake
that does not is an ordinary start from scratch (the pool's _load_locked does that).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

import aiohttp

from proxy import events as ev
from proxy.events import Events
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.upstream.client import UpstreamHttp

log = logging.getLogger(__name__)

# A sleep copies the weights to host RAM and a wake copies them back: seconds for a large model on
# a slow bus (vLLM's blog measured 0.1 to 6 s for 0.5B to 70B). Past this, it is a failure.
SLEEP_TIMEOUT_S = 120.0
# What each asleep replica is charged, by host: placement's figure (placer.may_sleep).
Charges = dict[str, dict[str, int]]


class Waker(Protocol):
    """What a wake needs of the monitor: to look now, and to wait until the replicas are healthy."""

    def wake(self) -> None: ...

    async def await_replicas(self, runtime: ModelRuntime, replicas: list[Replica] | None = None) -> None: ...


def can_sleep(runtime: ModelRuntime) -> bool:
    """Whether every replica of `runtime` runs a server started able to sleep."""
    return bool(runtime.replicas) and all(r.spec is not None and r.spec.sleep is not None for r in runtime.replicas)


async def _call(http: UpstreamHttp, replica: Replica, path: str) -> str | None:
    """POST `path` to the replica: None when it answered 2xx, else why not. Its body is not read
    beyond the status: a replica's bytes decide nothing here but the status and is_sleeping."""
    assert replica.spec is not None
    try:
        async with http.session.post(replica.reach.url(path), headers=dict(replica.spec.headers),
                                     timeout=aiohttp.ClientTimeout(total=SLEEP_TIMEOUT_S)) as resp:
            if 200 <= resp.status < 300:
                return None
            return f"POST {path.split('?')[0]} answered {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return f"POST {path.split('?')[0]} failed: {type(exc).__name__}"


async def _sleeping(http: UpstreamHttp, replica: Replica) -> bool | None:
    """What the replica says of itself (GET is_sleeping): True, False, or None when it does not say."""
    assert replica.spec is not None and replica.spec.sleep is not None
    try:
        async with http.get(replica.reach.url(replica.spec.sleep.is_sleeping_path),
                            headers=dict(replica.spec.headers),
                            timeout=aiohttp.ClientTimeout(total=SLEEP_TIMEOUT_S)) as resp:
            data = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    flag = data.get("is_sleeping") if isinstance(data, dict) else None
    return flag if isinstance(flag, bool) else None


async def _put_to_sleep(http: UpstreamHttp, replica: Replica) -> str | None:
    assert replica.spec is not None and replica.spec.sleep is not None
    error = await _call(http, replica, replica.spec.sleep.sleep_path)
    if error is None and await _sleeping(http, replica) is not True:
        error = "it did not say it sleeps (GET is_sleeping)"
    return error


async def sleep_instead(runtime: ModelRuntime, cause: str | None, may_sleep: Callable[[ModelRuntime], Charges | None],
                        fell_asleep: Callable[[str, Charges], None], http: UpstreamHttp, events: Events) -> bool:
    """An eviction of `runtime` (UNLOADING, under its lock, measured and drained, its waiters held
    for its wake: unloading.stop_serving): put every replica to sleep and make the model ASLEEP
    (True); or False, and the caller stops it as any eviction: placement found no room for it
    asleep, or a replica's sleep did not go through."""
    charges = may_sleep(runtime)
    if charges is None:
        return False
    started = time.monotonic()
    for replica in runtime.replicas:
        replica.cancel_tasks()
    errors = await asyncio.gather(*(_put_to_sleep(http, r) for r in runtime.replicas))
    failed = [f"replica {r.index}: {e}" for r, e in zip(runtime.replicas, errors) if e is not None]
    name = runtime.name
    if failed:
        events.record(ev.SLEEP, f"model {name} could not be put to sleep ({'; '.join(failed)}): stopping it instead",
                      model=name, reason="failed", cause=cause, level=logging.WARNING)
        return False
    for replica in runtime.replicas:
        runtime.set_replica_state(replica, ReplicaState.ASLEEP)
    fell_asleep(name, charges)
    runtime.move(ModelState.ASLEEP)
    runtime.unload_reason = None
    runtime.sleeps += 1
    runtime.sleep_s = time.monotonic() - started
    why = f" for {cause}" if cause else ""
    events.record(ev.SLEEP, f"model {name} evicted{why} into sleep in {runtime.sleep_s:.2f}s: its weights are in "
                  "host RAM, a request wakes it", model=name, reason="evicted", cause=cause)
    return True


async def wake(runtime: ModelRuntime, reason: str, actor: str | None, monitor: Waker, http: UpstreamHttp,
               events: Events) -> bool:
    """Wake an ASLEEP `runtime` whose load was admitted: LOADING, each replica woken and then
    health-checked as after a start, LOADED (True). False when a replica did not wake or pass its
    check: the model is left LOADING with its processes running, for the caller to stop and
    start from scratch."""
    name = runtime.name
    runtime.move(ModelState.LOADING)
    started = time.monotonic()
    runtime.last_error = None
    runtime.admission.reopen()
    asleep = [r for r in runtime.replicas if r.state == ReplicaState.ASLEEP]
    errors = await asyncio.gather(*(_call(http, r, r.spec.sleep.wake_path) for r in asleep
                                    if r.spec is not None and r.spec.sleep is not None))
    failed = [f"replica {r.index}: {e}" for r, e in zip(asleep, errors) if e is not None]
    if not failed and len(asleep) == len(runtime.replicas):
        for replica in runtime.replicas:
            runtime.set_replica_state(replica, ReplicaState.STARTING, "waking")
        monitor.wake()
        await monitor.await_replicas(runtime)
        failed = [f"replica {r.index}: {r.last_error or r.state.value}" for r in runtime.replicas
                  if r.state != ReplicaState.READY]
    elif not failed:
        failed = ["a replica was not asleep"]
    by = f" by {actor}" if actor else ""
    if failed:
        events.record(ev.WAKE, f"model {name} did not wake ({reason}{by}): {'; '.join(failed)}; starting it afresh",
                      model=name, reason="failed", actor=actor, level=logging.WARNING)
        return False
    runtime.move(ModelState.LOADED)
    runtime.loaded_at = time.monotonic()
    runtime.wake_s = runtime.loaded_at - started
    runtime.wakes += 1
    events.record(ev.WAKE, f"model {name} woke ({reason}{by}) in {runtime.wake_s:.2f}s: "
                  f"{len(runtime.ready())} of {len(runtime.replicas)} replicas ready",
                  model=name, reason=reason, actor=actor)
    return True


async def wake_adopted(runtime: ModelRuntime, http: UpstreamHttp, events: Events) -> None:
    """A restarted proxy adopted `runtime`'s running replicas: one an earlier proxy put to sleep
    passes its health check asleep (vLLM answers /health and /v1/models then) but refuses every
    request, so each that says it sleeps is woken. Its memory was charged as a loaded model's."""
    for replica in runtime.ready():
        if replica.spec is None or replica.spec.sleep is None or await _sleeping(http, replica) is not True:
            continue
        error = await _call(http, replica, replica.spec.sleep.wake_path)
        events.record(ev.WAKE, f"model {runtime.name} replica {replica.index} was adopted asleep: "
                      + (f"its wake failed ({error})" if error else "woken"), model=runtime.name,
                      replica=replica.index, reason="failed" if error else "adopted",
                      level=logging.WARNING if error else logging.INFO)
