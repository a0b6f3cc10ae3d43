"""`llm-pool ctl usage` and `ctl keys`: the tenants' usage report and keys as text (docs/tenants.md)."""
from __future__ import annotations

import csv
import io
import time
from typing import Any, Sequence

# `estimated`: the rows whose prompt count is the proxy's estimate (a stream cut short before its usage).
SUMS = ("requests", "errors", "prompt_tokens", "cached_tokens", "output_tokens", "cost", "estimated")


def usage_table(rows: Sequence[dict[str, Any]], groups: Sequence[str]) -> str:
    """One line per group: the grouped fields, then the sums."""
    if not rows:
        return "no usage recorded in that time"
    head = [*groups, *SUMS]
    cells = [[_cell(row.get(column)) for column in head] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def usage_csv(rows: Sequence[dict[str, Any]], groups: Sequence[str]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[*groups, *SUMS], extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue().rstrip("\n")


def keys_table(tenants: Sequence[dict[str, Any]]) -> str:
    """Each tenant with its keys by id: configured ones (variables, digests) and minted ones."""
    lines = []
    for t in tenants:
        lines.append(f"{t['name']}  fairness_key={t['fairness_key']}  models={','.join(t['models'])}"
                     f"  allow_remote={str(t['allow_remote']).lower()}")
        ids = t.get("key_env_ids")   # None from a proxy older than this ctl
        for var in t["key_env"]:
            lines.append(_env_key(var, ids))
        for kid in t["key_sha256_ids"]:
            lines.append(f"  key {kid} (key_sha256)")
        for key in t["minted_keys"]:
            state = f"revoked {_when(key['revoked'])}" if key["revoked"] else "live"
            lines.append(f"  key {key['id']} minted {_when(key['created'])}, {state}")
    return "\n".join(lines) if lines else "no tenants"


def _env_key(var: str, ids: dict[str, str | None] | None) -> str:
    if ids is None:
        return f"  key from ${var}"
    if ids.get(var):
        return f"  key {ids[var]} from ${var}"
    return (f"  key from ${var}: none in use (the variable was unset or empty at the start, or holds the admin "
            "token or another tenant's key)")


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(at))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}".rstrip("0").rstrip(".")
    return "" if value is None else str(value)
