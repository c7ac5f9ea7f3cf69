#!/usr/bin/env bash
# Creates or updates .venv at the repository root with the Python packages the tests use: the
# official `openai` client, which the server tests drive `batchlm serve` with, and
# `prometheus_client`, whose parser reads the server's /metrics in the tests.
# Idempotent: a venv that already has the pinned version is left alone.
# Usage: scripts/setup-python.sh   (prints the venv's python path on the last line)
set -euo pipefail
cd "$(dirname "$0")/.."

OPENAI_VERSION=3.52.0
PROMETHEUS_CLIENT_VERSION=0.21.1
venv=.venv

if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
version_of() {
  "$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true
}
if [[ "$(version_of openai)" != "$OPENAI_VERSION" || "$(version_of prometheus_client)" != "$PROMETHEUS_CLIENT_VERSION" ]]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION" \
    "prometheus_client==$PROMETHEUS_CLIENT_VERSION"
fi
echo "$PWD/$venv/bin/python"
