"""The one decode of a request body: UTF-8 JSON, an object, within what the proxy parses without
stalling its event loop; anything else is a 400 `invalid_json` that says why.

A replica gets the client's bytes as they came (proxy/upstream/reach.py), so they must read there
as they read here. `json.loads` on bytes guessed UTF-16 or UTF-32 and took a BOM: an image URL
refused in UTF-8 reached a replica in UTF-16, and the sim answered such bodies 500 and was ejected;
and it takes NaN and Infinity, which are Python's, not JSON's. Size is service.max_body_bytes;
what a parse costs is not size: 32 MiB of `{},` is 11 million objects, and parsing and walking
them held the loop 20 s. Objects and arrays cost ~1 us each and other values a tenth of that
(measured), so both are bounded, counted on the bytes before anything is parsed.
"""
from __future__ import annotations

import codecs
import json
import math
from typing import Any

from proxy.errors import BadRequest

# Deeper bodies are refused before anything walks them (schema checks, re-encoding recurse).
MAX_DEPTH = 128
# Far above what a real request holds (a long conversation with tools: thousands; a batch of 2,048
# token-id prompts of 128 tokens: 262,144 values), far below what stalls: a body at the bounds
# costs about what the bytes of the largest body do (tests/bench/bench_body_stall.py).
MAX_CONTAINERS = 50_000
MAX_VALUES = 500_000
# The exact count keeps quotes and what it counts: a comma or an opening bracket starts a value.
_NOT_COUNTED = bytes(b for b in range(256) if b not in b'",[{')


class _Refused(ValueError):
    """What a parse hook refuses (json.loads lets its hooks' errors through)."""


def decode(raw: bytes) -> dict[str, Any]:
    """The JSON object `raw` holds; BadRequest `invalid_json` naming the problem otherwise."""
    if raw.startswith(codecs.BOM_UTF8):
        raise invalid("request body starts with a byte order mark: send UTF-8 JSON without one")
    if b"\x00" in raw:   # never in UTF-8 JSON text; in every UTF-16 or UTF-32 one
        raise invalid("request body holds NUL bytes (UTF-16 or UTF-32?): send UTF-8 JSON")
    containers = _count(raw)
    try:
        text = raw.decode()   # strict: encoded surrogates and overlong forms are refused too
    except UnicodeDecodeError as exc:
        raise invalid(f"request body is not UTF-8 (at byte {exc.start}): send UTF-8 JSON") from None
    try:
        body = _DECODER.decode(text)
    except RecursionError:
        raise too_deep() from None
    except json.JSONDecodeError as exc:
        raise invalid(f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except _Refused as exc:
        raise invalid(str(exc)) from None
    except ValueError:   # Python's bound on the digits of an integer
        raise invalid("request body holds a number with too many digits") from None
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    # A document cannot be nested deeper than it has brackets: most bodies need no walk at all.
    if containers > MAX_DEPTH and _deeper_than(body, MAX_DEPTH):
        raise too_deep()
    # A pair of escapes is one character once parsed; what is left alone is no UTF-8 text a replica
    # could read back. Only a body that spells such an escape is walked.
    if b"\\" in raw and (b"\\ud" in raw or b"\\uD" in raw) and _lone_surrogate(body):
        raise invalid("request body holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff) in a string")
    return body


def invalid(message: str) -> BadRequest:
    return BadRequest(message, code="invalid_json")


def too_deep() -> BadRequest:
    return invalid(f"request body is nested more than {MAX_DEPTH} levels deep")


def _count(raw: bytes) -> int:
    """How many objects and arrays `raw` holds, or more; BadRequest when over a bound. Counted on
    the bytes, where brackets and commas inside strings (code, prose) count too; counted again
    outside strings when that is over a bound."""
    skeleton = raw.translate(None, _NOT_COUNTED)   # one pass over the bytes; what is left is small
    containers = skeleton.count(b"{") + skeleton.count(b"[")
    values = containers + skeleton.count(b",")
    if containers > MAX_CONTAINERS or values > MAX_VALUES:
        if b"\\" in raw:   # without escaped backslashes and quotes, every quote opens or closes a string
            skeleton = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_COUNTED)
        # Each string is a key or a value, and each key has a value: more than two strings a value
        # is too many values already, and the split below stays bounded.
        if skeleton.count(b'"') > 4 * MAX_VALUES + 2:
            raise _too_many(f"more than {MAX_VALUES} JSON values", MAX_VALUES)
        outside = b"".join(skeleton.split(b'"')[::2])
        values = len(outside)
        containers = values - outside.count(b",")
    if containers > MAX_CONTAINERS:
        raise _too_many(f"{containers} JSON objects and arrays", MAX_CONTAINERS)
    if values > MAX_VALUES:
        raise _too_many(f"{values} JSON values", MAX_VALUES)
    return containers


def _too_many(what: str, bound: int) -> BadRequest:
    return invalid(f"request body holds {what}; at most {bound} are accepted (values: array items and object "
                   "members)")


def _constant(name: str) -> Any:
    raise _Refused(f"request body holds {name}, which is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"request body holds a number out of range: {text[:40]}")
    return value


# Built once: json.loads with hooks builds a decoder per call, which cost more than the parse of a
# small body (measured).
_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_finite)


def _deeper_than(value: Any, limit: int) -> bool:
    """Level by level, so a deep document cannot exhaust the stack while it is measured."""
    level = [value]
    for _ in range(limit):
        level = [child for item in level for child in (item.values() if type(item) is dict else item)
                 if type(child) is dict or type(child) is list]
        if not level:
            return False
    return True


def _lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        strings = [*item, *item.values()] if type(item) is dict else item
        for child in strings:
            if type(child) is str:
                try:
                    child.encode()
                except UnicodeEncodeError:
                    return True
            elif type(child) is dict or type(child) is list:
                stack.append(child)
    return False
