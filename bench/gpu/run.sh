#!/usr/bin/env bash
# The GPU checks and benchmarks, in two halves (bench/README.md, "GPU"):
#
#   bench/gpu/run.sh pack     # on the build machine: a Release build with CUDA; the binaries,
#                             # the shared libraries they need, the GSM8K data and the model
#                             # (in three parts, as a device call carries at most 64 MiB) into
#                             # .gpu/ and .gpu-model-a/, -b/, -c/ (ignored by git)
#   bench/gpu/run.sh device   # on the GPU machine, in the repository root with those folders:
#                             # GPU tests, compute-sanitizer memcheck, kernel and engine
#                             # benchmarks, GSM8K end to end, the transformers peer; a table last
#
# The GPU machine has the CUDA driver, PyTorch and transformers but none of the project's build
# dependencies, so the build happens here and the binaries travel.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${OUT:-/tmp/batchlm-gpu-out}

pack() {
  cmake -S . -B build/gpu -DCMAKE_BUILD_TYPE=Release -DBATCHLM_CUDA=ON >/dev/null
  cmake --build build/gpu -j2 --target batchlm matmul_test ops_test gpu_engine_test \
    gpu_kernels_bench engine_bench
  rm -rf .gpu .gpu-model-a .gpu-model-b .gpu-model-c
  mkdir -p .gpu/bin .gpu/lib .gpu/data .gpu/whl .gpu-model-a .gpu-model-b .gpu-model-c
  cp build/gpu/bin/batchlm build/gpu/tests/matmul_test build/gpu/tests/ops_test \
    build/gpu/tests/gpu_engine_test .gpu/bin/
  cp build/gpu/bin/gpu_kernels_bench build/gpu/bin/engine_bench .gpu/bin/
  strip --strip-debug .gpu/bin/*
  # Shared libraries beyond the C and C++ runtimes (libcurl, yaml-cpp, PCRE2, ...).
  for b in .gpu/bin/*; do ldd "$b"; done | awk '/=> \// {print $3}' | sort -u |
    grep -v -E '/(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so' |
    xargs -r -I{} cp -L {} .gpu/lib/
  cp -r "${BATCHLM_DATA:-../shared/data}/gsm8k" .gpu/data/
  # transformers reads GGUF through the gguf package, which the GPU machine's image lacks.
  python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl gguf
  [ -f "$MODEL" ] || scripts/fetch-model.sh
  split -n 3 -d "$MODEL" .gpu-model-x.
  mv .gpu-model-x.00 .gpu-model-a/part
  mv .gpu-model-x.01 .gpu-model-b/part
  mv .gpu-model-x.02 .gpu-model-c/part
  du -sh .gpu .gpu-model-a .gpu-model-b .gpu-model-c
}

device() {
  mkdir -p "$OUT" models
  export LD_LIBRARY_PATH="$PWD/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export BATCHLM_DATA="$PWD/.gpu/data" BATCHLM_MODEL="$PWD/$MODEL"
  if [ ! -f "$MODEL" ]; then
    cat .gpu-model-a/part .gpu-model-b/part .gpu-model-c/part >"$MODEL"
  fi
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
  (
    status=0
    echo "== GPU tests"
    for t in matmul_test ops_test gpu_engine_test; do .gpu/bin/$t --gtest_brief=1 || status=1; done
    echo "== compute-sanitizer memcheck"
    for t in matmul_test ops_test gpu_engine_test; do
      compute-sanitizer --tool memcheck --error-exitcode 9 .gpu/bin/$t --gtest_brief=1 || status=1
    done
    echo "== kernels"
    .gpu/bin/gpu_kernels_bench --check || status=1
    echo "== engine: SmolLM2-135M Q4_1"
    .gpu/bin/engine_bench --model "$MODEL" --sequences 1,8,64,256 --tokens 128 --no-graphs-too || status=1
    echo "== engine: 1B-class Llama, random weights"
    .gpu/bin/engine_bench --random-1b q4_1 --sequences 1,8,64 --tokens 64 || status=1
    .gpu/bin/engine_bench --random-1b f16 --sequences 1,8,64 --tokens 64 || status=1
    echo "== GSM8K, the whole test set (1,319 questions), 8-shot, greedy"
    local t0 t1
    t0=$(date +%s.%N)
    .gpu/bin/batchlm run jobs/gsm8k.yaml --limit 1319 -c 256 --fresh --output "$OUT/gsm8k.jsonl" \
      --set backend.device=cuda --set backend.max_sequences=256 || status=1
    t1=$(date +%s.%N)
    echo "gsm8k wall seconds: $(echo "$t1 - $t0" | bc)"
    echo "== peer: transformers"
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
    PYTHONPATH=/tmp/site python3 bench/gpu/peer_transformers.py --model "$MODEL" \
      --sequences 1,8,64,256 --tokens 128 || status=1
    exit $status
  ) 2>&1 | tee "$OUT/log.txt"
  return "${PIPESTATUS[0]}"
}

case "${1:-}" in
  pack) pack ;;
  device) device ;;
  *) echo "usage: bench/gpu/run.sh pack|device" >&2; exit 2 ;;
esac
