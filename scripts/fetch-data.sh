#!/usr/bin/env bash
# Fills the data directory (${BATCHLM_DATA:-data}) with the datasets the shipped jobs read.
# With BATCHLM_MIRROR set, copies from that directory (same layout: gsm8k/test.jsonl, ...)
# instead of the network. Every file is checked against its SHA-256; present, valid files are
# left alone, so the script is cheap to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

data_dir=${BATCHLM_DATA:-data}
mirror=${BATCHLM_MIRROR:-}
gsm8k_url=https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data

# path  sha256
files=(
  "gsm8k/test.jsonl 3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"
  "gsm8k/train.jsonl 17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465"
)

sha() { sha256sum "$1" | cut -d' ' -f1; }

for entry in "${files[@]}"; do
  read -r rel want <<<"$entry"
  dest="$data_dir/$rel"
  if [[ -f $dest && $(sha "$dest") == "$want" ]]; then continue; fi
  mkdir -p "$(dirname "$dest")"
  tmp="$dest.part"
  if [[ -n $mirror ]]; then
    [[ -f $mirror/$rel ]] || { echo "fetch-data: $mirror/$rel not found (BATCHLM_MIRROR=$mirror)" >&2; exit 1; }
    cp "$mirror/$rel" "$tmp"
  else
    echo "fetch-data: downloading $rel"
    curl -fsSL --retry 3 -o "$tmp" "$gsm8k_url/$(basename "$rel")"
  fi
  got=$(sha "$tmp")
  if [[ $got != "$want" ]]; then
    rm -f "$tmp"
    echo "fetch-data: $rel has SHA-256 $got, expected $want" >&2
    exit 1
  fi
  mv "$tmp" "$dest"
  echo "fetch-data: $dest ok"
done
if [[ -n $mirror && -f $mirror/gsm8k/LICENSE ]]; then cp "$mirror/gsm8k/LICENSE" "$data_dir/gsm8k/LICENSE"; fi
