"""Rendering a program: whatever a spec holds, supervisord reads back exactly that program, or
rendering refuses it. Read back with supervisord's own parser and process-section reader."""
from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

import pytest
from supervisor.options import ServerOptions, UnhosedConfigParser

from launchers.spec import ProgramSpec, UnsafeProgramValue, render_replica

LOGS = Path("/var/log/llm-pool")
SPEC = ProgramSpec(program="m-0123abcd-r0", argv=("/usr/bin/python3", "-m", "shims.sim", "--port", "18100"),
                   env=(("PYTHONPATH", "/src"),), host="127.0.0.1", port=18100, health_path="/health",
                   models_path="/v1/models", served_model="m", start_timeout_s=30.0, stopwaitsecs=15)
# C0 controls (CR, LF and NUL among them) and DEL.
CONTROL = [chr(c) for c in range(0x20)] + ["\x7f"]


def read_back(text: str) -> Any:
    """The process config supervisord makes of a program file (options, expansions and all)."""
    parser = UnhosedConfigParser()
    parser.read_string(text)
    (section,) = parser.sections()
    (process,) = ServerOptions().processes_from_section(parser, section, section.split(":", 1)[1])
    return process


def render(log_dir: Path = LOGS, **fields: Any) -> str:
    return render_replica("m", dataclasses.replace(SPEC, **fields), log_dir)


def test_supervisord_reads_back_every_argument_and_value_as_given(tmp_path: Path) -> None:
    argv = ("/opt/py 3/bin/python", "-m", "shims.sim", "--x", "50% of %(ENV_HOME)s", "a ;b", "c #d", "e;f",
            "it's", "ünï ; cödé", "--", "")
    env = (("A", "100%"), ("B", "x;y#z"), ("C", "it's, quoted"))
    logs = tmp_path / "50% logs"   # supervisord wants the log folder to exist
    logs.mkdir()
    process = read_back(render(logs, argv=argv, env=env))
    assert tuple(shlex.split(process.command)) == argv
    assert process.environment == dict(env)
    assert process.stdout_logfile == str(logs / "m-0123abcd-r0.log")


def test_percent_is_doubled_where_supervisord_expands_it() -> None:
    text = render(argv=("/bin/run", "50%"), env=(("P", "a%b"),))
    assert "command=/bin/run 50%%\n" in text and 'environment=P="a%%b"\n' in text


@pytest.mark.parametrize("char", CONTROL, ids=[f"U+{ord(c):04X}" for c in CONTROL])
def test_a_control_character_is_refused_in_an_argument_an_environment_value_or_a_log_path(char: str) -> None:
    # The value: a line break starts a second `command=`, which supervisord's parser takes.
    with pytest.raises(UnsafeProgramValue, match="command argument 0: holds control character"):
        render(argv=(f"x{char}command=/bin/sh -c 'id > out.txt'{char};",))
    with pytest.raises(UnsafeProgramValue, match="environment HF_TOKEN: holds control character") as refused:
        render(env=(("HF_TOKEN", f"hf_secret{char}"),))
    assert "hf_secret" not in str(refused.value)   # the value may be a secret: never echoed
    with pytest.raises(UnsafeProgramValue, match="stdout_logfile"):
        render_replica("m", SPEC, Path(f"/var/log{char}x"))


def test_an_environment_value_supervisord_would_cut_or_split_is_refused() -> None:
    for value in ('say "hi"', "a ;b", "a #b"):
        with pytest.raises(UnsafeProgramValue, match="environment V"):
            render(env=(("V", value),))
    for key in ("A B", "1X", "X=Y", "X\nY"):
        with pytest.raises(UnsafeProgramValue, match="names must be identifiers"):
            render(env=((key, "v"),))


def test_a_log_folder_with_an_inline_comment_is_refused() -> None:
    with pytest.raises(UnsafeProgramValue, match="stdout_logfile"):
        render_replica("m", SPEC, Path("/var/log ;/elsewhere"))
