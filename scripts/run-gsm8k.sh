#!/usr/bin/env bash
# Quick start: sets everything up and runs GSM8K on a slice of the test set.
# Usage: scripts/run-gsm8k.sh [N questions, default 100] [more `batchlm run` options]
# Talks to $OPENAI_BASE_URL (default https://api.openai.com/v1) with $OPENAI_API_KEY.
set -euo pipefail
cd "$(dirname "$0")/.."
limit=${1:-100}
shift || true
scripts/build.sh release
scripts/fetch-data.sh
exec build/release/bin/batchlm run jobs/gsm8k.yaml --limit "$limit" "$@"
