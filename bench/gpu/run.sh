#!/usr/bin/env bash
# The GPU checks and benchmarks, in two halves (bench/README.md, "GPU"):
#
#   bench/gpu/run.sh pack            # on the build machine: a Release build with CUDA; the
#                                    # binaries, the shared libraries they need (not the CUDA
#                                    # ones: the GPU machine has those), the GSM8K data and the
#                                    # model, into .gpu-a/ and .gpu-b/ (ignored by git), each
#                                    # small enough for one device call (64 MiB with the tree)
#   bench/gpu/run.sh device checks   # on the GPU machine, with .gpu-a/: GPU tests,
#                                    # compute-sanitizer memcheck, kernel benchmarks, the
#                                    # engine on a random 1B-class model
#   bench/gpu/run.sh device model    # with .gpu-a/, .gpu-b/ and .gpu-c/ where pack made one (a
#                                    # later call may carry .gpu-b/ and .gpu-c/ alone: the
#                                    # machine keeps .gpu/ between calls):
#                                    # the default model on the GPU against the CPU, its decode
#                                    # throughput, GSM8K end to end, the transformers peer
#   bench/gpu/run.sh device all      # both
#
# Stages may also be named one by one: tests (and memcheck, and the executor's unit tests that
# decide between the devices), kernels (gpu_kernels_bench --check alone), k-engine (the
# 1B-class engine in Q4_1 and Q4_K_M-like types), benchmarks, model-test (the
# default model against its exact reference), model-benchmarks (engine, GSM8K, the peer),
# engine (its first part alone), cli (the dry run, refusals and generate on the GPU), profile (per-kernel GPU time of a decode step, with ncu), ab
# (engine_bench of a base build against this one, alternating); 'checks' is tests and benchmarks, 'model' is model-test and
# model-benchmarks.
#
# The GPU machine has the CUDA driver and toolkit, PyTorch and transformers but none of the
# project's build dependencies, so the build happens here and the binaries travel. Logs go to
# $OUT (the device call brings them back); a table of the steps comes last.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${OUT:-/tmp/batchlm-gpu-out}
LIMIT_MIB=64

