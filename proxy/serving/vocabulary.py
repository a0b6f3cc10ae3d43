"""A model's vocabulary size, read from its GGUF file's header: what a token id must be below.

Only the header is read, up to the `tokenizer.ggml.tokens` array's length (what llama.cpp's
`llama_vocab_n_tokens` is), without the `gguf` package (an optional dependency) and without reading
the tokens themselves. Read once per model file, and again only when the file changes.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

from proxy.config.model import ModelConfig

MAGIC = b"GGUF"
TOKENS_KEY = b"tokenizer.ggml.tokens"
# GGUF value types: the size of each fixed-size one; 8 is a string, 9 an array.
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
MAX_KEY_BYTES = 1 << 16      # a metadata key is a short dotted name; past this, not a GGUF to trust
MAX_KEYS = 1 << 20
MAX_NESTING = 4
MAX_VOCAB = 1 << 31          # token ids are int32 in every engine
READ_BUFFER = 1 << 20


class NotGguf(Exception):
    """The file is not a GGUF whose header can be read here."""


def gguf_vocabulary_size(path: Path) -> int | None:
    """The length of the GGUF's `tokenizer.ggml.tokens`, None when the file is not a GGUF (v2 or
    v3) or has none; OSError when it cannot be read."""
    with path.open("rb", buffering=READ_BUFFER) as f:
        try:
            return _read_tokens_count(f)
        except (NotGguf, struct.error):
            return None


def _read_tokens_count(f: BinaryIO) -> int | None:
    head = f.read(24)
    if len(head) < 24 or head[:4] != MAGIC:
        raise NotGguf
    order = "<"
    if struct.unpack("<I", head[4:8])[0] not in (2, 3):
        order = ">"   # a big-endian GGUF
        if struct.unpack(">I", head[4:8])[0] not in (2, 3):
            raise NotGguf
    reader = _Reader(f, order)
    _tensors, keys = struct.unpack(order + "QQ", head[8:24])
    if keys > MAX_KEYS:
        raise NotGguf
    for _ in range(keys):
        key = reader.string(MAX_KEY_BYTES)
        kind = reader.u32()
        if key == TOKENS_KEY:
            if kind != ARRAY:
                return None
            item_kind, count = reader.u32(), reader.u64()
            return count if item_kind == STRING and 0 < count <= MAX_VOCAB else None
        reader.skip(kind, 0)
    return None


class _Reader:
    def __init__(self, f: BinaryIO, order: str) -> None:
        self.f = f
        self.u32_format = struct.Struct(order + "I")
        self.u64_format = struct.Struct(order + "Q")

    def _exactly(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise NotGguf   # the header ends early
        return data

    def u32(self) -> int:
        value: int = self.u32_format.unpack(self._exactly(4))[0]
        return value

    def u64(self) -> int:
        value: int = self.u64_format.unpack(self._exactly(8))[0]
        return value

    def string(self, limit: int) -> bytes:
        n = self.u64()
        if n > limit:
            raise NotGguf
        return self._exactly(n)

    def skip(self, kind: int, depth: int) -> None:
        if kind in FIXED_SIZES:
            self.f.seek(FIXED_SIZES[kind], 1)
        elif kind == STRING:
            self.f.seek(self.u64(), 1)
        elif kind == ARRAY and depth < MAX_NESTING:
            item_kind, count = self.u32(), self.u64()
            if item_kind in FIXED_SIZES:
                self.f.seek(FIXED_SIZES[item_kind] * count, 1)
            else:
                for _ in range(count):
                    self.skip(item_kind, depth + 1)
        else:
            raise NotGguf


class Vocabularies:
    """Each model file's vocabulary size, read once per file (path, size, modification time): a
    stat per look-up, and a header read when the file is new or changed."""

    def __init__(self) -> None:
        self._sizes: dict[Path, tuple[tuple[int, int], int | None]] = {}

    def size(self, model: ModelConfig, field: str) -> int | None:
        """The vocabulary size of the GGUF that `field` of the model names, None where it does not
        name a GGUF this machine can read (a remote model's name, a folder, another host's file)."""
        value = model.get(field)
        if not isinstance(value, str) or not value:
            return None
        path = Path(value)
        try:
            st = path.stat()
            stamp = (st.st_size, st.st_mtime_ns)
            cached = self._sizes.get(path)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            size = gguf_vocabulary_size(path) if path.is_file() else None
        except OSError:
            return None
        self._sizes[path] = (stamp, size)
        return size
