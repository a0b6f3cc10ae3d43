"""A program spec (what to run for one replica) and its rendering as a supervisord section.

Rendering is deterministic: the same specs give byte-identical text, because supervisord's
reloadConfig restarts whatever it sees as changed, and because an unchanged file is how a
restarted proxy knows it may adopt a running replica instead of reloading it.
"""
from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Protocol

if TYPE_CHECKING:  # for the Launcher protocol's types only: this module stays a leaf at run time
    from proxy.capabilities import Traits
    from proxy.config.model import ModelConfig

HEADER = "; written by llm-pool: do not edit, it is rewritten on every load"
_META = re.compile(r"^; replica program=(?P<program>\S+) port=(?P<port>\d+)$", re.M)


@dataclass(frozen=True)
class EngineMetrics:
    """The names under which an engine's /metrics reports the gauges replica routing reads."""

    running: str
    waiting: str
    kv_cache: str


@dataclass(frozen=True)
class EngineSleep:
    """How an engine is put to sleep and woken over HTTP (vLLM's sleep mode): POST `sleep_path` to
    move its weights to host RAM and drop its KV cache, POST `wake_path` to bring them back;
    `is_sleeping_path` answers {"is_sleeping": bool}."""

    sleep_path: str
    wake_path: str
    is_sleeping_path: str


@dataclass(frozen=True)
class Adapters:
    """How a request to the replica chooses one of its LoRA adapters (docs/adapters.md).

    llama-server loads every adapter at its start, at a global scale of 0, and takes a per-request
    `lora` list of scales: `scales` holds each adapter's name and scale in the order of its ids. A
    request for an adapter names every adapter, the chosen one at its scale and the others at 0; a
    request for the base names none, so it runs at the global scales (all 0) and, unlike one with
    an explicit list, reuses a slot a restore filled (measured on the pinned build).

    vLLM serves each adapter as a model of its own, under the adapter's public id (so its answers'
    `model` is the id the client asked for): `by_name` maps each name to it; `load_path` and
    `unload_path` change what it holds at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

    scales: tuple[tuple[str, float], ...] = ()
    by_name: tuple[tuple[str, str], ...] = ()     # (name, the model id the server serves it as)
    load_path: str | None = None
    unload_path: str | None = None

    def fields(self, adapter: str | None) -> dict[str, object]:
        """The request fields that choose `adapter` (None: the base model alone)."""
        if adapter is None:
            return {}
        if self.scales:
            return {"lora": [{"id": i, "scale": scale if name == adapter else 0.0}
                             for i, (name, scale) in enumerate(self.scales)]}
        return {"model": self.served_as(adapter)}

    def served_as(self, adapter: str) -> str:
        """The model id the server knows `adapter` by (vLLM's lora_name)."""
        return dict(self.by_name).get(adapter, adapter)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.scales or self.by_name)


@dataclass(frozen=True)
class ProgramSpec:
    """Everything supervisord and the proxy need to run and reach one replica."""

    program: str                 # supervisord program name, unique per replica
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    host: str
    port: int
    health_path: str             # GET this until it answers 200
    models_path: str | None      # GET this to prove the server serves `served_model`
    served_model: str            # the model name the backend expects in requests
    start_timeout_s: float
    stopwaitsecs: int
    metrics: EngineMetrics | None = None   # None: the engine reports no load gauges
    # Sent with every request the proxy makes to the replica (an API key): never rendered, never logged.
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    request_timeout_s: float | None = None  # longest wait for an answer's next bytes; None: no limit
    # The server closes its connection after every streamed answer although it offers keep-alive
    # (the pinned llama-server, measured): the proxy asks for that close, so that no pool reuses it.
    closes_after_streams: bool = False
    # Set when the server was started able to sleep (vllm_sleep_on_evict): an eviction may put it
    # to sleep instead of stopping it (proxy/lifecycle/sleeping.py). Never rendered.
    sleep: EngineSleep | None = None
    adapters: Adapters | None = None   # it serves LoRA adapters: how a request chooses one

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


class Launcher(Protocol):
    """What every backend module in launchers/ provides (each module is one of these)."""

    # Read-only, so that a module's constants (a tuple of three names, say) satisfy them.
    @property
    def TRAITS(self) -> Traits:
        """What the backend can do (proxy/capabilities.py)."""
        ...

    @property
    def LOAD_OVERRIDES(self) -> tuple[str, ...]:
        """The fields a load may override for a while."""
        ...

    @property
    def PORT_FIELD(self) -> str:
        """The field that fixes a replica's port (replica i: that port + i)."""
        ...

    def check(self, model: ModelConfig) -> list[str]:
        """Problems that stop the model from loading (missing files, refused values), by field."""
        ...

    def device(self, model: ModelConfig) -> tuple[str, str]:
        """Where a replica's memory is, "gpu" or "cpu", and the setting that puts it there (for the
        admin view): memory-aware loading counts it against that device's budget."""
        ...

    def option_problems(self, model: ModelConfig) -> list[str]:
        """Values the backend's server would refuse, checked before a load with overrides starts."""
        ...

    def warnings(self, model: ModelConfig) -> list[str]:
        """Settings that load but work against the pool."""
        ...

    def launch(self, model: ModelConfig, replica: int, port: int, stopwaitsecs: int,
               environ: Mapping[str, str]) -> ProgramSpec:
        """The program of replica number `replica` on `port`: pure, so the same input renders the same file."""
        ...


