"""Each model's last use, kept in the state directory (usage.json), so that a restarted proxy that
adopts a model does not count its idle time (idle_unload_s) from zero.

Read once when the placer starts; written by the placer's loop at most every USAGE_SAVE_S while
requests flow, and always when the pool closes.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping

from proxy.atomic_file import write_atomic
from proxy.lifecycle.placement.actions import Clock
from proxy.lifecycle.state.runtime import ModelRuntime

log = logging.getLogger(__name__)

# Usage times are written at most this often while requests flow (and always when the proxy stops).
USAGE_SAVE_S = 5.0


class UsageTimes:
    def __init__(self, path: Path, models: Mapping[str, ModelRuntime], clock: Clock) -> None:
        self.path = path
        self.models = models
        self.clock = clock
        self._saved: dict[str, float] = {}
        self._saved_at = 0.0

    def restore(self) -> None:
        """Each configured model's last use as the last proxy saved it; none when unreadable."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        for name, at in (data.get("last_used") or {}).items() if isinstance(data, dict) else ():
            if name in self.models and isinstance(at, (int, float)):
                self.models[name].admission.last_used = float(at)
        self._saved = {n: rt.last_used for n, rt in self.models.items()}

    def save(self, force: bool = True) -> None:
        """Write the last uses if they changed; unless `force`, not within USAGE_SAVE_S of the last write."""
        usage = {n: rt.last_used for n, rt in self.models.items() if rt.last_used}
        if usage == self._saved or (not force and self.clock.monotonic() - self._saved_at < USAGE_SAVE_S):
            return
        try:
            write_atomic(self.path, json.dumps({"last_used": usage}, sort_keys=True))
        except OSError as exc:
            log.warning("could not write %s: %s", self.path, exc)
            return
        self._saved, self._saved_at = usage, self.clock.monotonic()
