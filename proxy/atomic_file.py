"""Files the proxy writes for itself (PID records, footprints, last use, program files,
supervisord.conf, cached help texts): whole or not at all.

Each is written to a temporary name in the same folder, flushed to disk and renamed over the old
one, so a proxy killed at any moment (kill -9, the OOM killer, a full disk) leaves the old file or
the new one, never half of one: a half-written PID record would stop nothing after a crash, a
half-written program file would start a broken replica. The temporary name is unique to the writer,
so two writers (two proxies' help caches, say) cannot rename each other's half file.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The mode of a file that may hold a secret (a program file's environment= has API keys and tokens):
# whatever folder it is in, only its owner reads it.
PRIVATE_MODE = 0o600


def read_back(path: Path) -> Any:
    """What such a file holds, parsed as JSON: None when there is none, and None with a warning
    when it cannot be read or parsed (the proxy then goes on as if it had none)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None


def write_atomic(path: Path, text: str, mode: int | None = None, sync: bool = True) -> None:
    """Replace `path` with `text` (UTF-8) in one step; raises OSError (and leaves no temporary file)
    when it cannot. `mode`: the new file's permissions from its first byte (a file holding a secret
    is never readable by others, even while it is written); else the umask's. `sync=False`: no
    fsync, for a file written on the event loop whose last lines a power loss may take (the events
    journal): the rename still leaves the old file or the new one after a crash of the process."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if sync:
                f.flush()
                # Without it a power loss after the rename can leave an empty file under the new name.
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync:
        _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """The rename itself reaches the disk (best effort: some file systems cannot sync a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
