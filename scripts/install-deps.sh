#!/usr/bin/env bash
# Installs the Debian packages batchlm builds with. Idempotent: installs only what is missing,
# and runs `apt-get update` only when something must be installed.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config ccache git
  libboost1.81-dev          # Asio, Beast
  libcurl4-openssl-dev      # HTTP/1.1, HTTP/2 (nghttp2), TLS
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev
  libpcre2-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [[ $(id -u) != 0 ]]; then sudo="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
