"""The browser the status page's tests drive (tests/ui/): the machine's own Chromium.

Playwright's client drives it by path (`executable_path`); Playwright's own browser download is
never used, since a test machine may reach nothing but its package mirrors. `llm-pool setup
--all-engines` installs Debian's `chromium` when none is found and it can (root, apt-get); where it
cannot, it says why and the browser tests skip with the same reason.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Mapping, Sequence

BROWSER_ENV = "LLM_POOL_CHROMIUM"   # a Chromium (or Chrome) to use instead of the one on PATH
NAMES = ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome")
APT_PACKAGE = "chromium"


def find_browser(environ: Mapping[str, str] | None = None,
                 which: Callable[[str], str | None] = shutil.which) -> tuple[Path | None, str]:
    """(the browser's path, "") or (None, why there is none)."""
    env = os.environ if environ is None else environ
    given = env.get(BROWSER_ENV, "").strip()
    if given:
        path = Path(given)
        if path.is_file() and os.access(path, os.X_OK):
            return path, ""
        return None, f"{BROWSER_ENV}={given} is not an executable file"
    for name in NAMES:
        found = which(name)
        if found:
            return Path(found), ""
    return None, (f"no Chromium on PATH ({', '.join(NAMES)}): run `llm-pool setup --all-engines` as root on "
                  f"Debian or Ubuntu (it installs the `{APT_PACKAGE}` package), or set {BROWSER_ENV}")


Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: Sequence[str]) -> "subprocess.CompletedProcess[str]":
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=1800)


def ensure_browser(run: Runner = _run, is_root: bool | None = None,
                   which: Callable[[str], str | None] = shutil.which) -> Path | None:
    """Find a Chromium, or install Debian's with apt-get when this process may (root). Never fails
    the setup: without a browser only the browser tests skip, and this says why."""
    path, why = find_browser(which=which)
    if path is not None:
        print(f"browser: {path}")
        return path
    root = os.geteuid() == 0 if is_root is None else is_root
    if not root or which("apt-get") is None:
        print(f"browser: none, and it cannot be installed here ({'not root' if not root else 'no apt-get'}); "
              f"the status page's browser tests will skip: {why}")
        return None
    print(f"browser: installing Debian's {APT_PACKAGE} with apt-get", flush=True)
    done = run(["apt-get", "install", "-y", "-q", APT_PACKAGE])
    if done.returncode != 0:
        # The package lists may be missing or stale (a fresh container): read them once, try again.
        run(["apt-get", "update", "-q"])
        done = run(["apt-get", "install", "-y", "-q", APT_PACKAGE])
    path, why = find_browser(which=which)
    if path is None:
        tail = (done.stderr or done.stdout or "").strip()[-800:]
        print(f"browser: apt-get install {APT_PACKAGE} failed (exit {done.returncode}); the browser tests will "
              f"skip.\n{tail}")
        return None
    print(f"browser: {path}")
    return path
