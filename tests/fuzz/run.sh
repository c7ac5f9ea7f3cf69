#!/usr/bin/env bash
# Runs one libFuzzer harness of a BATCHLM_FUZZ build for a while, with the limits that turn a
# hang or a memory blowup into a reported failure.
#
#   tests/fuzz/run.sh HARNESS SECONDS [BUILD_DIR] [-- more libFuzzer flags]
#
# The working corpus is BUILD_DIR/fuzz-corpus/HARNESS, started from the committed corpus
# (tests/fuzz/corpus/HARNESS) and, when present, BUILD_DIR/fuzz-seeds/HARNESS (make_seeds.sh).
# A failing input is written to BUILD_DIR/fuzz-artifacts/HARNESS/.
set -euo pipefail
harness=${1:?usage: run.sh HARNESS SECONDS [BUILD_DIR] [-- libFuzzer flags]}
seconds=${2:?usage: run.sh HARNESS SECONDS [BUILD_DIR] [-- libFuzzer flags]}
shift 2
build=build/fuzz
if [ $# -gt 0 ] && [ "$1" != "--" ]; then build=$1; shift; fi
[ "${1:-}" = "--" ] && shift
here=$(cd "$(dirname "$0")" && pwd)
# Absolute: a harness may change directory in its LLVMFuzzerInitialize (job does).
build=$(cd "$build" && pwd)

# Longest input per harness: enough for the real inputs the seeds come from (the smallest
# GGUF model the loader takes is 17 KB), small enough that mutations stay effective and runs
# fast (64 KB inputs ran the gguf harness at 280 inputs/s, 16 KB ones at 700).
case $harness in
  gguf) max_len=20000 ;;
  source | server_request | openai_answer) max_len=8192 ;;
  *) max_len=4096 ;;
esac

work=$build/fuzz-corpus/$harness
artifacts=$build/fuzz-artifacts/$harness
mkdir -p "$work" "$artifacts"
seeds=()
[ -d "$build/fuzz-seeds/$harness" ] && seeds+=("$build/fuzz-seeds/$harness")
dict=()
[ -f "$here/dict/$harness.dict" ] && dict+=("-dict=$here/dict/$harness.dict")

# -rss_limit_mb / -malloc_limit_mb: more than 2 GB resident, or one allocation over 1 GB, is a
# failure ("out-of-memory"); -timeout: one input running 10 s is a failure (a hang).
exec "$build/tests/fuzz/${harness}_fuzz" \
  -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=10 \
  -max_len="$max_len" -use_value_profile=1 -print_final_stats=1 \
  -artifact_prefix="$artifacts/" "${dict[@]}" "$@" \
  "$work" "$here/corpus/$harness" "${seeds[@]}"
