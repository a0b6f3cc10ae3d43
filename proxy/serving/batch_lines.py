"""A batch file's lines, checked as the live routes check a request (docs/batches.md): each line
OpenAI's `{"custom_id", "method", "url", "body"}`, its body one strict JSON object with the fields
its route cannot do without. A file is checked whole when it is uploaded, so that a batch never
starts on lines that could only fail; a mistake is a 400 naming the line."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proxy.edge.anthropic import MESSAGES_PATH
from proxy.edge.strict_json import decode
from proxy.errors import BadRequest, PoolError
from proxy.serving.body import REQUIRED, requested_model

# The routes a batch may run (OpenAI's, and Anthropic's Messages and the Responses API of this pool).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", MESSAGES_PATH, "/v1/responses")
# What the routes that REQUIRED does not hold cannot do without.
MORE_REQUIRED = {MESSAGES_PATH: (("messages", list, "an array of messages"), ("max_tokens", int, "an integer")),
                 "/v1/responses": (("input", (str, list), "a string or an array"),)}
LINE_FIELDS = ("custom_id", "method", "url", "body")
MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class Line:
    custom_id: str
    url: str
    model: str
    body: str   # the body's JSON, as the line held it re-encoded compactly


def parse(data: bytes, max_lines: int) -> list[Line]:
    """Every line of a batch file, or a 400 `invalid_batch_file` naming the first wrong one."""
    if not data.strip():
        raise _wrong(None, "the file holds no line")
    rows = data.split(b"\n")
    if rows[-1].strip() == b"":
        rows.pop()   # the newline that ends the last line
    if len(rows) > max_lines:
        raise _wrong(None, f"the file has {len(rows)} lines; a batch holds at most {max_lines} "
                     "(engine.batches.max_lines)")
    seen: set[str] = set()
    lines = []
    for number, row in enumerate(rows, 1):
        line = _line(number, row.rstrip(b"\r"))
        if line.custom_id in seen:
            raise _wrong(number, f"custom_id {line.custom_id[:64]!r} is on an earlier line too; each must be unique")
        seen.add(line.custom_id)
        lines.append(line)
    return lines


def _line(number: int, row: bytes) -> Line:
    if not row.strip():
        raise _wrong(number, "the line is empty")
    try:
        doc = decode(row)
    except PoolError as exc:
        raise _wrong(number, exc.message.replace("request body", "the line")) from None
    unknown = sorted(set(doc) - set(LINE_FIELDS))
    if unknown:
        raise _wrong(number, f"unknown field(s) {unknown}; a line holds {', '.join(LINE_FIELDS)}")
    custom_id, method, url, body = (doc.get(k) for k in LINE_FIELDS)
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise _wrong(number, f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters")
    if method != "POST":
        raise _wrong(number, "method must be POST")
    if url not in ENDPOINTS:
        raise _wrong(number, f"url must be one of {', '.join(ENDPOINTS)}")
    if not isinstance(body, dict):
        raise _wrong(number, "body must be a JSON object (the request the url takes)")
    try:
        model = requested_model(body)
    except PoolError as exc:
        raise _wrong(number, exc.message.replace("`", "body.", 1).replace("`", "", 1)) from None
    if body.get("stream") not in (None, False):
        raise _wrong(number, "body.stream must be false: a batch's answers are kept whole")
    for field, types, what in _required(url):
        if not isinstance(body.get(field), types) or isinstance(body.get(field), bool):
            raise _wrong(number, f"body.{field} is required for {url} and must be {what}")
    return Line(custom_id, url, model, json.dumps(body, ensure_ascii=False, separators=(",", ":")))


def _required(url: str) -> list[tuple[str, Any, str]]:
    return [(field, types, what) for field, types, what, _item in REQUIRED.get(url, ())] + \
        list(MORE_REQUIRED.get(url, ()))


def _wrong(number: int | None, message: str) -> BadRequest:
    where = f"line {number}: " if number is not None else ""
    return BadRequest(f"batch file: {where}{message}", code="invalid_batch_file",
                      param=f"line {number}" if number is not None else "file")
