"""llama-server's slot endpoints, as the KV store uses them: GET /slots, POST /slots/{id}?action=save
and ?action=restore (--slot-save-path). Whatever a replica answers is untrusted: only the fields
read here, of the types expected, count; anything else is a failure the caller falls back from.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.lifecycle.state.replicas import Replica
from proxy.upstream.client import UpstreamHttp

# The most of an answer read: /slots of many slots with their prompts is the largest.
MAX_ANSWER_BYTES = 8 << 20


class SlotError(Exception):
    """A slot call that did not do what it should (the reason, for the log and the counts)."""


@dataclass(frozen=True)
class SlotInfo:
    id: int
    tokens: int          # tokens cached in it (n_prompt_tokens: the prompt and what it generated)
    busy: bool
    task: int            # its last task's id: higher is more recent


@dataclass(frozen=True)
class Done:
    tokens: int
    bytes: int
    ms: float


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


async def _call(http: UpstreamHttp, replica: Replica, method: str, path: str, timeout_s: float,
                payload: dict[str, Any] | None = None) -> Any:
    headers = dict(getattr(replica.reach, "headers", {}))
    try:
        async with http.session.request(method, replica.reach.url(path), json=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=max(0.001, timeout_s))) as resp:
            body = await resp.content.read(MAX_ANSWER_BYTES + 1)
            status = resp.status
    except asyncio.TimeoutError:
        raise SlotError(f"no answer within {timeout_s:.3g}s") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise SlotError(f"{type(exc).__name__}") from exc
    if len(body) > MAX_ANSWER_BYTES:
        raise SlotError("answer too large")
    try:
        data = json.loads(body)
    except ValueError:
        raise SlotError(f"HTTP {status}, not JSON") from None
    if status != 200:
        message = data.get("error", {}).get("message") if isinstance(data, dict) and \
            isinstance(data.get("error"), dict) else None
        raise SlotError(f"HTTP {status}: {str(message)[:160]}" if message else f"HTTP {status}")
    return data


async def slots(http: UpstreamHttp, replica: Replica, timeout_s: float) -> list[SlotInfo]:
    data = await _call(http, replica, "GET", "/slots", timeout_s)
    if not isinstance(data, list):
        raise SlotError("/slots is not a list")
    out = []
    for item in data:
        if not isinstance(item, dict) or _int(item.get("id")) is None:
            continue
        out.append(SlotInfo(id=int(item["id"]), tokens=_int(item.get("n_prompt_tokens")) or 0,
                            busy=item.get("is_processing") is True, task=_int(item.get("id_task")) or 0))
    return out


async def save(http: UpstreamHttp, replica: Replica, slot: int, filename: str, timeout_s: float) -> Done:
    return _done(await _call(http, replica, "POST", f"/slots/{slot}?action=save", timeout_s, {"filename": filename}),
                 "n_saved", "n_written", "save_ms")


async def restore(http: UpstreamHttp, replica: Replica, slot: int, filename: str, timeout_s: float) -> Done:
    return _done(await _call(http, replica, "POST", f"/slots/{slot}?action=restore", timeout_s,
                             {"filename": filename}), "n_restored", "n_read", "restore_ms")


def _done(data: Any, tokens_field: str, bytes_field: str, ms_field: str) -> Done:
    if not isinstance(data, dict):
        raise SlotError("answer is not an object")
    tokens, size = _int(data.get(tokens_field)), _int(data.get(bytes_field))
    timings = data.get("timings")
    ms = timings.get(ms_field) if isinstance(timings, dict) else None
    if tokens is None or size is None:
        raise SlotError(f"answer has no {tokens_field}/{bytes_field}")
    return Done(tokens, size, float(ms) if isinstance(ms, (int, float)) and not isinstance(ms, bool) else 0.0)