pack() {
  set -e
  cmake -S . -B build/gpu -DCMAKE_BUILD_TYPE=Release -DBATCHLM_CUDA=ON >/dev/null
  cmake --build build/gpu -j2 --target batchlm matmul_test ops_test gpu_engine_test \
    executor_test architectures_test gpu_kernels_bench engine_bench
  rm -rf .gpu .gpu-a .gpu-b
  mkdir -p .gpu/bin .gpu/lib .gpu/data .gpu/whl .gpu-a .gpu-b
  cp build/gpu/bin/batchlm build/gpu/tests/matmul_test build/gpu/tests/ops_test \
    build/gpu/tests/gpu_engine_test build/gpu/tests/executor_test build/gpu/tests/architectures_test .gpu/bin/
  cp build/gpu/bin/gpu_kernels_bench build/gpu/bin/engine_bench .gpu/bin/
  strip --strip-debug .gpu/bin/*
  # Shared libraries beyond the C and C++ runtimes and CUDA's (libcurl, yaml-cpp, PCRE2, ...).
  for b in .gpu/bin/*; do ldd "$b"; done | awk '/=> \// {print $3}' | sort -u |
    grep -v -E '/(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so' |
    grep -v -E '/lib(cuda|cudart|cublas|cublasLt)\.so' |
    xargs -r -I{} cp -L {} .gpu/lib/
  cp -r "${BATCHLM_DATA:-../shared/data}/gsm8k" .gpu/data/
  # transformers reads GGUF through the gguf package, which the GPU machine's image lacks.
  python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl gguf
  # One xz stream with a 64 MiB dictionary: the binaries share their CUDA code, which it then
  # stores once (24 MiB at -6 with two threads, 12 MiB so).
  tar -C .gpu -cf - bin lib data whl | xz -T1 -9 >.gpu-a/bundle.tar.xz
  rm -rf .gpu
  [ -f "$MODEL" ] || scripts/fetch-model.sh
  # The model goes in parts: what fits beside the tree and the bundle, then the rest in .gpu-b
  # (and .gpu-c when it does not fit there either).
  local tree_kib bundle_kib first_kib part_kib
  tree_kib=$(git ls-files -z | du -ck --files0-from=- | tail -1 | cut -f1)
  bundle_kib=$(du -k .gpu-a/bundle.tar.xz | cut -f1)
  first_kib=$((LIMIT_MIB * 1024 - tree_kib - bundle_kib - 2048))
  part_kib=$((LIMIT_MIB * 1024 - tree_kib - 2048))
  rm -rf .gpu-c
  head -c $((first_kib * 1024)) "$MODEL" >.gpu-a/model.1
  dd if="$MODEL" of=.gpu-b/model.2 bs=1024 skip="$first_kib" count="$part_kib" status=none
  if (($(stat -c %s "$MODEL") > (first_kib + part_kib) * 1024)); then
    mkdir -p .gpu-c
    tail -c +$(((first_kib + part_kib) * 1024 + 1)) "$MODEL" >.gpu-c/model.3
  fi
  du -sh .gpu-a .gpu-b $([ -d .gpu-c ] && echo .gpu-c)
  for d in .gpu-a .gpu-b .gpu-c; do
    [ -d $d ] || continue
    if (($(du -sk $d | cut -f1) + tree_kib > LIMIT_MIB * 1024)); then
      echo "pack: $d and the tree exceed ${LIMIT_MIB} MiB" >&2
      exit 1
    fi
  done
}

# One step: its name, a time limit in seconds, the command; its output goes to the log and
# its outcome to the table.
step() {
  local name=$1 limit=$2 rc t0 t1
  shift 2
  echo "== $name"
  t0=$(date +%s)
  timeout "$limit" "$@"
  rc=$?
  t1=$(date +%s)
  local what=ok
  ((rc == 124)) && what="TIMED OUT"
  ((rc != 0 && rc != 124)) && what="FAILED (rc $rc)"
  printf '%-58s %-16s %5ds\n' "$name" "$what" $((t1 - t0)) >>"$OUT/steps.txt"
  return 0
}

unpack() {
  if [ ! -x .gpu/bin/batchlm ]; then
    mkdir -p .gpu
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      .gpu-a/bundle.tar.xz .gpu
  fi
  # cuBLAS (for the kernel benchmark's comparison) comes from the machine's CUDA.
  local cublas
  cublas=$(find /usr/local /opt /usr/lib -name 'libcublas.so.13' 2>/dev/null | head -1)
  export LD_LIBRARY_PATH="$PWD/.gpu/lib${cublas:+:$(dirname "$cublas")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export BATCHLM_DATA="$PWD/.gpu/data" BATCHLM_MODEL="$PWD/$MODEL"
  export BATCHLM_REFERENCE_DIR="$PWD/tests/reference/smollm2-135m-instruct-q4_1"
}

gpu_tests() {
  echo "== GPU tests, and under compute-sanitizer memcheck (at the same time)"
  local t memchecks=()
  for t in matmul_test ops_test gpu_engine_test; do
    (step "memcheck $t" 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
      .gpu/bin/$t --gtest_brief=1 >"$OUT/memcheck-$t.txt" 2>&1) &
    memchecks+=($!)
  done
  for t in matmul_test ops_test gpu_engine_test; do step "test $t" 180 .gpu/bin/$t --gtest_brief=1; done
  # Where the executor goes for each model (kAuto), with a GPU present.
  step "test executor_test" 60 .gpu/bin/executor_test --gtest_brief=1
  step "test architectures_test (the device decision)" 60 \
    .gpu/bin/architectures_test --gtest_brief=1 --gtest_filter='TinyVariants.*:GpuRunsNetwork.*'
  wait "${memchecks[@]}"
  for t in matmul_test ops_test gpu_engine_test; do tail -5 "$OUT/memcheck-$t.txt"; done
}

# engine_bench writes the random 1B-class models once (about a minute, on the CPU): started
# before the tests when benchmarks follow them.
write_random_models() {
  .gpu/bin/engine_bench --random-1b q4_1 --device cpu --sequences 1 --tokens 2 >/dev/null &&
    .gpu/bin/engine_bench --random-1b f16 --device cpu --sequences 1 --tokens 2 >/dev/null &&
    .gpu/bin/engine_bench --random-1b q4_k_m --device cpu --sequences 1 --tokens 2 >/dev/null
}

kernels() {
  step "kernels: gpu_kernels_bench --check" 240 .gpu/bin/gpu_kernels_bench --check
}

# The 1B-class engine in Q4_1 and in a Q4_K_M-like mix (Q4_K, V and up Q6_K), writing the models
# first where they are not there yet.
k_engine() {
  local t
  for t in q4_1 q4_k_m; do
    step "engine: random 1B-class $t, 1/8/64 sequences" 150 \
      .gpu/bin/engine_bench --random-1b $t --sequences 1,8,64 --tokens 64
  done
}

benchmarks() {
  [ -n "${writer:-}" ] && wait "$writer"
  kernels
  step "engine: random 1B-class q4_1, 1/8/64 sequences" 75 \
    .gpu/bin/engine_bench --random-1b q4_1 --sequences 1,8,64 --tokens 64
  step "engine: random 1B-class f16, 1/8/64 sequences" 75 \
    .gpu/bin/engine_bench --random-1b f16 --sequences 1,8,64 --tokens 64
  step "engine: random 1B-class q4_k_m, 1/8/64 sequences" 75 \
    .gpu/bin/engine_bench --random-1b q4_k_m --sequences 1,8,64 --tokens 64
}

assemble_model() {
  if [ ! -f "$MODEL" ]; then
    mkdir -p models
    cat .gpu-a/model.1 .gpu-b/model.2 $([ -f .gpu-c/model.3 ] && echo .gpu-c/model.3) >"$MODEL"
  fi
}

model_test() {
  assemble_model
  step "default model: GPU against the exact reference" 90 \
    env BATCHLM_TEST_VERBOSE=1 .gpu/bin/gpu_engine_test --gtest_filter='*DefaultModelFollows*'
}

model_engine() {
  assemble_model
  step "engine: SmolLM2-135M Q4_1, 1/8/64/256 sequences" 120 \
    .gpu/bin/engine_bench --model "$MODEL" --sequences 1,8,64,256 --tokens 128 --no-graphs-too
}

model_benchmarks() {
  model_engine
  local t0 t1
  t0=$(date +%s.%N)
  step "GSM8K test set (1,319), 8-shot, greedy, -c 256" 150 \
    .gpu/bin/batchlm run jobs/gsm8k.yaml --limit 1319 -c 256 --fresh \
    --output "$OUT/gsm8k.jsonl" --set backend.device=cuda --set backend.max_sequences=256
  t1=$(date +%s.%N)
  echo "gsm8k wall seconds: $(python3 -c "print(round($t1 - $t0, 2))")"
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
  step "peer: transformers, 1/8/64/256 sequences" 150 \
    env PYTHONPATH=/tmp/site python3 bench/gpu/peer_transformers.py --model "$MODEL" --sequences 1,8,64,256 --tokens 128
}

# What the command line does with the GPU: the dry run's checks there (BatchEngine::check), a
# pool under one context refused before anything is loaded, and a request the GPU's sampler
# cannot take (min_p) refused, named. The refusals must exit non-zero and name the field.
refused() {
  local want=$1 out rc
  shift
  out=$("$@" 2>&1)
  rc=$?
  echo "$out" | tail -8
  ((rc != 0)) && grep -q -- "$want" <<<"$out"
}
export -f refused

cli() {
  assemble_model
  local b=.gpu/bin/batchlm
  step "CLI: dry run on the GPU" 60 $b run jobs/gsm8k.yaml --dry-run --limit 3 --set backend.device=cuda
  step "CLI: dry run refuses a pool under one context" 60 \
    bash -c 'refused "$@"' _ kv_tokens $b run jobs/gsm8k.yaml --dry-run --limit 3 --set backend.device=cuda \
    --set backend.kv_tokens=64
  step "CLI: min_p refused before the run where the GPU samples" 60 \
    bash -c 'refused "$@"' _ "request.extra.min_p: min-p is applied on the CPU only" $b run jobs/gsm8k.yaml \
    --limit 2 --fresh --output "$OUT/min_p.jsonl" --set request.extra.min_p=0.1
  step "CLI: and by the dry run" 60 \
    bash -c 'refused "$@"' _ "request.extra.logprobs: log-probabilities are computed" $b run jobs/gsm8k.yaml \
    --dry-run --limit 2 --set request.extra.logprobs=true
  step "CLI: min_p runs with --set backend.device=cpu" 120 $b run jobs/gsm8k.yaml --limit 2 --fresh \
    --output "$OUT/min_p_cpu.jsonl" --set request.extra.min_p=0.1 --set backend.device=cpu
  step "CLI: generate on the GPU" 60 $b generate --chat -p "What is 17 * 3?" --temperature 0 \
    --max-tokens 24 --timings --device cuda
  step "CLI: generate on the CPU" 60 $b generate --chat -p "What is 17 * 3?" --temperature 0 \
    --max-tokens 24 --timings --device cpu
}

# Where a decode step's GPU time goes: Nsight Compute's duration of each kernel over about one
# step (after the warm-up and prefill), graphs off so that each kernel is its own launch.
profile() {
  assemble_model
  local n skip
  for n in 1 64; do
    # Two passes before it: the warm-up run (4 sequences at most, 8 tokens) and the prefill.
    skip=$((500 * 12))
    step "profile: SmolLM2 decode, $n sequences, one step's kernels" 150 \
      ncu --clock-control none --csv --metrics gpu__time_duration.sum --launch-skip "$skip" \
      --launch-count 500 --log-file "$OUT/ncu-$n.csv" \
      .gpu/bin/engine_bench --model "$MODEL" --sequences "$n" --tokens 16 --no-graphs
    python3 bench/gpu/kernel_times.py "$OUT/ncu-$n.csv" | head -25
  done
}

# Decode throughput of two builds on the same machine, alternating (base, this, base, this):
# the base build's engine_bench, xz-compressed, at .gpu-b/engine_bench.base.xz.
ab() {
  assemble_model
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    .gpu-b/engine_bench.base.xz /tmp/engine_bench.base && chmod +x /tmp/engine_bench.base
  local round
  for round in 1 2; do
    step "A/B round $round: base build" 60 \
      /tmp/engine_bench.base --model "$MODEL" --sequences 1,8,64,256 --tokens 128
    step "A/B round $round: this build" 60 \
      .gpu/bin/engine_bench --model "$MODEL" --sequences 1,8,64,256 --tokens 128
  done
}

device() {
  local stage
  mkdir -p "$OUT"
  : >"$OUT/steps.txt"
  unpack
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv |
    tee "$OUT/gpu.txt"
  {
    case " $* " in
      *" benchmarks "* | *" checks "* | *" all "*) write_random_models & writer=$! ;;
    esac
    for stage in "$@"; do
      case "$stage" in
        tests) gpu_tests ;;
        kernels) kernels ;;
        k-engine) k_engine ;;
        benchmarks) benchmarks ;;
        model-test) model_test ;;
        model-benchmarks) model_benchmarks ;;
        profile) profile ;;
        engine) model_engine ;;
        ab) ab ;;
        cli) cli ;;
        checks) gpu_tests; benchmarks ;;
        model) model_test; model_benchmarks ;;
        all) gpu_tests; benchmarks; model_test; model_benchmarks ;;
        *) echo "device: unknown stage $stage" >&2 ;;
      esac
    done
  } 2>&1 | tee -a "$OUT/log.txt"
  # The table says what failed.
  echo
  cat "$OUT/steps.txt"
  ! grep -q -E 'FAILED|TIMED OUT' "$OUT/steps.txt"
}

case "${1:-}" in
  pack) pack ;;
  device) shift; device "${@:-all}" ;;
  *) echo "usage: bench/gpu/run.sh pack | device [STAGE...]" >&2; exit 2 ;;
esac
