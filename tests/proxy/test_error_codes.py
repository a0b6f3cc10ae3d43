"""errors.CODES is the published list of the proxy's error codes (GET /openapi.json): every code the
source answers with is in it, and it names none the source never uses."""
from __future__ import annotations

import re
from pathlib import Path

from proxy.errors import CODES

PROXY = Path(__file__).resolve().parents[2] / "proxy"
# code="x" (an error raised), QueueFull("x", ...) (fairness), CODE = "x" / code = "x" (a module's or a class's).
LITERALS = re.compile(r'''(?:\bcode=|QueueFull\(|\bCODE = |^    code = )["']([a-z_]+)["']''', re.MULTILINE)
# Set in a table (errors_http's codes of aiohttp's own errors) or on a backend's refusal (relay).
FROM_ELSEWHERE = {"context_length_exceeded", "method_not_allowed", "http_error"}


def _used() -> set[str]:
    found = set()
    for path in PROXY.rglob("*.py"):
        if path.name == "errors.py":
            continue
        found |= set(LITERALS.findall(path.read_text()))
    errors = (PROXY / "errors.py").read_text().split("CODES: dict")[0]
    return found | set(LITERALS.findall(errors))


def test_every_code_the_source_answers_with_is_catalogued() -> None:
    assert _used() - set(CODES) == set()


def test_the_catalogue_names_no_code_the_source_never_uses() -> None:
    assert set(CODES) - _used() - FROM_ELSEWHERE == set()


def test_the_scan_sees_codes() -> None:
    """The scan above is not vacuous: it finds the codes of each form."""
    used = _used()
    assert {"model_not_loaded", "fairness_key_queue_full", "image_url_not_allowed", "queue_full"} <= used
