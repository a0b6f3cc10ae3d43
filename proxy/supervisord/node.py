"""llm-pool's supervisord plugin: what makes a host's supervisord a node of the pool.

supervisord loads it from its config (`llm-pool node` writes the section):

    [rpcinterface:llm_pool]
    supervisor.rpcinterface_factory = proxy.supervisord.node:make_rpcinterface
    programs_dir = /var/lib/llm-pool-node/programs
    log_dir = /var/lib/llm-pool-node/logs

and then answers `llm_pool.*` over XML-RPC beside supervisord's own `supervisor.*`: it writes and
removes llm-pool's program files in its programs folder and adds or removes their groups (what the
proxy does through the filesystem on its own machine), reports the host's devices, and measures
what each replica's process tree takes. Starting, stopping and reading processes stay supervisord's
own calls.

The plugin is an attack surface, bounded so:
- It is reached only through supervisord's own HTTP server, so only with its username and
  password (`llm-pool node` refuses to run without a password). Whoever has them can run programs
  as the node's user: that is what a node is for, and why its port belongs on a private network.
- It writes only files named for llm-pool programs (`<safe model prefix>-<8 hex>-r<N>.conf`, the
  shape of launchers.spec.program_name), only directly in its programs folder, at most
  MAX_PROGRAM_BYTES each, and only text that is exactly one `[program:<that name>]` section with
  the options llm-pool renders (no `user=`, no `directory=`, no `[include]`, no other section), whose
  log files lie in its log folder as supervisord reads them (its parser, inline comments and
  expansions included). It writes them readable by its own user only (they may hold API keys). It
  removes only such files, and only once their group has stopped.
- It reads nothing but its own folder, /proc and NVML, and returns numbers, never file contents
  other than its own program files.
"""
from __future__ import annotations

import configparser
import re
import socket
from pathlib import Path
from typing import Any

from supervisor.options import UnhosedConfigParser
from supervisor.rpcinterface import SupervisorNamespaceRPCInterface
from supervisor.xmlrpc import Faults, RPCError

from proxy.atomic_file import PRIVATE_MODE, write_atomic
from proxy.gpu.footprint import tree_cpu_bytes, tree_gpu_bytes
from proxy.gpu.report import load_nvml, read_gpus
from proxy.supervisord.orphans import PidRecord
from proxy.supervisord.supervisor import ProcessInfo

API_VERSION = 1
# launchers.spec.program_name: a sanitized model prefix (<= 40 characters), 8 hex digits of its
# hash, and the replica number.
PROGRAM_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}-[0-9a-f]{8}-r[0-9]{1,4}$")
MAX_PROGRAM_BYTES = 64 * 1024
# The options launchers.spec.render_program writes; anything else is refused.
ALLOWED_OPTIONS = frozenset({
    "command", "autostart", "autorestart", "startsecs", "startretries", "stopsignal", "stopwaitsecs",
    "stopasgroup", "killasgroup", "redirect_stderr", "stdout_logfile", "stdout_logfile_maxbytes",
    "stdout_logfile_backups", "environment"})


