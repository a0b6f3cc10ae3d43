"""The OpenAI Batch API on the pool (docs/batches.md): files (`purpose: batch`) and batches, run
inside the pool by proxy/serving/batch_runner.py at the `batch` priority class. With tenants a
file and a batch are their tenant's: another tenant's is a 404, as one that does not exist."""
from __future__ import annotations

import asyncio
import re
import time
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.batches.store import BatchStore, FileRow, StorageFull, new_id
from proxy.errors import BadRequest, Conflict, NotFound, TooLarge
from proxy.serving.admin_guard import admit
from proxy.serving.batch_lines import ENDPOINTS, Line, parse
from proxy.serving.batch_runner import BatchRunner, runner_of
from proxy.serving.body import model_of, read_json
from proxy.serving.keys import POOL, SETTINGS
from proxy.serving.tenancy import TENANCY

routes = web.RouteTableDef()

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
WINDOWS = {"24h": 24 * 3600}   # OpenAI's one completion window
PURPOSES = ("batch",)
MAX_FILENAME = 255
MAX_PURPOSE_BYTES = 64
MAX_METADATA = 16              # OpenAI's: 16 pairs, keys of 64 characters, values of 512
CHUNK = 64 * 1024


def _owner(request: web.Request) -> str:
    """The tenant the request's key belongs to (401 without one), or "" where there are no tenants."""
    tenancy = request.app.get(TENANCY)
    return tenancy.caller(request).tenant.name if tenancy is not None else ""


def _store(request: web.Request) -> tuple[BatchRunner, BatchStore]:
    runner = runner_of(request.app)
    return runner, runner.store


def _file(request: web.Request, store: BatchStore, owner: str) -> FileRow:
    file_id = request.match_info["file_id"]
    row = store.file(file_id, owner) if FILE_ID.fullmatch(file_id) else None
    if row is None:
        raise NotFound(f"no file {file_id[:64]!r}", code="file_not_found", param="file_id")
    return row


def _batch(request: web.Request, store: BatchStore, owner: str) -> dict[str, Any]:
    batch_id = request.match_info["batch_id"]
    doc = store.batch(batch_id, owner) if BATCH_ID.fullmatch(batch_id) else None
    if doc is None:
        raise NotFound(f"no batch {batch_id[:64]!r}", code="batch_not_found", param="batch_id")
    return doc


# -- files ---------------------------------------------------------------------------------------

@routes.post("/v1/files")
async def create_file(request: web.Request) -> web.Response:
    """multipart/form-data with `purpose` (batch) and `file` (JSONL, checked line by line)."""
    runner, store = _store(request)
    owner = _owner(request)
    settings = request.app[SETTINGS].batches
    if not request.content_type.startswith("multipart/form-data"):
        raise BadRequest("upload a file as multipart/form-data with the fields `purpose` and `file`",
                         code="invalid_file_upload")
    try:
        purpose, filename, data = await _form(request, settings.max_file_bytes)
    except (ValueError, UnicodeDecodeError, HttpProcessingError) as exc:   # no boundary, a part's bad header, ...
        raise BadRequest(f"the upload is no multipart form this pool reads: {str(exc)[:200]}",
                         code="invalid_file_upload") from None
    if purpose is None or data is None:
        raise BadRequest("the upload needs the fields `purpose` and `file`", code="invalid_file_upload",
                         param="file" if data is None else "purpose")
    if purpose not in PURPOSES:
        raise BadRequest(f"purpose {purpose!r} is not kept here: this pool keeps files for the Batch API only "
                         "(purpose `batch`)", code="invalid_purpose", param="purpose")
    await asyncio.to_thread(parse, data, settings.max_lines)
    try:
        row = await asyncio.to_thread(store.add_file, owner, filename, purpose, data)
    except StorageFull as full:
        raise TooLarge(f"the pool's files would take {full.used + full.adding} bytes, over "
                       f"engine.batches.max_storage_bytes ({full.budget}): delete files that are done with "
                       "(DELETE /v1/files/{id})", code="file_storage_full") from None
    return web.json_response(row.as_openai())


