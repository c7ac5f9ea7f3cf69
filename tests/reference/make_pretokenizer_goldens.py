#!/usr/bin/env python3
"""Writes llama.cpp's token ids for the Tekken and GPT-4o (o200k) pre-tokenizers.

Usage (from the repository root, after bench/engine/setup-llama-server.sh has unpacked
llama.cpp's source into bench/engine/.llama-server/src):
    cmake --build build/dev --target tiny_gguf
    tests/reference/setup.sh
    .venv/bin/python tests/reference/make_pretokenizer_goldens.py

For each pre-tokenizer, `tiny_gguf --vocab PRE` writes a vocabulary-only GGUF (byte_pair_vocab()
in tests/support/gguf_writer.hpp: every pair of bytes is a token and a merge, ranked in a fixed
pseudo-random order, so a piece's bytes pair up across any place where another pre-tokenizer
would split it), and llama.cpp loads it (vocab_only) and tokenizes every text with
Llama.tokenize(text, add_bos=False, special=False). The texts: llama.cpp's own tokenizer test
texts (models/ggml-vocab-*.gguf.inp of its source, all three versions), texts written here for
these patterns (case runs, contractions, digit runs, punctuation, whitespace, scripts, marks,
emoji) and seeded random strings from a mix of character classes.

Writes tests/reference/pretokenizers/tokenize.json (--out to change): the texts, and per
pre-tokenizer the vocabulary file's sha256, llama.cpp's add_bos for it (the file has no
add_bos_token key) and the ids of every text. The other names llama.cpp gives the GPT-4o
pattern (llama4, kanana2, talkie, minimax-m2) are checked to give the same ids on every text
and listed. Deterministic: two runs write the same file.
"""

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import unicodedata

import llama_cpp
from llama_cpp import Llama

PRETOKENIZERS = ["tekken", "gpt-4o"]
GPT4O_ALIASES = ["llama4", "kanana2", "talkie", "minimax-m2"]
LLAMA_CPP_MODELS = "bench/engine/.llama-server/src/models"
# The distinct texts files of llama.cpp's tokenizer tests (most vocabularies share the first).
INP_FILES = ["ggml-vocab-gpt-2.gguf.inp", "ggml-vocab-qwen35.gguf.inp", "ggml-vocab-gemma-4.gguf.inp"]
N_RANDOM = 1500
SEED = 20261126

