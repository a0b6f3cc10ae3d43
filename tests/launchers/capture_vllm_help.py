"""Capture what the vllm_serve launcher is pinned to, from a real vLLM: re-run when the pin moves.

    python -m tests.launchers.capture_vllm_help [VLLM]

VLLM is a `vllm` command (default: the cached CPU build of proxy/setup/vllm_env.py). Writes
- vllm_serve_help.txt: `vllm serve --help=all`, every flag and its choices;
- vllm_serve_enums.json: the values vLLM's speculative config accepts for `method`, `moe_backend`
  and `attention_backend`, read from that vLLM's own types (they are JSON keys, not flags, so the
  help does not list them).
tests/launchers/test_vllm_serve.py checks every flag and enumerated value the launcher can emit
against these files.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELP = HERE / "vllm_serve_help.txt"
ENUMS = HERE / "vllm_serve_enums.json"

# Runs under the vLLM environment's interpreter: flattens the Literal and Enum types vLLM declares.
_DUMP_ENUMS = r"""
import enum, json, typing
from vllm.config import speculative as s
def flat(t):
    if isinstance(t, str):
        return [t]
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return [m.name for m in t]
    return [v for a in typing.get_args(t) for v in flat(a)]
def field_type(name):
    t = s.SpeculativeConfig.__dataclass_fields__[name].type
    return eval(t, vars(s)) if isinstance(t, str) else t
print(json.dumps({"version": __import__("vllm").__version__,
                  "method": sorted(set(flat(s.SpeculativeMethod))),
                  "moe_backend": sorted(set(flat(field_type("moe_backend")))),
                  "attention_backend": sorted({v.lower() for v in flat(field_type("attention_backend"))})}, indent=1))
"""


def capture(vllm: Path) -> None:
    from proxy.setup.vllm_env import server_env

    env = {**os.environ, **server_env()}
    help_text = subprocess.run([str(vllm), "serve", "--help=all"], env=env, check=True, capture_output=True,
                               text=True, timeout=600).stdout
    HELP.write_text(help_text)
    python = vllm.parent / "python"
    enums = subprocess.run([str(python), "-c", _DUMP_ENUMS], env=env, check=True, capture_output=True, text=True,
                           timeout=600).stdout
    ENUMS.write_text(enums)
    print(f"wrote {HELP} and {ENUMS}")


if __name__ == "__main__":
    from proxy.setup.vllm_env import cached_vllm

    capture(Path(sys.argv[1]) if len(sys.argv) > 1 else cached_vllm())
