#!/usr/bin/env bash
# Puts llama.cpp's own tokenizer test files in models/vocab/, for
# tests/unit/local_engine/vocab_reference_test.cpp. For each vocabulary, ggml-vocab-NAME.gguf holds
# the vocabulary alone (no weights), .gguf.inp test texts and .gguf.out the ids llama.cpp gives
# them. They ship in llama-cpp-python 0.3.36's source distribution (vendor/llama.cpp/models/, the
# llama.cpp that bench/engine/setup-llama-server.sh builds); only those of byte-level BPE
# vocabularies (tokenizer.ggml.model "gpt2") whose pre-tokenizer the engine knows and those of
# SentencePiece vocabularies ("llama") are extracted, and, from models/templates/, the chat
# templates of Qwen2.5, Qwen3, Llama 3.1-3.3, DeepSeek-R1's Llama and Qwen distills and Phi-3.5
# (tokenizer_test reads them).
# The sdist and every extracted file are checked against their SHA-256; valid files already in
# place are left alone. The sdist is taken from, in order:
#   LLAMA_SERVER_SDIST=path   that file (as bench/engine/setup-llama-server.sh takes it)
#   BATCHLM_MIRROR=dir   dir/llama_cpp_python-0.3.36.tar.gz, if present
#   bench/engine/.llama-server/dl/llama_cpp_python-0.3.36.tar.gz, if setup-llama-server.sh left it
#   the Python package index (pip, or curl where there is no pip), 77 MB
set -euo pipefail
cd "$(dirname "$0")/.."

package=llama-cpp-python
version=0.3.36
sdist=llama_cpp_python-0.3.36.tar.gz
sdist_sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e  # as in setup-llama-server.sh
members=llama_cpp_python-0.3.36/vendor/llama.cpp/models
dest=models/vocab

# The sdist's other vocabularies are left out: aquila, baichuan and gpt-neox have no test files;
# command-r, deepseek-coder, deepseek-llm, falcon, mpt and qwen35 name pre-tokenizers the engine
# does not know; bert-bge, gemma-4 and nomic-bert-moe are neither byte-level BPE nor
# SentencePiece ("llama").
manifest() {
  cat <<'EOF'
cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac  ggml-vocab-gpt-2.gguf
be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0  ggml-vocab-gpt-2.gguf.inp
48e8c4cb3ad5c37915b225f872222567c1c4dd4d66951aa53460c8d152ff6d60  ggml-vocab-gpt-2.gguf.out
97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e  ggml-vocab-llama-bpe.gguf
be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0  ggml-vocab-llama-bpe.gguf.inp
118abf2034a197fc5c9dec5204dfdeee7004c7c70952ae577f66b99e212fab9b  ggml-vocab-llama-bpe.gguf.out
44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c  ggml-vocab-qwen2.gguf
be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0  ggml-vocab-qwen2.gguf.inp
de785bb305cc6fa9d43908ed5da337f853c0b79e971348fcfb9f0915a39c5363  ggml-vocab-qwen2.gguf.out
ac3ceda902fed91ccf74312b305d9b86c37e4f8e35fa9cc6ef3ce34fca7d4678  ggml-vocab-refact.gguf
be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0  ggml-vocab-refact.gguf.inp
c7e5c1c5dc1dfd3e0d56576bf699d2aca0b760b80779523ea9d323aad6cd1b88  ggml-vocab-refact.gguf.out
fedb892b4e1bd3c1f2fcdae356440b14fb458f4264d586e5c987ed93df4e174d  ggml-vocab-starcoder.gguf
be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0  ggml-vocab-starcoder.gguf.inp
3ef12183c57ad076f9defd8e5eb454f509f5f0865cad35646abb4c4b2d2c5764  ggml-vocab-starcoder.gguf.out
16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69  ggml-vocab-llama-spm.gguf
be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0  ggml-vocab-llama-spm.gguf.inp
ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29  ggml-vocab-llama-spm.gguf.out
967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326  ggml-vocab-phi-3.gguf
be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0  ggml-vocab-phi-3.gguf.inp
ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29  ggml-vocab-phi-3.gguf.out
cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f  templates/Qwen-Qwen2.5-7B-Instruct.jinja
87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5  templates/Qwen-Qwen3-0.6B.jinja
e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65  templates/meta-llama-Llama-3.1-8B-Instruct.jinja
5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4  templates/meta-llama-Llama-3.2-3B-Instruct.jinja
e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65  templates/meta-llama-Llama-3.3-70B-Instruct.jinja
dd2675619a64a449cdcdd2b93e605a0a50764cee41e344f244752bc93643936c  templates/deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja
bbe594884b44d740667ee65a70bc8d333a565eab3d63ea59f291ea73ada84ba6  templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja
78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90  templates/microsoft-Phi-3.5-mini-instruct.jinja
EOF
}

