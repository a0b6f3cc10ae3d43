"""`remote_file_mode: files_extract`: the provider's Files API turns each file item into text.

Moonshot's documented file Q&A flow: upload to {base}/files with a purpose (`file-extract`), fetch
{base}/files/{id}/content, and send that content as a system message ahead of the question. Nothing
is parsed here and nothing falls back to another route; every upload is deleted afterwards, also
when the request fails or the client leaves.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
from typing import Any, AsyncIterator
from urllib.parse import quote

import aiohttp

from proxy.errors import BackendError, BadRequest
from proxy.lifecycle.kinds.provider import Provider
from proxy.upstream.client import UpstreamHttp

log = logging.getLogger(__name__)


def _has_file(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(i, dict) and i.get("type") == "file" for i in content)


@contextlib.asynccontextmanager
async def extracted(http: UpstreamHttp, reach: Provider,
                    body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """`body` with each file item replaced by a system message holding the provider's extraction,
    placed just before the message that carried it; the uploads are deleted on leaving."""
    uploaded: list[str] = []
    try:
        messages: list[Any] = []
        for message in body.get("messages") or []:
            if not isinstance(message, dict) or not _has_file(message.get("content")):
                messages.append(message)
                continue
            kept = []
            for item in message["content"]:
                if isinstance(item, dict) and item.get("type") == "file":
                    messages.append({"role": "system", "content": await _extract(http, reach, item, uploaded)})
                else:
                    kept.append(item)
            messages.append({**message, "content": kept or ""})
        yield {**body, "messages": messages}
    finally:
        if uploaded:
            # Shielded: a client that leaves cancels the request, never the clean-up.
            await asyncio.shield(_delete_all(http, reach, uploaded))


async def _extract(http: UpstreamHttp, reach: Provider, item: dict[str, Any],
                   uploaded: list[str]) -> str:
    file = item.get("file")
    if not isinstance(file, dict):
        file = {}
    name = str(file.get("filename") or "upload")
    data_url = file.get("file_data")
    if not isinstance(data_url, str) or not data_url.startswith("data:") or ";base64," not in data_url:
        raise BadRequest("files_extract needs each file item's `file.file_data` as a base64 data URL",
                         code="invalid_file", param="file.file_data")
    head, _, payload = data_url.partition(",")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"file {name!r}: file_data is not valid base64", code="invalid_file",
                         param="file.file_data") from None
    form = aiohttp.FormData()
    form.add_field("purpose", str(reach.file_purpose))
    form.add_field("file", data, filename=name, content_type=head[5:].split(";")[0] or "application/octet-stream")
    timeout = aiohttp.ClientTimeout(total=reach.timeout_s)
    try:
        async with await http.post(reach.url("/v1/files"), data=form, headers=reach.headers(json_body=False),
                                   timeout=timeout) as resp:
            raw = await resp.read()
            if resp.status // 100 != 2:
                raise reach.error(resp.status, raw, resp.headers, f"the upload of {name!r}")
            file_id = str(json.loads(raw)["id"])
        uploaded.append(file_id)
        async with http.get(reach.url(f"/v1/files/{quote(file_id, safe='')}/content"),
                            headers=reach.headers(json_body=False), timeout=timeout) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise reach.error(resp.status, raw, resp.headers, f"the extraction of {name!r}")
            return raw.decode(errors="replace")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise BackendError(f"remote provider of {reach.model!r}: file {name!r} could not be extracted: "
                           f"{type(exc).__name__}") from exc
    except (ValueError, KeyError, TypeError):
        raise BackendError(f"remote provider of {reach.model!r} answered the upload of {name!r} "
                           "without a file id") from None


async def _delete_all(http: UpstreamHttp, reach: Provider, ids: list[str]) -> None:
    for file_id in ids:
        try:
            async with http.delete(reach.url(f"/v1/files/{quote(file_id, safe='')}"),
                                   headers=reach.headers(json_body=False),
                                   timeout=aiohttp.ClientTimeout(total=reach.timeout_s)) as resp:
                if resp.status // 100 != 2:
                    log.warning("remote %s: deleting uploaded file %s answered HTTP %d", reach.model, file_id,
                                resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("remote %s: deleting uploaded file %s failed: %s", reach.model, file_id,
                        type(exc).__name__)
