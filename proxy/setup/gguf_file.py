"""Writing a tiny generated GGUF in one piece: the tests' models are written to a temporary file
beside their path and moved onto it once whole, so a half-written model never loads (a test run
killed midway, two runs writing at once)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def gguf_writer(path: Path, architecture: str) -> Iterator[Any]:
    """A `gguf.GGUFWriter` for `architecture` to fill with keys and tensors; when the block ends
    the file is written and becomes `path`."""
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    writer = GGUFWriter(str(tmp), architecture)
    try:
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    tmp.replace(path)
