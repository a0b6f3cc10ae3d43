"""Counters that go on across a reload: a Prometheus counter never goes down, or `rate()` reads a
reset.

A reload's successor counts from zero, so its predecessor hands over what it had counted: a
snapshot of every counter, histogram and summary sample it exposes (`snapshot`), once as it hands
over and once more as it exits (proxy/serving/reload.py). The successor exposes each sample as its
own value plus the predecessor's for the same name and labels (`CarriedCounters`, a collector over
the app's registry: prometheus_client's public collector API, nothing of its internals), and keeps
exposing the series it did not count itself. A `_created` sample keeps the earliest time. The
predecessor's last snapshot raises what its first gave: both are totals.

Two counter families are continued by the pool itself instead (`SEEDED`): the admin view shows each
model's loads and unloads too, so the successor's runtimes start from the handed-over counts.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric, Sample

from proxy.lifecycle.state.runtime import ModelRuntime

CARRIED_TYPES = frozenset({"counter", "histogram", "summary"})
# Samples whose values add up across processes; `_created` is a time, every other sample is a gauge's.
ADDED_SUFFIXES = ("_total", "_bucket", "_count", "_sum")
CREATED_SUFFIX = "_created"
LOADS, UNLOADS = "llm_pool_model_loads", "llm_pool_model_unloads"
SEEDED = frozenset({LOADS, UNLOADS})
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Family:
    """One metric family of a snapshot: its samples by name and labels."""

    type: str
    help: str
    samples: dict[Key, float] = field(default_factory=dict)


def snapshot(metrics: Iterator[Metric]) -> list[dict[str, Any]]:
    """The counters, histograms and summaries among `metrics`, as JSON for the successor."""
    return [{"name": m.name, "type": m.type, "help": m.documentation,
             "samples": [[s.name, s.labels, s.value] for s in m.samples]}
            for m in metrics if m.type in CARRIED_TYPES]


def parse(data: Any) -> dict[str, Family]:
    """A snapshot from a reload's predecessor (`snapshot`), checked: what is not a family of a
    carried type, a sample name, string labels and a finite number, is left out."""
    families: dict[str, Family] = {}
    if not isinstance(data, list):
        return families
    for item in data:
        if not isinstance(item, dict) or item.get("type") not in CARRIED_TYPES:
            continue
        name, help_ = item.get("name"), item.get("help")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or not isinstance(help_, str) \
                or not isinstance(item.get("samples"), list):
            continue
        family = families.setdefault(name, Family(item["type"], help_))
        for sample in item["samples"]:
            if not (isinstance(sample, list) and len(sample) == 3):
                continue
            sample_name, labels, value = sample
            if isinstance(sample_name, str) and sample_name.startswith(name) and _NAME.fullmatch(sample_name) \
                    and isinstance(labels, dict) and all(isinstance(k, str) and _NAME.fullmatch(k) and
                                                         isinstance(v, str) for k, v in labels.items()) \
                    and type(value) in (int, float) and math.isfinite(value):
                family.samples[_key(sample_name, labels)] = float(value)
    return families


class CarriedCounters:
    """A collector: `source`'s metrics, each counter sample plus what a reload's predecessor had
    counted (`carry`). Registered alone in the registry /metrics exposes."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source
        self._base: dict[str, Family] = {}

    def carry(self, families: Mapping[str, Family]) -> None:
        """The predecessor's counters. Each snapshot is a total, so a later one raises what an earlier
        one gave, and never lowers it: a series the predecessor no longer shows as it exits (its
        replicas let go, say) keeps the value it had."""
        for name, family in families.items():
            if name in SEEDED:
                continue
            kept = self._base.get(name)
            if kept is None or kept.type != family.type:
                self._base[name] = kept = Family(family.type, family.help)
            for key, value in family.samples.items():
                before = kept.samples.get(key)
                kept.samples[key] = value if before is None else \
                    min(before, value) if key[0].endswith(CREATED_SUFFIX) else max(before, value)

    def collect(self) -> Iterator[Metric]:
        seen = set()
        for metric in self.source.collect():
            seen.add(metric.name)
            base = self._base.get(metric.name)
            if base is not None and metric.type == base.type:
                metric.samples = _merged(metric.samples, base.samples)
            yield metric
        for name, base in self._base.items():
            if name not in seen:   # a family only the predecessor had (its tenants, gone from the settings, say)
                metric = Metric(name, base.help, base.type)
                metric.samples = [Sample(n, dict(labels), v) for (n, labels), v in base.samples.items()]
                yield metric


def seed(models: Mapping[str, ModelRuntime], families: Mapping[str, Family]) -> None:
    """Add the predecessor's loads and unloads (by model and reason) to the runtimes' counts."""
    for family_name in (LOADS, UNLOADS):
        family = families.get(family_name)
        for (_sample, labels), value in (family.samples.items() if family is not None else ()):
            found = dict(labels)
            runtime = models.get(found.get("model", ""))
            reason = found.get("reason")
            if runtime is not None and reason is not None and value > 0:
                counts = runtime.loads if family_name == LOADS else runtime.unloads
                counts[reason] = counts.get(reason, 0) + int(value)


def _key(name: str, labels: Mapping[str, str]) -> Key:
    return name, tuple(sorted(labels.items()))


def _merged(samples: list[Sample], base: Mapping[Key, float]) -> list[Sample]:
    out, used = [], set()
    for sample in samples:
        key = _key(sample.name, sample.labels)
        before = base.get(key)
        if before is not None:
            used.add(key)
            if sample.name.endswith(ADDED_SUFFIXES):
                sample = sample._replace(value=sample.value + before)
            elif sample.name.endswith(CREATED_SUFFIX):
                sample = sample._replace(value=min(sample.value, before))
        out.append(sample)
    out.extend(Sample(n, dict(labels), v) for (n, labels), v in base.items() if (n, labels) not in used)
    return out
