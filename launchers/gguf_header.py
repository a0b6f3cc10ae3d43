"""What a GGUF file says about itself, read from its header: whether it is one, and the embedding
pooling its architecture declares.

Only the metadata is read (the key/value table before the tensors), with the standard library: no
`gguf` import in the proxy, and a file that is not a GGUF, or is cut short, answers "unknown".
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

# Every GGUF file starts with these four bytes: enough to tell one from a folder's config file or a
# YAML file given by mistake.
MAGIC = b"GGUF"
# llama.cpp's enum llama_pooling_type, as `<arch>.pooling_type` stores it.
POOLING_NAMES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
# Value types of the key/value table and the size of each fixed-size one.
_STRING, _ARRAY = 8, 9
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UINT32, _INT32 = 4, 5


class _Truncated(Exception):
    pass


def is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _read(f: BinaryIO, size: int) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise _Truncated
    return data


def _u32(f: BinaryIO) -> int:
    return int(struct.unpack("<I", _read(f, 4))[0])


def _u64(f: BinaryIO) -> int:
    return int(struct.unpack("<Q", _read(f, 8))[0])


def _skip(f: BinaryIO, kind: int) -> None:
    if kind in _FIXED:
        f.seek(_FIXED[kind], 1)
    elif kind == _STRING:
        f.seek(_u64(f), 1)
    elif kind == _ARRAY:
        item, count = _u32(f), _u64(f)
        if item in _FIXED:
            f.seek(_FIXED[item] * count, 1)
        else:  # strings (a vocabulary) or nested arrays: one at a time
            for _ in range(count):
                _skip(f, item)
    else:
        raise _Truncated


def declared_pooling(path: Path) -> str | None:
    """The pooling the GGUF's architecture declares (`none`, `mean`, ...), "" when it declares none at
    all, or None when the file cannot be read as a GGUF (missing, another format, cut short)."""
    try:
        with path.open("rb") as f:
            if _read(f, 4) != MAGIC or _u32(f) < 2:   # version 1 had 32-bit counts; llama.cpp reads it no more
                return None
            _u64(f)                                  # tensors
            architecture, pooling = None, {}
            for _ in range(_u64(f)):
                key = _read(f, _u64(f)).decode("utf-8", "replace")
                kind = _u32(f)
                if key == "general.architecture" and kind == _STRING:
                    architecture = _read(f, _u64(f)).decode("utf-8", "replace")
                elif key.endswith(".pooling_type") and kind in (_UINT32, _INT32):
                    pooling[key] = int(struct.unpack("<i" if kind == _INT32 else "<I", _read(f, 4))[0])
                else:
                    _skip(f, kind)
    except (OSError, _Truncated, struct.error):
        return None
    value = pooling.get(f"{architecture}.pooling_type")
    return "" if value is None else POOLING_NAMES.get(value, str(value))