WRITTEN = [
    # Case runs: capitals then small letters, or capitals alone.
    "CamelCase", "camelCase", "ALLCAPS", "HTTPServer", "iPhone", "XMLHttpRequest",
    "getHTTPResponseCode", "McDonald", "ABCdef", "aBC", "A", "a", "Aa", "aA", "AAa", "aAA",
    "PascalCaseString", "snake_case_name", "kebab-case-name", "SCREAMING_SNAKE_CASE", "iOS",
    "macOS", "eBay", "IPv6", "USBDevice", "x86_64", "TheQuickBrownFox JUMPS over", "ABC def GHI",
    "MixedCASEwithNumbers123AND456", "HelloWorld123", " Hello", "  HELLO", "\tTab", "(Paren)",
    "'Quoted'", "_private", "__init__", "$VAR", "#Heading", "@User", "a.B.c", "A-B-C",
    # Non-ASCII letters count as both cases; marks are not letters.
    "ÉCOLE", "École", "éCOLE", "ÜBER", "über", "Über", "Straße", "STRASSE", "ǅemal", "ǈ",
    "ᾈ", "ʰello", "ªb", "Ωmega", "ΩMEGA", "Ñandú", "İstanbul", "ıi", "ǲ", "ﬁle", "Москва",
    "МОСКВА", "мОСКВА", "Привет Мир", "Γειά σου Κόσμε", "ΑΘΗΝΑ", "Tiếng Việt", "DONʼT",
    "e\u0301", "Cafe\u0301", "CAFE\u0301", "CAFE\u0301S", "n\u0303o", "a\u0300\u0301\u0302b",
    "\u0301start", " \u0301", "x\u20dd", "\u0905\u093c", "Z\u0334\u0355\u0308a\u0335l\u0336g\u0338o",
    "hello\u0301world", "HELLO\u0301WORLD", "A\u0301B",
    # Contractions, in both cases.
    "it's", "IT'S", "It'S", "don't", "DON'T", "Don'T", "we're", "WE'RE", "we'Re", "I've",
    "I'VE", "I'm", "I'M", "you'll", "YOU'LL", "You'Ll", "he'd", "HE'D", "'s", "'S", "'t",
    "'T", "'re", "'RE", "'ve", "'VE", "'m", "'M", "'ll", "'LL", "'d", "'D", "'x", "''s",
    "rock'n'roll", "y'all'd've", "O'Reilly's", "O'Neil", "l'homme", "dell'arte", "'tis",
    "cats' toys", "can\u2019t", "it\u2019s", " 's", "a 'll", "x'LL", "123's", "ÉCOLE's",
    "naïve's", "Москва's", "HTTPServer's", "iPhone'S", "WE'REN'T", "a'b'c'd", "'''s", "'s's",
    # Digit runs (o200k: groups of up to three; Tekken: one digit each).
    "1", "12", "123", "1234", "12345", "123456", "1234567", "1 12 123 1234 12345",
    "3.14159", "1,000,000", "1e10", "0x1F", "v2.0.1", "a1b2c3", "abc123def", "ABC123",
    "١٢٣٤٥", "１２３４", "²³", "Ⅻ", "½", "①②③", "𝟏𝟐𝟑", "٣.١٤", "12 345", "$1,234.56",
    "2024-01-01T12:34:56Z", "phone: +1 (555) 123-4567", "1" * 50, " 1234", "x1234y",
    # Punctuation runs (o200k and Tekken let symbols take trailing newlines and slashes).
    "...", "!!!", "?!?!", "---", "===", "/*comment*/", "//", "a/b/c", "a//b", "///\n",
    "http://example.com/path?q=1&r=2#frag", "C:\\Users\\x", "::", "->", "=>", "<=>", "{[()]}",
    "@user #tag", "~~~", "```python\nprint(1)\n```", " !", " !!\n", "!\n\n", "/\n/", " /\n",
    ".\r\n", "a.\n\nb", "end.\n", "x;\n\ty", "«quoted»", "\u201csmart quotes\u201d",
    "\u2014em dash\u2014", "\u2026", "¿Qué?", "¡Hola!", "<html><body>Hi</body></html>",
    "SELECT * FROM users WHERE id=1;", '{"key": [1, 2, {"a": null}]}', "a+b=c", "50%",
    ".../", "!/\r\n/", " ./\n",
    # Whitespace runs.
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n", "\n ", "  \n  ",
    "\t\t\n", "a  b", "a \n b", "a\n\n\nb", " a", "  a", "a ", "a  ", "\u00a0a",
    "a\u00a0\u00a0b", "\u3000中", "a\u2028b", "x\u0085y", "\u000bvert", "\f", " \t \n \r ",
    "    def f():\n        return 1\n", "\n\t\tindented", "word   \n", "a \u00a0 b",
    " " * 40 + "x", "\n" * 10, "a\r\rb", "a \r\n\r\n b",
    # Scripts, emoji, control and format characters.
    "日本語のテキスト", "中文字符测试", "中文ABC123", "한국어 텍스트", "مرحبا بالعالم", "العربية123",
    "שלום עולם", "हिन्दी भाषा", "ภาษาไทย", "😀", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🇫🇷🇩🇪",
    "❤️", "hi😀there", "A😀B", "😀123", "😀 😀", "\x00", "a\x00b", "\x01\x02",
    "\x1c\x1d\x1e\x1f", "a\x1fB", "\x7f", "\u200b", "a\u200db", "\ufeffBOM", "soft\u00adhyphen",
    "\ue000", "\U0010fffd", "\ufffd", "test@example.com", "naïve café résumé",
]


def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_inp(path):
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n__ggml_vocab_test__\n")