def group_name(model_id: str) -> str:
    """The prefix of a model's program names (each replica's is `<prefix>-r<i>`, a supervisord
    group of its own): safe characters plus a short hash.

    The hash keeps two ids that sanitize alike apart; a model id never reaches a path or a
    shell word unescaped.
    """
    safe = re.sub(r"[^a-z0-9]+", "-", model_id.lower()).strip("-")[:40] or "model"
    digest = hashlib.sha256(model_id.encode()).hexdigest()[:8]
    return f"{safe}-{digest}"


def program_name(model_id: str, replica: int) -> str:
    return f"{group_name(model_id)}-r{replica}"


# What would end a line of a supervisord file or hide part of one: C0 controls (CR, LF, NUL, ...) and
# DEL. A line break in a value starts a new option (a second `command=` wins), so none is rendered.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# supervisord's parser cuts a value at `;` or `#` after whitespace (an inline comment).
_INLINE_COMMENT = re.compile(r"(\s)(?=[;#])")


class UnsafeProgramValue(ValueError):
    """A value that supervisord would not read back as that one value."""


def _one_line(what: str, value: str) -> str:
    """`value`, refused when it holds a control character. `what` names it in the error; the value
    is never echoed, since it may be a secret."""
    found = _CONTROL.search(value)
    if found:
        raise UnsafeProgramValue(f"{what}: holds control character U+{ord(found.group()):04X}; a program's "
                                 "values are one line each")
    return value


def _safe(what: str, value: str) -> str:
    """`value` as an option value: one line, `%` doubled (supervisord expands %(ENV_X)s in them)."""
    return _one_line(what, value).replace("%", "%%")


def _plain(what: str, value: str) -> str:
    """An option value supervisord takes as it is (a path): no inline comment in it either."""
    if _INLINE_COMMENT.search(value):
        raise UnsafeProgramValue(f"{what}: may not hold whitespace before ; or # (supervisord cuts it there)")
    return _safe(what, value)


def _word(index: int, arg: str) -> str:
    # An inline comment cannot be escaped, but a shell word can close its quote and reopen it:
    # `'a '';b'` is `a ;b` to shlex, with a quote between the space and the `;`. shlex.quote puts
    # any word holding whitespace in single quotes, so the `''` always lands inside them.
    return _INLINE_COMMENT.sub(r"\1''", shlex.quote(_safe(f"command argument {index}", arg)))


def _env_value(key: str, value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise UnsafeProgramValue(f"environment {key!r}: names must be identifiers")
    # supervisord splits the option with a non-POSIX shlex, which has no escape for a quote.
    if '"' in value:
        raise UnsafeProgramValue(f"environment {key}: values may not hold double quotes")
    return f'{key}="{_plain(f"environment {key}", value)}"'


def render_program(spec: ProgramSpec, log_dir: Path) -> str:
    lines = [
        f"; replica program={spec.program} port={spec.port}",
        f"[program:{spec.program}]",
        "command=" + " ".join(_word(i, a) for i, a in enumerate(spec.argv)),
        "autostart=false",
        "autorestart=unexpected",
        "startsecs=1",
        "startretries=3",
        "stopsignal=TERM",
        f"stopwaitsecs={spec.stopwaitsecs}",
        "stopasgroup=true",
        "killasgroup=true",
        "redirect_stderr=true",
        # supervisord expands a log file's name twice (as an option, then as a log file name).
        f"stdout_logfile={_plain('stdout_logfile', str(log_dir / (spec.program + '.log'))).replace('%', '%%')}",
        "stdout_logfile_maxbytes=10MB",
        "stdout_logfile_backups=3",
    ]
    if spec.env:
        lines.append("environment=" + ",".join(_env_value(k, v) for k, v in spec.env))
    return "\n".join(lines) + "\n"


def replica_index(model_id: str, name: str) -> int | None:
    """Which replica of `model_id` the program (and group, and file stem) `name` is, or None."""
    prefix = group_name(model_id) + "-r"
    tail = name[len(prefix):] if name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() and str(int(tail)) == tail else None


def render_replica(model_id: str, spec: ProgramSpec, log_dir: Path) -> str:
    """The whole programs/<program>.conf file of one replica: a plain program, which supervisord
    runs as a group of its own, so that adding or removing one replica (live scaling) never
    touches the others. `supervisorctl status` lists them side by side under the model's prefix."""
    return f"{HEADER}\n; model={_one_line('model id', model_id)}\n\n" + render_program(spec, log_dir)


def ports_in_file(text: str) -> dict[str, int]:
    """The port each replica program of an existing program file was given, by program name."""
    return {m["program"]: int(m["port"]) for m in _META.finditer(text)}
