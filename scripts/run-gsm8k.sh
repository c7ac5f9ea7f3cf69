#!/usr/bin/env bash
# Quick start: sets everything up and runs GSM8K on a slice of the test set, on the embedded
# engine with the default model unless the options name an API (--base-url URL, or
# --backend openai with $OPENAI_API_KEY).
# Usage: scripts/run-gsm8k.sh [N questions, default 20] [more `batchlm run` options]
set -euo pipefail
cd "$(dirname "$0")/.."
limit=${1:-20}
shift || true
scripts/build.sh release batchlm
scripts/fetch-data.sh
scripts/fetch-model.sh
exec build/release/bin/batchlm run jobs/gsm8k.yaml --limit "$limit" "$@"
