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

if [[ "$(version_of llama-cpp-python)" != "$LLAMA_CPP_PYTHON_VERSION" ]]; then
  # Built from source (not a prebuilt wheel) so that ggml is compiled for this machine's CPU.
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    "$venv/bin/python" -m pip install --disable-pip-version-check --no-binary llama-cpp-python \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
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
