"""What a llama-server binary accepts, read from its own `--help`: its flags and the values of its
enumerated flags.

Builds differ (a value one accepts, another refuses: `--spec-type draft` became `draft-simple`), so a
config value is checked against the binary that will run it. The help text is read once per binary
and kept in the llm-pool cache, keyed by the binary's path, size and modification time, so a rebuilt
binary is read again and an unchanged one never is.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from proxy.atomic_file import write_atomic

HELP_TIMEOUT_S = 30.0
# An option's first line starts at column 0 with its flags; its description continues indented.
_HEAD = re.compile(r"^(-\S.*)$", re.M)
_FLAG = re.compile(r"^--?[A-Za-z0-9][\w-]*$")


class HelpUnavailable(Exception):
    """The binary could not be run to read its --help."""


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    hint: str            # the value hint after the flags ("N", "[on|off|auto]", "none,draft-simple,..."), or ""
    text: str            # the whole help block of the option

    @property
    def nargs(self) -> int:
        """How many command-line items follow the flag: one per word of the hint (`START END` is two),
        a bracketed word counting once (`<tensor name pattern>=<buffer type>,...` is one)."""
        return len(re.findall(r"(?:<[^>]*>|\[[^\]]*\]|\{[^}]*\}|[^\s<\[{])+", self.hint))


def _cache_file(binary: Path, cache_dir: Path) -> Path:
    st = binary.stat()
    key = f"{binary.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return cache_dir / "llama-server-help" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".txt")


def help_text(binary: str | os.PathLike[str], cache_dir: Path) -> str:
    """The binary's `--help`, from the cache when this very binary was read before."""
    path = Path(binary)
    try:
        cached = _cache_file(path, cache_dir)
    except OSError as exc:
        raise HelpUnavailable(f"{binary}: {exc.strerror}") from None
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    try:
        done = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=HELP_TIMEOUT_S,
                              errors="replace")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HelpUnavailable(f"{binary} --help: {exc}") from None
    text = done.stdout + done.stderr
    if "--port" not in text:
        raise HelpUnavailable(f"{binary} --help printed no option list (exit {done.returncode})")
    cached.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cached, text)
    return text


def options(help: str) -> dict[str, Option]:
    """Every option of the help text, by each of its flag names."""
    heads = list(_HEAD.finditer(help))
    found: dict[str, Option] = {}
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(help)
        names: list[str] = []
        rest = head.group(1)
        # "-c,    --ctx-size N   size of ..." : flags are comma-separated, then the hint, then the help.
        while True:
            match = re.match(r"\s*(--?[A-Za-z0-9][\w-]*)(,?)", rest)
            if not match or not _FLAG.match(match.group(1)):
                break
            names.append(match.group(1))
            rest = rest[match.end():]
            if not match.group(2):
                break
        if not names:
            continue
        # The hint follows the last flag after one space; the description starts after two or more
        # (or on the next line), so a flag without a value has no hint.
        hint_match = re.match(r" (\S.*?)(?:\s{2,}|$)", rest)
        hint = hint_match.group(1) if hint_match else ""
        option = Option(flags=tuple(names), hint=hint, text=help[head.start():end])
        for name in names:
            found.setdefault(name, option)
    return found


def choices(option: Option) -> frozenset[str] | None:
    """The values an enumerated option accepts, or None when it takes free values.

    Three shapes occur: `[on|off|auto]`, `{none,mean,cls,last,rank}` and a bare comma list
    (`none,draft-simple,...`); `--reasoning-format` lists its values as `- name:` lines instead.
    """
    hint = option.hint
    if re.fullmatch(r"[\[{][\w.-]+(?:[|,][\w.-]+)+[\]}]", hint) or re.fullmatch(r"[a-z0-9][\w.-]*(?:,[\w.-]+)+", hint):
        return frozenset(v for v in re.split(r"[|,]", hint.strip("[]{}")) if v)
    listed = re.findall(r"^\s+- ([\w-]+):", option.text, re.M)
    if listed:
        default = re.findall(r"\(default: ([\w-]+)\)", option.text)
        return frozenset(listed + default)
    return None
