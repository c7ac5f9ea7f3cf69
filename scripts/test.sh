#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the whole test suite.
# Tests read datasets from BATCHLM_MIRROR (default: ../shared/data next to the checkout); the
# default model is fetched (or copied from the mirror) so the tests against llama.cpp's goldens
# run rather than skip, and so are llama.cpp's vocabulary test files (scripts/fetch-vocabs.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export BATCHLM_MIRROR=${BATCHLM_MIRROR:-$(cd .. && pwd)/shared/data}
scripts/build.sh dev
scripts/fetch-data.sh
scripts/fetch-model.sh
scripts/fetch-vocabs.sh
scripts/setup-python.sh
ctest --preset dev -j2
