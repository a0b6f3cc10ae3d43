"""The README and the docs/ pages it leads to, as a new user reads and copies them: the proxy's
address in their examples is the one the shipped settings listen on (unless the docs set another
port themselves), their settings examples pass the schema, every link leads somewhere, and the
README stays a front page: short, with the command CI runs, linking every page."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config.loading import SettingsLoader
from proxy.config.checks import schema_problems
from proxy.config.merge import deep_merge

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = {path: path.read_text() for path in [README, *PAGES]}
# host:port as written in commands, URLs and scrape targets: localhost:8011, http://127.0.0.1:8011/v1,
# "gpu-box:8011". A bare number after a colon elsewhere (a YAML value, a time) has no host before it.
ADDRESS = re.compile(r"(?<![\w.-])(?:localhost|127\.0\.0\.1|0\.0\.0\.0|\[[0-9a-f:]+\]|[a-z][a-z0-9-]*-box):(\d{2,5})\b")
# A port the docs give explicitly (`--port 9000`, `port: 9000`, `admin_port: 9124`) may be used
# in their own examples.
SET_PORT = re.compile(r"(?:--port[ =]|port: *)(\d{2,5})\b")
FENCE = re.compile(r"^ *```.*?^ *```", re.M | re.S)
# A link's target, however its text wraps: [text](target) and ![alt](target).
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
YAML_BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.M | re.S)
# YAML examples of other programs' files, not llm-pool's settings.
FOREIGN_YAML = {"scrape_configs"}
README_MAX_LINES = 300


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose(text: str) -> str:
    """The text without its fenced blocks (a `# comment` in a shell example is no heading)."""
    return FENCE.sub("", text)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercased, punctuation (backticks, colons, slashes) dropped,
    spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    count: dict[str, int] = {}
    for heading in HEADING.findall(prose(text)):
        slug = anchor(heading)
        found.add(f"{slug}-{count[slug]}" if slug in count else slug)   # a repeat gets -1, -2...
        count[slug] = count.get(slug, 0) + 1
    return found


def test_every_proxy_address_in_the_docs_uses_the_default_port() -> None:
    pool = yaml.safe_load((ROOT / "conf" / "pool.yaml").read_text())
    allowed = {pool["service"]["port"]} | {int(p) for text in DOCS.values() for p in SET_PORT.findall(text)}
    found = [(rel(path), text.count("\n", 0, m.start()) + 1, m.group(0))
             for path, text in DOCS.items() for m in ADDRESS.finditer(text)]
    assert any(path == "README.md" for path, _, _ in found), "the pattern no longer finds the quick start's address"
    wrong = [(path, line, text) for path, line, text in found if int(text.rsplit(":", 1)[1]) not in allowed]
    assert wrong == [], f"addresses not on service.port {pool['service']['port']}: {wrong}"


def test_the_readme_is_a_front_page() -> None:
    lines = DOCS[README].count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the reference belongs in docs/"


def test_the_readme_links_every_docs_page() -> None:
    linked = {(ROOT / target.split("#")[0]).resolve() for target in LINK.findall(prose(DOCS[README]))}
    assert PAGES, "docs/ has no pages"
    assert [rel(page) for page in PAGES if page.resolve() not in linked] == []


def test_the_readme_runs_the_test_command_ci_runs() -> None:
    # .ci/run calls the quick start's test command verbatim: the two must not drift apart.
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "-m pytest" in line]
    assert len(ci) == 1, f".ci/run should run the tests once: {ci}"
    assert ci[0] in DOCS[README].splitlines(), "the README's test command is not the one .ci/run runs"


def test_every_relative_link_leads_to_a_file_and_heading() -> None:
    headings = {path.resolve(): anchors(text) for path, text in DOCS.items()}
    broken = []
    for path, text in DOCS.items():
        targets = LINK.findall(prose(text))
        for target in targets:
            if re.match(r"[a-z][a-z0-9+.-]*:", target):    # https:, mailto: ...
                continue
            file, _, fragment = target.partition("#")
            goal = (path.parent / file).resolve() if file else path.resolve()
            if not goal.exists():
                broken.append((rel(path), target, "no such file"))
            elif fragment and fragment not in headings.get(goal, set()):
                broken.append((rel(path), target, "no such heading"))
    assert broken == []


def settings_examples() -> list[Any]:
    """Each ```yaml block of the docs but those of other programs' files (a Prometheus scrape
    config), with where it is as its id."""
    return [pytest.param(m.group(1), id=f"{rel(path)}:{text.count(chr(10), 0, m.start()) + 1}")
            for path, text in DOCS.items() for m in YAML_BLOCK.finditer(text)
            if not set(yaml.safe_load(m.group(1))) & FOREIGN_YAML]


@pytest.mark.parametrize("block", settings_examples())
def test_every_settings_example_passes_the_schema(block: str) -> None:
    # A whole settings document (over the shipped conf/pool.yaml, as conf/local.yaml is) or a few
    # model definitions (as engine.models): each as `check-config --strict` reads it, unknown keys
    # included.
    doc = yaml.load(block, Loader=SettingsLoader)   # as the proxy reads its files: `on` is a word
    schema = json.loads((ROOT / "conf" / "schema.json").read_text())
    if not set(doc) <= set(schema["properties"]):
        assert all(isinstance(model, dict) for model in doc.values()), \
            f"neither settings nor model definitions: {sorted(doc)}"
        doc = {"engine": {"models": doc}}
    pool = yaml.safe_load((ROOT / "conf" / "pool.yaml").read_text())
    assert schema_problems(deep_merge(pool, doc)) == []
