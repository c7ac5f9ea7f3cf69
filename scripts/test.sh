#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the whole test suite.
# Tests read datasets from BATCHLM_MIRROR (default: ../shared/data next to the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
export BATCHLM_MIRROR=${BATCHLM_MIRROR:-$(cd .. && pwd)/shared/data}
scripts/build.sh dev
scripts/fetch-data.sh
ctest --preset dev -j2
