"""Where the repo's own config files are: the schema every settings file is checked against, and
the settings used when none is named. Read as `files.SCHEMA_PATH` by the modules that open them,
so that a test pointing it elsewhere (monkeypatch) is seen by all of them."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
SCHEMA_PATH = REPO_ROOT / "conf" / "schema.json"
DEFAULT_SETTINGS = REPO_ROOT / "conf" / "pool.yaml"
