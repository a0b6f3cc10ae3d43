"""Reading an engine's Prometheus text for the few gauges replica routing uses."""
from __future__ import annotations

from launchers.spec import EngineMetrics


def read_gauges(text: str, names: EngineMetrics) -> dict[str, float]:
    """{running, waiting, kv_cache} from /metrics text; a gauge the engine does not report is absent.

    Samples of one name are summed over their labels (an engine may split them per model or engine
    core). A plain scan, because this runs for every replica several times a second.
    """
    wanted = {names.running: "running", names.waiting: "waiting", names.kv_cache: "kv_cache"}
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = line.find("{")
        name = line[:end] if end >= 0 else line.split(" ", 1)[0]
        field = wanted.get(name)
        if field is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        found[field] = found.get(field, 0.0) + value
    return found
