"""What of a secret may be shown: URLs without their credentials, and a provider's text without any
part of a key long enough to help guess it.

Every URL the proxy shows (an error, a log line, the admin and health views) goes through
`shown_url`; every message a remote provider sends back goes through `masked` before a client or
a log sees it.
"""
from __future__ import annotations

from typing import Iterable

MASK = "***"
# The shortest part of a secret that is masked wherever it appears: a provider that echoes a key's
# prefix (`sk-proj-abc1...`) gives most of what a guess needs. Shorter runs are common text.
MIN_PART = 8


def shown_url(url: str) -> str:
    """`url` without its userinfo: `http://user:pass@host:8080/v1` is `http://host:8080/v1`. The
    authority ends at the first `/`, `?` or `#`, as urllib and aiohttp read it. Query strings are
    left alone: no provider the proxy speaks to takes its key there."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    _, at, host = rest[:end].rpartition("@")
    return f"{scheme}://{host}{rest[end:]}" if at else url


def masked(text: str, secrets: Iterable[str]) -> str:
    """`text` with every run of MIN_PART or more characters of any secret replaced by MASK (runs
    that overlap or touch become one MASK). A secret shorter than MIN_PART is masked only where it
    appears whole: shorter runs of a key are common text. Case-sensitive, as keys are.

    Every run of a secret of MIN_PART or more characters is covered by its MIN_PART-long pieces, so
    finding each piece is enough: a key has a few dozen, and str.find scans a message for one in a
    few microseconds."""
    pieces: set[str] = set()
    whole: set[str] = set()
    for secret in secrets:
        if len(secret) >= MIN_PART:
            pieces.update(secret[i:i + MIN_PART] for i in range(len(secret) - MIN_PART + 1))
        elif secret:
            whole.add(secret)
    text = _mask(text, _found(text, whole))
    while runs := _found(text, pieces):
        # Again on what is left: MASK beside the text around it could make a new run of a secret
        # that holds MASK's character. Each pass shortens the text, so this ends.
        text = _mask(text, runs)
    return text


def _found(text: str, needles: set[str]) -> list[tuple[int, int]]:
    """(start, end) of every occurrence of every needle in `text`, overlapping ones too, sorted."""
    runs = []
    for needle in needles:
        start = text.find(needle)
        while start >= 0:
            runs.append((start, start + len(needle)))
            start = text.find(needle, start + 1)
    return sorted(runs)


def _mask(text: str, runs: list[tuple[int, int]]) -> str:
    """`text` with each of the sorted (start, end) `runs` replaced by MASK, those that overlap or
    touch by one."""
    if not runs:
        return text
    out: list[str] = []
    shown_to = 0      # text[:shown_to] is written out or masked
    for start, end in runs:
        if start > shown_to or not out:
            out += [text[shown_to:start], MASK]
        shown_to = max(shown_to, end)
    out.append(text[shown_to:])
    return "".join(out)