def random_texts(n, seed):
    """Strings of 1 to 24 characters (1 to 80 for every tenth) from a mix of classes."""
    rng = random.Random(seed)

    def span(a, b):
        return [chr(c) for c in range(ord(a), ord(b) + 1)]

    # Every code point assigned in Unicode 14.0 (llama.cpp's tables are Unicode 15.1's, PCRE2
    # 10.42's 14.0's; they differ only on code points assigned since), surrogates left out.
    assigned = [c for c in range(0x110000)
                if not 0xD800 <= c < 0xE000 and unicodedata.category(chr(c)) != "Cn"]
    pools = [
        span("A", "Z"), span("a", "z"), span("0", "9"), list("   \t\n\r\v\f\n"),
        span("!", "/"), span(":", "@") + list("[\\]^_`{|}~"),
        list("''strevmldSTREVMLD/"),
        span("\u00c0", "\u00ff"), span("\u0391", "\u03c9"), span("\u0410", "\u044f"),
        span("\u4e00", "\u4e40"), span("\u3041", "\u3060"), span("\u0627", "\u064a"),
        span("\u0660", "\u0669"), span("\u0300", "\u036f"),
        list("\U0001f600\U0001f44d\U0001f3fd\u200d\u2764\ufe0f\U0001f1eb\U0001f1f7"),
        list("\u00a0\u3000\u2028\u2029\u0085\u1680\u2003\u202f\u205f\u200b\ufeff"
             "\x1c\x1d\x1e\x1f\x00\x7f\x80\x9f"),
        list("\u01c5\u01c8\u1f88\u02b0\u02b1\u00aa\u00ba\u1d2c\u2160\u216b\u00b2\u00b3\u00bd"
             "\uff10\uff21\uff41\ue000\U0010fffd\u2070\u24b6\u24d0"),
        None,  # any assigned code point
    ]
    texts = []
    for i in range(n):
        length = 1 + rng.randrange(80 if i % 10 == 0 else 24)
        chars = []
        for _ in range(length):
            pool = rng.choice(pools)
            chars.append(chr(rng.choice(assigned)) if pool is None else rng.choice(pool))
        texts.append("".join(chars))
    return texts


def compact(value):
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny-gguf", default="build/dev/bin/tiny_gguf")
    ap.add_argument("--llama-cpp-models", default=LLAMA_CPP_MODELS,
                    help="llama.cpp's models/ folder, with its tokenizer tests (default: %(default)s)")
    ap.add_argument("--out", default=os.path.join(here, "pretokenizers", "tokenize.json"))
    args = ap.parse_args()
    if unicodedata.unidata_version != "14.0.0":
        sys.exit(f"unicodedata is Unicode {unicodedata.unidata_version}; the random texts draw on "
                 "Unicode 14.0's code points, which Python 3.11 has (PCRE2 10.42 too)")

    texts = []
    for name in INP_FILES:
        for text in read_inp(os.path.join(args.llama_cpp_models, name)):
            if text not in texts:
                texts.append(text)
    sources = {"llama.cpp": len(texts), "written": len(WRITTEN), "random": N_RANDOM}
    texts += WRITTEN + random_texts(N_RANDOM, SEED)

    pretokenizers = {}
    aliases = []
    with tempfile.TemporaryDirectory() as tmp:
        def load(pre):
            path = os.path.join(tmp, pre + ".gguf")
            subprocess.run([args.tiny_gguf, "--vocab", pre, path], check=True, stdout=subprocess.DEVNULL)
            return path, Llama(path, vocab_only=True, verbose=False)

        def ids_of(llm):
            return [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in texts]

        for pre in PRETOKENIZERS:
            path, llm = load(pre)
            vocab = llama_cpp.llama_model_get_vocab(llm.model)
            pretokenizers[pre] = {"vocab_sha256": sha256_of(path),
                                  "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
                                  "ids": ids_of(llm)}
            print(f"{pre}: {sum(map(len, pretokenizers[pre]['ids']))} ids", file=sys.stderr)
        for alias in GPT4O_ALIASES:
            if ids_of(load(alias)[1]) != pretokenizers["gpt-4o"]["ids"]:
                sys.exit(f"llama.cpp's {alias} does not split as its gpt-4o does")
            aliases.append(alias)

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("{\n")
        f.write(f'"llama_cpp_python":{compact(llama_cpp.__version__)},\n')
        f.write(f'"vocab":{compact("tiny_gguf --vocab PRE (byte_pair_vocab)")},\n')
        f.write(f'"sources":{compact(sources)},\n')
        f.write(f'"gpt-4o_aliases":{compact(aliases)},\n')
        f.write('"texts":[\n' + ",\n".join(compact(t) for t in texts) + "\n],\n")
        f.write('"pretokenizers":{\n')
        for k, pre in enumerate(PRETOKENIZERS):
            p = pretokenizers[pre]
            f.write(f'{compact(pre)}:{{"vocab_sha256":{compact(p["vocab_sha256"])},'
                    f'"add_bos":{compact(p["add_bos"])},"ids":[\n')
            f.write(",\n".join(compact(ids) for ids in p["ids"]))
            f.write("\n]}" + ("," if k + 1 < len(PRETOKENIZERS) else "") + "\n")
        f.write("}\n}\n")
    print(f"{args.out}: {len(texts)} texts ({sources})", file=sys.stderr)


if __name__ == "__main__":
    main()
