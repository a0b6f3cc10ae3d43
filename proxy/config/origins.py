"""Where each key of the settings was set: the file and line of every key of the merged document
(so that a message can say where to look), and the keys a file gives twice in one mapping, which
YAML would otherwise drop without a word. Read from PyYAML's composed nodes."""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

Key = tuple[str, ...]


def json_path(parts: Any) -> str:
    return ".".join(str(p) for p in parts) or "(top level)"


@dataclass(frozen=True)
class Origin:
    """Where a key of the settings was set: its file and (1-based) line."""

    file: Path
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


class Origins:
    """The file and line of every key of the merged settings, so that each message can say where
    to look. A key set in both files as a mapping (a model both define) has both origins; one the
    local file replaces (a value, a list) has only the local one."""

    def __init__(self, by_key: Mapping[Key, tuple[Origin, ...]] | None = None, base: Path | None = None) -> None:
        self.by_key = dict(by_key or {})
        self.base = base
        # Longest first, so a message is placed by the deepest key its path names.
        self._dotted = sorted(((".".join(k), k) for k in self.by_key), key=lambda d: -len(d[0]))

    def where(self, message: str) -> str:
        """`message` (`path: rule`) with the file and line of the deepest key its path names."""
        for dotted, key in self._dotted:
            if message.startswith(dotted) and message[len(dotted):len(dotted) + 1] in (".", ":"):
                return f"{message} ({', '.join(str(o) for o in self.by_key[key])})"
        return message

    def misspelt_model(self, name: str) -> str:
        """For a model id only the local file sets: the closest model id of the base file, which the
        local entry was most likely meant to change ("" when there is none)."""
        origins = self.by_key.get(("engine", "models", name), ())
        if not origins or any(o.file == self.base for o in origins):
            return ""
        base_ids = [k[2] for k, found in self.by_key.items()
                    if len(k) == 3 and k[:2] == ("engine", "models") and any(o.file == self.base for o in found)]
        close = difflib.get_close_matches(name, sorted(base_ids), n=1, cutoff=0.6)
        if not close:
            return ""
        return f"; `{name}` is set only in {origins[0].file}: did you mean `{close[0]}` of {self.base}?"


def key_origins(node: yaml.Node, file: Path, key: Key = (), seen: frozenset[int] = frozenset()
                ) -> Iterator[tuple[Key, Origin]]:
    """Every key (and list item) under `node`, pre-order, with the line it starts on."""
    if id(node) in seen:  # an alias of a node that holds itself
        return
    seen = seen | {id(node)}
    if isinstance(node, yaml.MappingNode):
        items = [(str(k.value), k, v) for k, v in node.value]
    elif isinstance(node, yaml.SequenceNode):
        items = [(str(i), v, v) for i, v in enumerate(node.value)]
    else:
        return
    for name, at, value in items:
        yield key + (name,), Origin(file, at.start_mark.line + 1)
        yield from key_origins(value, file, key + (name,), seen)


def duplicate_keys(node: yaml.Node, file: Path, key: Key = (), seen: frozenset[int] = frozenset()
                   ) -> Iterator[str]:
    """A key given twice in one mapping, with both lines: YAML keeps the last one and drops the
    other without a word. Read from the composed nodes, before a merge key (`<<`) adds its keys,
    which a mapping may override by design."""
    if id(node) in seen:
        return
    seen = seen | {id(node)}
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for k, v in node.value:
            name = str(k.value)
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                line = k.start_mark.line + 1
                if (k.tag, name) in first:
                    yield (f"{json_path(key + (name,))}: set twice in one mapping ({file}:{first[k.tag, name]} "
                           f"and {file}:{line}); YAML keeps only the last, so remove one")
                first.setdefault((k.tag, name), line)
            yield from duplicate_keys(v, file, key + (name,), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from duplicate_keys(item, file, key + (str(i),), seen)


def _value_at(doc: Any, key: Key) -> Any:
    for part in key:
        if isinstance(doc, dict):
            doc = doc[part] if part in doc else next((v for k, v in doc.items() if str(k) == part), None)
        elif isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        else:
            return None
    return doc


def merge_origins(by_key: dict[Key, tuple[Origin, ...]], base_doc: Any, over: list[tuple[Key, Origin]],
                  over_doc: Any) -> None:
    """What deep_merge does to the values, done to their origins (`over` in pre-order)."""
    for key, origin in over:
        if key in by_key:
            if isinstance(_value_at(base_doc, key), dict) and isinstance(_value_at(over_doc, key), dict):
                by_key[key] += (origin,)
                continue
            for old in [k for k in by_key if k[:len(key)] == key]:
                del by_key[old]
        by_key[key] = (origin,)
