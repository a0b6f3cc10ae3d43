#!/bin/sh
# The status page's screenshots in docs/operating.md (docs/status-page.png, docs/status-page-host-down.png):
# ten simulated models on this machine and a node, an eviction, a crash, an admin unload, then the
# node's supervisord killed. Needs Chromium (`llm-pool setup --all-engines`) and the test extras.
set -eu
cd "$(dirname "$0")/.."
LLM_POOL_ARTIFACTS="$PWD/docs" .venv/bin/python -m pytest -q -p no:cacheprovider tests/ui/test_status_page_overview.py "$@"
