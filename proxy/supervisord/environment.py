"""The environment model servers start with: a short list from the proxy's own, never its secrets.

supervisord hands its own environment to every program it starts, and in managed mode the proxy
starts supervisord; so supervisord is started with this environment, and whatever a model needs
beyond it (CUDA_VISIBLE_DEVICES from `gpus`, LD_LIBRARY_PATH with its `*_library_path`, PYTHONPATH
for shims, its own `*_env` settings) is written into its program's `environment=` by its launcher.
"""
from __future__ import annotations

from typing import Mapping

from proxy.config.checks import secret_env_names
from proxy.config.settings import Settings

# Passed through when the proxy has them: what a process needs to find programs and libraries,
# write temporary files and speak the locale; and the GPUs the proxy itself was confined to.
PASSED = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR",
          "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
PASSED_PREFIXES = ("LC_",)


def model_server_environ(settings: Settings, environ: Mapping[str, str]) -> dict[str, str]:
    """The part of `environ` that model servers may see: PASSED, LC_*, and `supervisor.pass_env`,
    less any secret."""
    secrets = secret_env_names(settings)
    wanted = set(PASSED) | set(settings.supervisor.pass_env)
    return {k: v for k, v in environ.items()
            if (k in wanted or k.startswith(PASSED_PREFIXES)) and k not in secrets}
