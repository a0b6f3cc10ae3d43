"""Warm-up: one short generation on a replica whose health check just passed, before it is READY.

Engines initialise lazily (CUDA graphs, kernels compiled or autotuned, the first allocation of
the KV cache), so without this the first real request pays for it. The warm-up asks for one
token of a chat completion, and of a plain completion where chat is refused (a model without a
chat template). It runs in the probe path of program replicas only: an endpoint (a remote
model) has nothing of ours to warm.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp

from proxy.lifecycle.state.replicas import Replica
from proxy.upstream.client import UpstreamHttp

CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": False})
COMPLETION = ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": False})
# Statuses that mean "this server does not do chat for this model", not "the server is broken".
NOT_SERVED = (400, 404, 405, 422, 501)


async def warm_up(http: UpstreamHttp, replica: Replica, timeout_s: float) -> tuple[float | None, str | None]:
    """(seconds it took, None) once a generation succeeded; (None, why) when it did not."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    started = time.perf_counter()
    status, error = 0, ""
    for path, payload in (CHAT, COMPLETION):
        request_id = f"llm-pool-warmup-{uuid.uuid4().hex[:12]}"
        try:
            resp = await replica.reach.post(http, path, payload, request_id, timeout)
            async with resp:
                text = await resp.text()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return None, f"warm-up request failed: {type(exc).__name__}: {exc}" if str(exc) else \
                f"warm-up request failed: {type(exc).__name__} (within {timeout_s:g}s)"
        if status == 200:
            return time.perf_counter() - started, None
        error = " ".join(text.split())[:200]
        if status not in NOT_SERVED:
            break
    return None, f"warm-up generation answered HTTP {status}: {error}"
