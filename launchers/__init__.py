"""One module per backend: a pure function from a model's config to a ProgramSpec."""
from __future__ import annotations

from launchers import ct2, exllamav3, llama_cpp, llama_server, sim, vllm_serve
from launchers.spec import Launcher

# Backends whose replicas run as supervisord programs. A backend in the schema but not here is
# configurable (so existing settings files load) but cannot be loaded by this version.
LAUNCHERS: dict[str, Launcher] = {
    "llama_server": llama_server,
    "sim": sim,
    "ct2": ct2,
    "llama_cpp": llama_cpp,
    "exllamav3": exllamav3,
    "vllm_serve": vllm_serve,
    # The seed's in-process vLLM runs as a `vllm serve` process here: same fields, own CUDA stack.
    "vllm": vllm_serve,
}


def launcher_for(backend: str) -> Launcher | None:
    return LAUNCHERS.get(backend)
