#!/usr/bin/env bash
# Installs what is missing, then configures and builds one preset (default: release).
# Usage: scripts/build.sh [dev|release|asan|tsan] [targets...]   (default: everything)
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
shift || true
scripts/install-deps.sh
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake --preset "$preset" "${launcher[@]}" >/dev/null
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build --preset "$preset" "${targets[@]}"
