#!/usr/bin/env bash
# Builds llama.cpp's HTTP server, llama-server, the serving peer of bench/engine/serve.py, into
# bench/engine/.llama-server/bin/llama-server (ignored by git). The sources are the llama.cpp
# that llama-cpp-python 0.3.36 vendors (ggml-org/llama.cpp@0c1e57098, the same llama.cpp as the
# reference in .venv and bench/engine/run.py): its source distribution is fetched from the
# Python package index with pip, checked against its SHA-256, and only vendor/llama.cpp is
# extracted. The build is CPU only, Release, GGML_NATIVE=ON (for this machine's CPU; AMX left out, see below), static
# libraries, no libcurl, no OpenSSL, no tests or examples, no embedded web UI (its assets would
# be downloaded from Hugging Face); only the llama-server target is built.
# Idempotent: an executable bin/llama-server is left alone (delete the folder to rebuild).
# The build took about 7 minutes on 2 cores (shared with other builds).
#   LLAMA_SERVER_SDIST=path   use that llama_cpp_python-0.3.36.tar.gz instead of downloading it
#   JOBS=n                    parallel compile jobs (default 2)
# Usage: bench/engine/setup-llama-server.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

package=llama-cpp-python
version=0.3.36
sdist=llama_cpp_python-0.3.36.tar.gz
sdist_sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
llama_commit=0c1e57098   # from the sdist's CHANGELOG.md: "update llama.cpp to ggml-org/llama.cpp@0c1e57098"
root=bench/engine/.llama-server
exe=$root/bin/llama-server
jobs=${JOBS:-2}

say() { echo "setup-llama-server: $*"; }
die() { echo "setup-llama-server: $*" >&2; exit 1; }

if [[ -x $exe ]]; then
  say "$exe exists ($("$exe" --version 2>&1 | grep -m1 -i version || echo 'version unknown')); nothing to do"
  exit 0
fi

# --- what the build needs (Debian packages in brackets) ---------------------------------------
missing=()
need() { command -v "$1" >/dev/null 2>&1 || missing+=("$1 [$2]"); }
need python3 python3
need tar tar
need sha256sum coreutils
need cmake cmake
need c++ g++
need cc gcc
if ! command -v ninja >/dev/null 2>&1 && ! command -v make >/dev/null 2>&1; then
  missing+=("ninja or make [ninja-build or make]")
fi
if [[ -z ${LLAMA_SERVER_SDIST:-} ]] && ! python3 -m pip --version >/dev/null 2>&1; then
  missing+=("pip for python3 [python3-pip]")
fi
if (( ${#missing[@]} )); then
  die "missing: ${missing[*]}; on Debian: sudo apt-get install <the packages in brackets>"
fi
cmake_version=$(cmake --version | sed -n '1s/[^0-9]*\([0-9][0-9.]*\).*/\1/p')
if [[ $(printf '%s\n' 3.18 "$cmake_version" | sort -V | head -1) != 3.18 ]]; then
  die "cmake $cmake_version is too old: llama.cpp needs 3.18 or later"
fi
if command -v ninja >/dev/null 2>&1; then generator=Ninja; else generator="Unix Makefiles"; fi

mkdir -p "$root/dl"
sha() { sha256sum "$1" | cut -d' ' -f1; }

# --- the source distribution ------------------------------------------------------------------
archive=$root/dl/$sdist
if [[ -n ${LLAMA_SERVER_SDIST:-} ]]; then
  [[ -f $LLAMA_SERVER_SDIST ]] || die "LLAMA_SERVER_SDIST=$LLAMA_SERVER_SDIST does not exist"
  cp "$LLAMA_SERVER_SDIST" "$archive.part"
  mv "$archive.part" "$archive"
elif [[ -f $archive && $(sha "$archive") == "$sdist_sha" ]]; then
  say "using the $sdist downloaded before"
else
  rm -f "$archive"
  say "downloading $package==$version (source distribution) from the Python package index"
  # pip also installs the sdist's build backend in a throw-away environment to read its
  # metadata; nothing is installed for good.
  python3 -m pip download --disable-pip-version-check --quiet --no-binary :all: --no-deps \
    "$package==$version" -d "$root/dl" ||
    die "pip could not download $package==$version (no network? set LLAMA_SERVER_SDIST)"
  [[ -f $archive ]] || die "expected $sdist from pip, got: $(ls "$root/dl")"
fi
got=$(sha "$archive")
[[ $got == "$sdist_sha" ]] || die "$archive has SHA-256 $got, expected $sdist_sha"
say "$sdist SHA-256 ok"

# --- extract vendor/llama.cpp -----------------------------------------------------------------
src=$root/src
rm -rf "$src"
mkdir -p "$src"
tar -xzf "$archive" -C "$src" --strip-components=3 "llama_cpp_python-$version/vendor/llama.cpp"
[[ -f $src/tools/server/main.cpp && -f $src/CMakeLists.txt ]] ||
  die "the sdist holds no llama.cpp server sources (vendor/llama.cpp/tools/server)"

# --- configure and build llama-server only ----------------------------------------------------
build=$root/build
rm -rf "$build"
start=$(date +%s)
# llama.cpp's build asks git for the commit; the tree sits inside this repository, whose commit
# it must not take: git is kept from looking above $root, and the commit is given explicitly.
export GIT_CEILING_DIRECTORIES=$PWD/$root
# This llama.cpp's AMX matrix products crash (SIGSEGV in ggml_backend_amx_mul_mat) as soon as
# llama-server loads SmolLM2-135M Q4_1 on a CPU with AMX-INT8 (an Intel Xeon, 2026-11-25); the
# AMX instructions are left out, so such a CPU runs its AVX-512 path, as any other does.
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$src" -B "$build" -G "$generator" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
  -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON \
  -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_RPC=OFF \
  -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_COMMIT="$llama_commit" \
  -DLLAMA_BUILD_NUMBER=0 \
  >"$root/configure.log" 2>&1 || { tail -40 "$root/configure.log" >&2; die "cmake configure failed (log: $root/configure.log)"; }
say "building llama-server with $jobs jobs (log: $root/build.log)"
cmake --build "$build" --target llama-server -j "$jobs" >"$root/build.log" 2>&1 ||
  { tail -40 "$root/build.log" >&2; die "build failed (log: $root/build.log)"; }
[[ -x $build/bin/llama-server ]] || die "the build produced no $build/bin/llama-server"

mkdir -p "$root/bin"
cp "$build/bin/llama-server" "$exe.part"
mv "$exe.part" "$exe"
say "built $exe in $(( $(date +%s) - start )) s: $("$exe" --version 2>&1 | grep -m1 -i version)"