@routes.get("/v1/files")
async def list_files(request: web.Request) -> web.Response:
    runner, store = _store(request)
    purpose = request.query.get("purpose")
    rows = store.list_files(_owner(request), purpose)
    return web.json_response({"object": "list", "data": [r.as_openai() for r in rows], "has_more": False})


@routes.get("/v1/files/{file_id}")
async def retrieve_file(request: web.Request) -> web.Response:
    runner, store = _store(request)
    return web.json_response(_file(request, store, _owner(request)).as_openai())


@routes.get("/v1/files/{file_id}/content")
async def file_content(request: web.Request) -> web.StreamResponse:
    runner, store = _store(request)
    row = _file(request, store, _owner(request))
    # Sent from the file (sendfile), not read whole: an output file may be hundreds of megabytes.
    return web.FileResponse(store.path_of(row), headers={"Content-Type": "application/octet-stream"})


@routes.delete("/v1/files/{file_id}")
async def delete_file(request: web.Request) -> web.Response:
    runner, store = _store(request)
    row = _file(request, store, _owner(request))
    await asyncio.to_thread(store.delete_file, row)
    return web.json_response({"id": row.id, "object": "file", "deleted": True})


async def _form(request: web.Request, max_file_bytes: int) -> tuple[str | None, str, bytes | None]:
    """The upload's purpose, the file's name and its bytes (None where the form has no such field)."""
    purpose: str | None = None
    data: bytes | None = None
    filename = "upload.jsonl"
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):   # a nested multipart: no field of ours
            raise ValueError("a nested multipart part is no field of this upload")
        if part.name == "purpose":
            purpose = (await _read_capped(part, MAX_PURPOSE_BYTES)).decode()
        elif part.name == "file":
            filename = _filename(part.filename)
            data = await _read_capped(part, max_file_bytes)
        else:
            await part.release()   # a field OpenAI's API has and this pool does not use (expires_after)
    return purpose, filename, data


async def _read_capped(part: BodyPartReader, limit: int) -> bytes:
    chunks, size = [], 0
    while chunk := await part.read_chunk(CHUNK):
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the file is over engine.batches.max_file_bytes ({limit} bytes)", code="file_too_large",
                           param="file")
        chunks.append(chunk)
    return b"".join(chunks)


def _filename(given: str | None) -> str:
    """What the client called it, for its listing only (never a path here): its last component,
    printable, bounded."""
    name = (given or "upload.jsonl").replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in name if c.isprintable())[:MAX_FILENAME]
    return name or "upload.jsonl"


# -- batches -------------------------------------------------------------------------------------

@routes.post("/v1/batches")
async def create_batch(request: web.Request) -> web.Response:
    runner, store = _store(request)
    owner = _owner(request)
    body = await read_json(request)
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata",
                                  "output_expires_after"})
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}", code="invalid_batch_request", param=unknown[0])
    endpoint, window, metadata = body.get("endpoint"), body.get("completion_window"), body.get("metadata")
    if endpoint not in ENDPOINTS:
        raise BadRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", code="invalid_batch_request",
                         param="endpoint")
    if window not in WINDOWS:
        raise BadRequest(f"completion_window must be one of {', '.join(WINDOWS)}", code="invalid_batch_request",
                         param="completion_window")
    _check_metadata(metadata)
    file_id = body.get("input_file_id")
    row = store.file(file_id, owner) if isinstance(file_id, str) and FILE_ID.fullmatch(file_id) else None
    if row is None or row.purpose != "batch":
        raise NotFound(f"no batch input file {str(file_id)[:64]!r}", code="file_not_found", param="input_file_id")
    lines = await asyncio.to_thread(lambda: parse(store.read(row), request.app[SETTINGS].batches.max_lines))
    model = _one_model(request, lines, endpoint)
    now = int(time.time())
    doc = {"id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
           "input_file_id": row.id, "completion_window": window, "status": "in_progress",
           "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": now,
           "expires_at": now + WINDOWS[window], "finalizing_at": None, "completed_at": None, "failed_at": None,
           "expired_at": None, "cancelling_at": None, "cancelled_at": None,
           "request_counts": {"total": len(lines), "completed": 0, "failed": 0}, "metadata": metadata,
           "model": model}
    await asyncio.to_thread(store.create_batch, owner, doc, model, ((ln.custom_id, ln.body) for ln in lines))
    runner.add(doc, owner, model)
    return web.json_response(doc)