class NodeRPCInterface:
    """The `llm_pool` namespace of a node's supervisord."""

    def __init__(self, supervisord: Any, programs_dir: str, log_dir: str, state_dir: str) -> None:
        self.supervisord = supervisord
        self.programs_dir = Path(programs_dir).resolve()
        self.log_dir = Path(log_dir).resolve()
        self.main = SupervisorNamespaceRPCInterface(supervisord)
        # What a supervisord killed with -9 leaves running, stopped by `llm-pool node` before the next
        # one starts (proxy/supervisord/orphans.py), as managed mode does on the proxy's machine.
        self.pid_record = PidRecord(Path(state_dir))

    # -- reading -------------------------------------------------------------------------------

    def getInfo(self) -> dict[str, Any]:
        """The node's API version, host name and folders (the proxy renders log paths into them)."""
        return {"api_version": API_VERSION, "hostname": socket.gethostname(),
                "programs_dir": str(self.programs_dir), "log_dir": str(self.log_dir)}

    def listPrograms(self) -> dict[str, str]:
        """Every llm-pool program file in the programs folder: its text by program name."""
        out = {}
        for path in sorted(self.programs_dir.glob("*.conf")):
            if PROGRAM_NAME.match(path.stem):
                out[path.stem] = path.read_text(encoding="utf-8")
        return out

    def getProcesses(self) -> list[dict[str, Any]]:
        """supervisord's getAllProcessInfo, with the processes recorded for `llm-pool node` to stop
        should this supervisord die and leave them running."""
        infos = self.main.getAllProcessInfo()
        self.pid_record.update(ProcessInfo.from_rpc(i) for i in infos)
        return list(infos)

    def getDevices(self) -> dict[str, Any]:
        """The host's memory: CPU (total and available, from /proc/meminfo) and each GPU (NVML).
        Bytes are sent as doubles: XML-RPC integers stop at 2 GiB."""
        meminfo = _meminfo()
        gpus: list[dict[str, Any]] = []
        reason = ""
        try:
            nvml = load_nvml()
            nvml.nvmlInit()
        except Exception as exc:   # ImportError or NVMLError: no GPU information here
            reason = f"NVML unavailable: {type(exc).__name__}: {exc}"
        else:
            try:
                gpus = [{"index": g.index, "name": g.name, "total_bytes": float(g.total_bytes),
                         "used_bytes": float(g.used_bytes)} for g in read_gpus(nvml)]
            except Exception as exc:
                reason = f"NVML failed: {type(exc).__name__}: {exc}"
            finally:
                nvml.nvmlShutdown()
        return {"cpu": {"total_bytes": float(meminfo.get("MemTotal", 0)),
                        "available_bytes": float(meminfo.get("MemAvailable", 0))},
                "gpus": gpus, "gpu_reason": reason}

    def getFootprint(self, name: str) -> dict[str, float]:
        """What program `name`'s process tree takes now, in bytes per device ("cpu" for its resident
        memory as proxy/gpu/footprint.py counts it, "gpu<i>" per GPU); {} when it does not run."""
        _check_name(name)
        pid = self._pid(name)
        if not pid:
            return {}
        out: dict[str, float] = {}
        gpu = tree_gpu_bytes(pid, load_nvml)
        if gpu:
            out.update({d: float(b) for d, b in gpu.items()})
        held = tree_cpu_bytes(pid)
        if held:
            out["cpu"] = float(held)
        return out

    # -- writing -------------------------------------------------------------------------------

    def writeProgram(self, name: str, text: str) -> bool:
        """Write programs/<name>.conf and add its group (stopped: autostart is false). A group of that
        name must not be active: the proxy stops and removes an old one first."""
        _check_name(name)
        self._check_text(name, text)
        if name in self.supervisord.process_groups:
            raise RPCError(Faults.ALREADY_ADDED, f"{name}: remove its group before writing it again")
        path = self._path(name)
        self.programs_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, mode=PRIVATE_MODE)
        self._reread()
        for config in self.supervisord.options.process_group_configs:
            if config.name == name:
                self.supervisord.add_process_group(config)
                return True
        path.unlink(missing_ok=True)
        self._reread()
        raise RPCError(Faults.INCORRECT_PARAMETERS, f"{name}: supervisord found no program in the file")

    def removeProgram(self, name: str) -> bool:
        """Remove program `name`'s group (its process must have stopped) and its file. True when
        there was either."""
        _check_name(name)
        found = False
        if name in self.supervisord.process_groups:
            if not self.supervisord.remove_process_group(name):
                raise RPCError(Faults.STILL_RUNNING, name)
            found = True
        path = self._path(name)
        if path.exists():
            path.unlink()
            found = True
            self._reread()
        return found

    # -- helpers -------------------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        path = (self.programs_dir / f"{name}.conf").resolve()
        if path.parent != self.programs_dir:   # the name rule already forbids it; never trust one check
            raise RPCError(Faults.BAD_NAME, f"{name}: outside the programs folder")
        return path

    def _pid(self, name: str) -> int:
        group = self.supervisord.process_groups.get(name)
        process = group.processes.get(name) if group is not None else None
        return int(process.pid) if process is not None and process.pid else 0

    def _reread(self) -> None:
        try:
            self.supervisord.options.process_config(do_usage=False)
        except ValueError as exc:
            raise RPCError(Faults.CANT_REREAD, str(exc)) from None

    def _check_text(self, name: str, text: str) -> None:
        if not isinstance(text, str) or len(text.encode("utf-8")) > MAX_PROGRAM_BYTES:
            raise RPCError(Faults.INCORRECT_PARAMETERS, f"{name}: a program file is text of at most "
                                                        f"{MAX_PROGRAM_BYTES} bytes")
        section = f"program:{name}"
        # supervisord's own parser, so that the text is read as supervisord will read it (an inline
        # `;` comment ends a value); strict besides: an option given twice, of which supervisord
        # would take the last, is refused.
        parser = UnhosedConfigParser(strict=True)
        try:
            parser.read_string(text)
        except configparser.Error as exc:
            raise RPCError(Faults.INCORRECT_PARAMETERS, f"{name}: not a supervisord section: "
                                                        f"{type(exc).__name__}") from None
        if parser.sections() != [section]:
            raise RPCError(Faults.INCORRECT_PARAMETERS, f"{name}: the file must hold exactly one section, "
                                                        f"[{section}]")
        extra = sorted(set(parser.options(section)) - ALLOWED_OPTIONS)
        if extra:
            raise RPCError(Faults.INCORRECT_PARAMETERS, f"{name}: options not allowed: {', '.join(extra)}")
        # The values supervisord will use: its expansions (%(here)s, %(ENV_X)s, %%) and log file names.
        parser.expansions = self.supervisord.options.environ_expansions
        parser.expand_here(str(self.programs_dir))
        try:
            processes = self.supervisord.options.processes_from_section(parser, section, name)
        except ValueError as exc:
            raise RPCError(Faults.INCORRECT_PARAMETERS, f"{name}: {exc}") from None
        for process in processes:
            if process.directory is not None:
                raise RPCError(Faults.INCORRECT_PARAMETERS, f"{name}: no directory may be set")
            for option in ("stdout_logfile", "stderr_logfile"):
                # None: no file (or stderr into stdout's); Automatic: supervisord's own childlogdir.
                where = getattr(process, option)
                if isinstance(where, str) and Path(where).resolve().parent != self.log_dir:
                    raise RPCError(Faults.INCORRECT_PARAMETERS, f"{name}: {option} must be in {self.log_dir}")


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not PROGRAM_NAME.match(name):
        raise RPCError(Faults.BAD_NAME, f"{name!r} is not an llm-pool program name")


def _meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def make_rpcinterface(supervisord: Any, **config: str) -> NodeRPCInterface:
    """supervisord's factory: the section's `programs_dir`, `log_dir` and `state_dir` keys are required."""
    missing = [k for k in ("programs_dir", "log_dir", "state_dir") if not config.get(k)]
    if missing:
        raise ValueError(f"[rpcinterface:llm_pool] needs {', '.join(missing)}")
    return NodeRPCInterface(supervisord, config["programs_dir"], config["log_dir"], config["state_dir"])
