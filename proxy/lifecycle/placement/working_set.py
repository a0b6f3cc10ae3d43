"""A working set bigger than the budget, said: models that take each other's room in turn.

Each eviction is remembered for `engine.lifecycle.thrash_window_s`. A model loaded again within
that window, evicting another for its room, means that the models in use (it, and the models on
its devices that run, wait or were used within the window) need more than the budget holds: each
swap is a reload, and no order of requests avoids it. That is a `thrash`, with the models, what
they need together and the budget that holds less. Every one is counted (llm_pool_thrash_total);
the event is said once per window for a set of models, not once per swap.

And the plain case: loaded models that hold more than a device's budget (a reload to a smaller
`cpu_budget_mib` that adopted what ran, a charge raised by its first measurement), said when a
device goes over and again only after it was back within its budget.

Pure and synchronous: the placer hands it the picture (rules.ModelView) and the time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from proxy.lifecycle.placement.rules import COUNT, HOLDING, MIB, RESIDENT, Limits, ModelView


@dataclass(frozen=True)
class Thrash:
    """One thrash: `model` was loaded again `after_s` after its eviction, evicting `evicts`; the
    working set `models` needs `needed` on `device` (COUNT: models, against max_loaded_models),
    which holds `budget`."""

    at: float                   # wall-clock time
    model: str
    after_s: float
    evicts: tuple[str, ...]
    models: tuple[str, ...]
    device: str
    needed: int
    budget: int

    def sentence(self, window_s: float) -> str:
        if self.device == COUNT:
            need = f"{self.needed} models loaded together, more than max_loaded_models ({self.budget})"
        else:
            need = (f"{_mib(self.needed)} MiB together on {self.device}, more than its budget of "
                    f"{_mib(self.budget)} MiB (a budget of {_mib(self.needed)} MiB would hold them)")
        return (f"model {self.model} is loaded again {self.after_s:.1f}s after its eviction (thrash_window_s "
                f"{window_s:g}), evicting {', '.join(self.evicts)}: the models in use ({', '.join(self.models)}) "
                f"need {need}; each swap is a reload")

    def as_dict(self, window_s: float) -> dict[str, object]:
        out: dict[str, object] = {"at": round(self.at, 3), "model": self.model, "after_s": round(self.after_s, 1),
                                  "evicts": list(self.evicts), "models": list(self.models), "device": self.device}
        if self.device == COUNT:
            out.update(needed_models=self.needed, max_loaded_models=self.budget)
        else:
            out.update(needed_mib=round(self.needed / MIB, 1), budget_mib=round(self.budget / MIB, 1))
        out["message"] = self.sentence(window_s)
        return out


def in_use(name: str, views: Iterable[ModelView], limits: Limits, now: float,
           window_s: float) -> tuple[tuple[str, ...], str, int, int] | None:
    """The models `name`'s load competes with (it, and the models holding its devices, those it
    evicts among them, that run, wait or were used within `window_s` of `now`), and the limit they exceed
    together: the device most over its budget, else the count cap. None when they fit: what it
    evicts was idle for longer than the window, and evicting it was no loss."""
    views = list(views)
    target = next((v for v in views if v.name == name), None)
    if target is None:
        return None
    devices = set(target.needs)
    members = [v for v in views if v.name == name or
               (v.status in HOLDING and devices & set(v.needs) and (v.busy or now - v.last_used <= window_s))]
    over: list[tuple[int, str, int, int]] = []
    for device in devices:
        budget = limits.budgets.get(device)
        needed = sum(v.needs.get(device, 0) for v in members)
        if budget is not None and needed > budget:
            over.append((needed - budget, device, needed, budget))
    names = tuple(sorted(v.name for v in members))
    if over:
        _, device, needed, budget = max(over)
        return names, device, needed, budget
    counted = [v for v in members if v.counted]
    if limits.max_loaded is not None and len(counted) > limits.max_loaded:
        return tuple(sorted(v.name for v in counted)), COUNT, len(counted), limits.max_loaded
    return None


@dataclass(frozen=True)
class Overrun:
    """Loaded models (`models`) hold `held` on `device`, whose budget is less."""

    device: str
    held: int
    budget: int
    models: tuple[str, ...]

    def sentence(self) -> str:
        return (f"device {self.device} holds {_mib(self.held)} MiB of loaded models ({', '.join(self.models)}), "
                f"{_mib(self.held - self.budget)} MiB more than its budget of {_mib(self.budget)} MiB: the next "
                "load there first evicts until it fits")


class WorkingSet:
    """What the placer knows of the working set: the evictions of the last window, the thrashes
    counted per model and the last of them, and the devices said to be over their budget."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._evicted: dict[str, float] = {}               # model -> when it was last evicted (monotonic)
        self._said: dict[frozenset[str], float] = {}       # set of models -> when its thrash was last said
        self.counts: dict[str, int] = {}                   # thrashes per model loaded again
        self.last: Thrash | None = None                    # the last one counted
        self._last_mono = 0.0
        self.over: dict[str, int] = {}                     # devices over their budget (said), by how much

    def evicted(self, name: str, mono: float) -> None:
        if self.window_s > 0:
            self._evicted[name] = mono

    def swap(self, name: str, evict: Sequence[str], views: Sequence[ModelView], limits: Limits, now: float,
             mono: float) -> Thrash | None:
        """`name` is loaded, evicting `evict`: a thrash when it was evicted itself within the window
        and the models in use do not fit together. Each is counted; returned to be said only when
        it is the first for its set of models in a window."""
        for model, at in list(self._evicted.items()):
            if mono - at > self.window_s:
                del self._evicted[model]
        since = self._evicted.get(name)
        if since is None or not evict:
            return None
        found = in_use(name, views, limits, now, self.window_s)
        if found is None:
            return None
        models, device, needed, budget = found
        thrash = Thrash(now, name, mono - since, tuple(evict), models, device, needed, budget)
        self.counts[name] = self.counts.get(name, 0) + 1
        self.last, self._last_mono = thrash, mono
        key = frozenset(models)
        said = self._said.get(key)
        if said is not None and mono - said <= self.window_s:
            return None
        self._said = {k: t for k, t in self._said.items() if mono - t <= self.window_s}
        self._said[key] = mono
        return thrash

    def recent(self, mono: float) -> Thrash | None:
        """The last thrash, while it is within the window: what the status page warns of."""
        return self.last if self.last is not None and mono - self._last_mono <= self.window_s else None

    def over_budget(self, views: Iterable[ModelView], budgets: Mapping[str, int]) -> list[Overrun]:
        """The devices whose loaded (or asleep) models hold more than their budget, newly: one
        said over stays unsaid until it is back within its budget, and is said again after."""
        held: dict[str, int] = {}
        models: dict[str, list[str]] = {}
        for view in views:
            if view.status in RESIDENT:
                for device, n in view.needs.items():
                    held[device] = held.get(device, 0) + n
                    models.setdefault(device, []).append(view.name)
        now_over = {d: held.get(d, 0) - b for d, b in budgets.items() if held.get(d, 0) > b}
        new = [Overrun(d, held[d], budgets[d], tuple(sorted(models[d]))) for d in sorted(now_over)
               if d not in self.over]
        self.over = now_over
        return new


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"