def _one_model(request: web.Request, lines: list[Line], endpoint: str) -> str:
    """The one model every line names (OpenAI's rule), configured and the tenant's to use."""
    for number, line in enumerate(lines, 1):
        if line.url != endpoint:
            raise BadRequest(f"batch file: line {number}: url {line.url} is not the batch's endpoint {endpoint}",
                             code="invalid_batch_file", param=f"line {number}")
        if line.model != lines[0].model:
            raise BadRequest(f"batch file: line {number}: model {line.model[:64]!r} is not line 1's "
                             f"{lines[0].model[:64]!r}; a batch's lines name one model", code="invalid_batch_file",
                             param=f"line {number}")
    model = lines[0].model
    pool = request.app[POOL]
    runtime, _, public = model_of(request, pool, model)   # 404 model_not_found
    tenancy = request.app.get(TENANCY)
    if tenancy is not None:
        tenancy.allow(tenancy.caller(request), runtime, public)   # 403 for a model it may not use
    return model


def _check_metadata(metadata: object) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()):
        raise BadRequest(f"metadata must be an object of at most {MAX_METADATA} string pairs (keys up to 64 "
                         "characters, values up to 512)", code="invalid_batch_request", param="metadata")


@routes.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: web.Request) -> web.Response:
    runner, store = _store(request)
    return web.json_response(_batch(request, store, _owner(request)))


@routes.get("/v1/batches")
async def list_batches(request: web.Request) -> web.Response:
    runner, store = _store(request)
    owner = _owner(request)
    limit = _limit(request.query.get("limit"))
    after = request.query.get("after")
    docs, more = store.list_batches(owner, after if after and BATCH_ID.fullmatch(after) else None, limit)
    return web.json_response({"object": "list", "data": docs, "first_id": docs[0]["id"] if docs else None,
                              "last_id": docs[-1]["id"] if docs else None, "has_more": more})


def _limit(raw: str | None) -> int:
    if raw is None:
        return 20
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise BadRequest("limit must be an integer from 1 to 100", code="invalid_batch_request", param="limit")
    return int(raw)


@routes.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: web.Request) -> web.Response:
    runner, store = _store(request)
    doc = _batch(request, store, _owner(request))
    if doc["status"] in ("cancelling", "cancelled"):
        return web.json_response(doc)
    if doc["status"] != "in_progress":
        raise Conflict(f"batch {doc['id']} is {doc['status']}: only a batch in progress can be cancelled",
                       code="batch_not_cancellable", param="batch_id")
    return web.json_response(runner.cancel(doc))


# -- the admin's view ----------------------------------------------------------------------------

@routes.get("/v1/admin/batches")
async def admin_batches(request: web.Request) -> web.Response:
    """Every tenant's batches (newest first, at most 100), with each one's progress and rate, and
    per model the batch class's queue (`llm-pool ctl batches`, the status page)."""
    admit(request)
    runner, store = _store(request)
    docs, _more = store.list_batches(None, None, 100)
    rows = []
    for doc in docs:
        held = runner.held(doc["id"])
        counts = doc["request_counts"]
        rate = runner.rate(doc["id"])
        rows.append({"id": doc["id"], "owner": store.owner_of(doc["id"]) or None, "model": doc.get("model"),
                     "endpoint": doc["endpoint"], "status": doc["status"], "created_at": doc["created_at"],
                     "total": counts["total"], "completed": counts["completed"], "failed": counts["failed"],
                     "inflight": held.inflight if held is not None else 0,
                     "lines_per_s": round(rate, 2) if rate is not None else None})
    view = runner.describe()
    return web.json_response({"object": "list", "data": rows, "queues": view["queues"],
                              "running": view["claiming"], "storage": {
                                  "used_bytes": store.used_bytes(),
                                  "max_bytes": request.app[SETTINGS].batches.max_storage_bytes}})
