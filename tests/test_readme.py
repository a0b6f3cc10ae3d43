"""README.md examples that a new user copies: the proxy's address in them is the one the shipped
settings listen on, unless the README itself sets another port."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# host:port as written in commands, URLs and scrape targets: localhost:8011, http://127.0.0.1:8011/v1,
# "gpu-box:8011". A bare number after a colon elsewhere (a YAML value, a time) has no host before it.
ADDRESS = re.compile(r"(?<![\w.-])(?:localhost|127\.0\.0\.1|0\.0\.0\.0|\[[0-9a-f:]+\]|[a-z][a-z0-9-]*-box):(\d{2,5})\b")
# A port the README gives explicitly (`--port 9000`, `port: 9000`, `admin_port: 9124`) may be used
# in its own examples.
SET_PORT = re.compile(r"(?:--port[ =]|port: *)(\d{2,5})\b")


def test_every_proxy_address_in_the_readme_uses_the_default_port() -> None:
    pool = yaml.safe_load((ROOT / "conf" / "pool.yaml").read_text())
    allowed = {pool["service"]["port"]} | {int(p) for p in SET_PORT.findall(README)}
    found = [(README.count("\n", 0, m.start()) + 1, m.group(0)) for m in ADDRESS.finditer(README)]
    assert found, "the pattern no longer finds the quick start's address"
    wrong = [(line, text) for line, text in found if int(text.rsplit(":", 1)[1]) not in allowed]
    assert wrong == [], f"README.md addresses not on service.port {pool['service']['port']}: {wrong}"
