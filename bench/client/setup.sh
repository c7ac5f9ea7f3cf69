#!/usr/bin/env bash
# Creates bench/.venv with the Python peer of the client benchmark: the official `openai`
# package at a pinned version. Idempotent: a venv that already has that version is left alone.
# Usage: bench/client/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

OPENAI_VERSION=3.52.0   # the version the figures in bench/README.md were measured with
venv=.venv

if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("openai"))' 2>/dev/null || true)
if [[ "$have" != "$OPENAI_VERSION" ]]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION"
fi
"$venv/bin/python" - <<'EOF'
import importlib.metadata as m, sys
print("bench/.venv: python %s, openai %s, httpx %s" % (
    sys.version.split()[0], m.version("openai"), m.version("httpx")))
EOF
