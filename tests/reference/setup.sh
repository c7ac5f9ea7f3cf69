#!/usr/bin/env bash
# Creates or updates .venv at the repository root with the llama.cpp reference: llama-cpp-python
# built from source for this CPU (GGML_NATIVE), plus gguf and numpy. Used by
# tests/reference/make_goldens.py and bench/engine/run.py.
# Idempotent: a venv that already has these versions is left alone. Building llama.cpp takes a
# a few minutes (about 3 on 2 cores).
# Usage: tests/reference/setup.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

LLAMA_CPP_PYTHON_VERSION=0.3.36   # the version the goldens were generated with
GGUF_VERSION=0.19.0
venv=.venv

if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi

version_of() {
  "$venv/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" \
    2>/dev/null || true
}

# This llama.cpp's AMX matrix products crash (SIGSEGV) on the first batch of more than one token
# on a CPU with AMX-INT8 (an Intel Xeon, 2026-11-26), as they do in bench/engine's llama-server:
# the AMX instructions are left out, so such a CPU runs the AVX-512 path, as any other does. A
# build that has them (the AMX code logs "amx repack tensor") is replaced.
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
ggml_cpu=$(compgen -G "$venv/lib/python3*/site-packages/llama_cpp/lib/libggml-cpu.so" || true)
if [[ "$(version_of llama-cpp-python)" != "$LLAMA_CPP_PYTHON_VERSION" ]] ||
   { [[ -n "$ggml_cpu" ]] && grep -q "amx repack tensor" "$ggml_cpu"; }; then
  # Built from source (not a prebuilt wheel, nor one built before) so that ggml is compiled for
  # this machine's CPU.
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'}" \
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    "$venv/bin/python" -m pip install --disable-pip-version-check --no-cache-dir --force-reinstall \
      --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
fi
if [[ "$(version_of gguf)" != "$GGUF_VERSION" || -z "$(version_of numpy)" ]]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "gguf==$GGUF_VERSION" numpy
fi

"$venv/bin/python" - <<'PY'
import importlib.metadata as m, sys
import llama_cpp
print(".venv: python %s, llama-cpp-python %s, gguf %s, numpy %s" % (
    sys.version.split()[0], llama_cpp.__version__, m.version("gguf"), m.version("numpy")))
PY
