"""One module per backend: a pure function from a model's config to a ProgramSpec."""
from __future__ import annotations

from types import ModuleType

from launchers import ct2, exllamav3, llama_cpp, llama_server, sim

# Backends whose replicas run as supervisord programs. A backend in the schema but not here is
# configurable (so existing settings files load) but cannot be loaded by this version.
LAUNCHERS: dict[str, ModuleType] = {
    "llama_server": llama_server,
    "sim": sim,
    "ct2": ct2,
    "llama_cpp": llama_cpp,
    "exllamav3": exllamav3,
}


def launcher_for(backend: str) -> ModuleType | None:
    return LAUNCHERS.get(backend)