say() { echo "fetch-vocabs: $*"; }
die() { echo "fetch-vocabs: $*" >&2; exit 1; }
sha() { sha256sum "$1" | cut -d' ' -f1; }
# Whether directory $1 holds every file of the manifest, each with its SHA-256.
valid() { [[ -d $1 ]] && (cd "$1" && manifest | sha256sum --check --strict --quiet - >/dev/null 2>&1); }

command -v sha256sum >/dev/null 2>&1 || die "needs sha256sum (on Debian: sudo apt-get install coreutils)"
if valid "$dest"; then exit 0; fi
command -v tar >/dev/null 2>&1 || die "needs tar (on Debian: sudo apt-get install tar)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# --- the source distribution ------------------------------------------------------------------
archive=
mirror=${BATCHLM_MIRROR:-}
for candidate in ${LLAMA_SERVER_SDIST:+"$LLAMA_SERVER_SDIST"} ${mirror:+"$mirror/$sdist"} "bench/engine/.llama-server/dl/$sdist"; do
  [[ -f $candidate ]] || continue
  if [[ $(sha "$candidate") == "$sdist_sha" ]]; then
    archive=$candidate
    break
  fi
  say "$candidate does not match the expected SHA-256; looking further" >&2
done
if [[ -z $archive ]]; then
  say "downloading $package==$version (source distribution, 77 MB) from the Python package index"
  # pip also installs the sdist's build backend in a throw-away environment to read its
  # metadata; nothing is installed for good.
  if ! python3 -m pip download --disable-pip-version-check --quiet --no-binary :all: --no-deps \
      "$package==$version" -d "$tmp" 2>"$tmp/pip.err"; then
    # No pip (or pip failed): ask the index for the sdist's address and fetch it with curl.
    url=$(curl -fsSL --retry 3 "https://pypi.org/pypi/$package/$version/json" |
          python3 -c 'import json,sys; print([u["url"] for u in json.load(sys.stdin)["urls"] if u["filename"].endswith(".tar.gz")][0])' 2>/dev/null) || {
      cat "$tmp/pip.err" >&2
      die "could not download $package==$version (no network? put $sdist in \$BATCHLM_MIRROR)"
    }
    curl -fsSL --retry 3 -o "$tmp/$sdist" "$url" ||
      die "could not download $url (no network? put $sdist in \$BATCHLM_MIRROR)"
  fi
  [[ -f $tmp/$sdist ]] || die "expected $sdist from the index, got: $(ls "$tmp")"
  archive=$tmp/$sdist
fi
got=$(sha "$archive")
[[ $got == "$sdist_sha" ]] || die "$archive has SHA-256 $got, expected $sdist_sha"

# --- extract the vocabularies ---------------------------------------------------------------
mkdir -p "$tmp/vocab"
mapfile -t files < <(manifest | awk '{print $2}')
tar -xzf "$archive" -C "$tmp/vocab" --strip-components=4 "${files[@]/#/$members/}" ||
  die "$archive lacks some of: ${files[*]}"
valid "$tmp/vocab" || die "the files extracted from $archive do not match their SHA-256"
mkdir -p "$dest"
cp -R -f "$tmp/vocab"/. "$dest/"
say "${#files[@]} files in $dest ok (from $archive)"
