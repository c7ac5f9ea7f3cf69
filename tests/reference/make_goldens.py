#!/usr/bin/env python3
"""Writes the llama.cpp golden files that batchlm's engine is checked against.

Usage (from the repository root):
    tests/reference/setup.sh
    .venv/bin/python tests/reference/make_goldens.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf

The default model requantized to Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (README.md) has its own:
    build/dev/bin/requantize_gguf models/SmolLM2-135M-Instruct.Q4_1.gguf models/SmolLM2-135M-Instruct.kmix.gguf
    .venv/bin/python tests/reference/make_goldens.py --model models/SmolLM2-135M-Instruct.kmix.gguf \
        --out tests/reference/smollm2-135m-instruct-kmix

The default model as the qwen2 architecture and with rope_freqs (README.md) likewise:
    build/dev/bin/requantize_gguf --as qwen2 models/SmolLM2-135M-Instruct.Q4_1.gguf models/SmolLM2-135M-Instruct.qwen2.gguf
    .venv/bin/python tests/reference/make_goldens.py --model models/SmolLM2-135M-Instruct.qwen2.gguf \
        --out tests/reference/smollm2-135m-instruct-qwen2

The same for the phi3, phi3long, gemma2 and gemma3 copies (--as phi3|phi3long|gemma2|gemma3, README.md).

Writes, into tests/reference/<model-dir>/ (default: smollm2-135m-instruct-q4_1):
  tokenize.json  -- token ids of many texts, from Llama.tokenize(text, add_bos=False,
                    special=parse_special)
  generate.json  -- for a few prompts: 64 greedy token ids (argmax of the raw logits, fed back,
                    never stopping at end-of-generation tokens) and the 5 largest logits after
                    the prompt

Everything runs on the CPU with 2 threads, a fresh context per prompt (n_ctx 2048, n_batch and
n_ubatch 512, flash attention off, f16 KV cache), so the output is deterministic.
"""

import argparse
import hashlib
import json
import os
import sys

import numpy as np

import llama_cpp
from llama_cpp import Llama

from llama_c import decode, fresh_context, last_logits, n_vocab_of

N_PREDICT = 64
N_CTX = 2048
N_BATCH = 512
N_THREADS = 2
N_TOP = 5

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user, system=SYSTEM):
    return (f"<|im_start|>system\n{system}<|im_end|>\n"
            f"<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n")


LONG_PARAGRAPH = (
    "The old lighthouse stood at the end of a narrow spit of rock, a mile from the nearest "
    "house. For more than a hundred years its keepers had climbed the one hundred and "
    "twelve steps of the spiral stair each evening at dusk, trimmed the wick, polished the "
    "great glass lens, and wound the clockwork that turned it through the night. Ships "
    "passing the headland counted the flashes: three short and one long, repeated every "
    "twenty seconds, so that a captain who had lost his bearings in the fog could tell this "
    "light from the one on the island to the south, which showed a steady red. In winter the "
    "storms came in from the west and the spray reached the gallery, ninety feet above the "
    "water; the keepers wrote in their logbook that the tower swayed like a tree. In summer "
    "there were visitors, children from the village who wanted to see the lamp, and painters "
    "who set up their easels on the rocks. When the light was finally made automatic, the "
    "last keeper locked the door, walked along the causeway, and did not look back."
)

LONG_PARAGRAPH_2 = (
    "Years later the village bought the tower for one dollar. Volunteers repaired the roof, "
    "replaced the rusted railings, and opened a small museum in the keeper's cottage, where "
    "the logbooks are kept under glass. On clear nights the lamp is still lit, though only "
    "for the visitors, who climb the stair to watch the beam sweep across the dark water."
)

# Name, text, parse_special. Every text is tokenized with add_bos=False.
TOKENIZE_CASES = [
    ("ascii_sentence", "Hello world", False),
    ("ascii_sentence_leading_space", " hello", False),
    ("ascii_pangram", "The quick brown fox jumps over the lazy dog.", False),
    ("ascii_mixed_case", "HELLO World hElLo wORLD CamelCaseIdentifier snake_case_name", False),
    ("digits_short", "12345", False),
    ("digits_long", "12345678", False),
    ("digits_very_long", "3141592653589793238462643383279", False),
    ("decimal", "3.14159", False),
    ("thousands", "1,000,000", False),
    ("numbers_in_text", "In 2023, 47% of the 1.5 million users paid $9.99/month.", False),
    ("gsm8k_arithmetic", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                         "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
                         "#### 72", False),
    ("math_expression", "x^2 + 3x - 4 = 0 => (x+4)(x-1) = 0, so x = -4 or x = 1.", False),
    ("code_python", "def fibonacci(n):\n    if n < 2:\n        return n\n"
                    "    return fibonacci(n - 1) + fibonacci(n - 2)\n", False),
    ("code_c", "#include <stdio.h>\n\nint main(void) {\n\tfor (int i = 0; i < 10; ++i) {\n"
               "\t\tprintf(\"%d\\n\", i);\n\t}\n\treturn 0;\n}\n", False),
    ("code_json", '{"name": "batchlm", "version": [0, 1, 0], "ok": true, "x": null}', False),
    ("spaces_run", "a  b   c    d     e", False),
    ("spaces_only", "        ", False),
    ("tabs", "\ta\t\tb\t\t\tc", False),
    ("newlines", "line one\n\n\nline two\r\nline three\n", False),
    ("newlines_only", "\n\n\n", False),
    ("leading_trailing_spaces", "   leading and trailing   ", False),
    ("space_newline_space", "  \n  ", False),
    ("chinese", "我爱自然语言处理。今天天气很好，我们去公园散步吧！", False),
    ("japanese", "日本語のテキストです。ひらがな、カタカナ、漢字が混ざっています。", False),
    ("korean", "안녕하세요, 만나서 반갑습니다. 한국어 문장입니다.", False),
    ("emoji", "I love pizza 🍕 and cats 🐱!! 😀😀😀", False),
    ("emoji_zwj_and_flags", "Family: 👨‍👩‍👧‍👦 Technologist: 🧑🏽‍💻 Flags: 🇫🇷🇯🇵🇺🇸 🏳️‍🌈", False),
    ("accented_latin", "Café, naïve, résumé, señor, jalapeño, Müller, Straße, Ærøskøbing", False),
    ("combining_marks", "cafe\u0301 nai\u0308ve n\u0303 A\u030a", False),
    ("cyrillic", "Привет, мир! Съешь же ещё этих мягких французских булок.", False),
    ("arabic", "مرحبا بالعالم، هذا نص عربي قصير.", False),
    ("greek_hebrew_hindi", "Γειά σου Κόσμε — שלום עולם — नमस्ते दुनिया", False),
    ("contractions_lower", "don't can't won't it's we'll they're I'm you've she'd", False),
    ("contractions_upper", "DON'T I'VE WE'LL THEY'RE I'M", False),
    ("contractions_mixed", "I'VE we'll We'Ll it'S", False),
    ("punctuation_runs", "Wait... what?!?! --- *** ((nested)) [[x]] {{y}} <<>> ;;;; ,,,,", False),
    ("quotes_and_dashes", "\u201cSmart quotes\u201d, \u2018single\u2019, en\u2013dash, em\u2014dash, \u2026", False),
    ("url", "See https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2#top "
            "or mailto:someone@example.com", False),
    ("file_path", "/usr/local/lib/python3.11/site-packages/llama_cpp/__init__.py", False),
    ("chatml_special", chatml("What is 2 + 2?") + "2 + 2 = 4.<|im_end|>\n", True),
    ("chatml_not_special", chatml("What is 2 + 2?") + "2 + 2 = 4.<|im_end|>\n", False),
    ("endoftext_special", "<|endoftext|>", True),
    ("endoftext_not_special", "<|endoftext|>", False),
    ("special_inside_word", "abc<|im_start|>def", True),
    ("special_inside_word_not_special", "abc<|im_start|>def", False),
    ("special_adjacent", "<|im_start|><|im_end|><|endoftext|>", True),
    ("empty", "", False),
    ("empty_special", "", True),
    ("single_space", " ", False),
    ("single_char", "a", False),
    ("long_paragraph", LONG_PARAGRAPH, False),
]

# Name, prompt text (tokenized with special=True, add_bos=False).
GENERATE_CASES = [
    ("story", "Once upon a time, in a small village at the edge of a great forest, there lived"),
    ("gsm8k_chatml", chatml(
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
        "clips in May. How many clips did Natalia sell altogether in April and May?")),
    ("code_fibonacci", "def fibonacci(n):"),
    ("list_planets", "Here is a list of the eight planets of the solar system, in order from "
                     "the Sun:\n1."),
    ("one_token", "The"),
    ("chat_capital", chatml("What is the capital of France?")),
    ("long_prompt", LONG_PARAGRAPH + " " + LONG_PARAGRAPH_2 +
                    "\n\nQuestion: How many steps did the keepers climb each evening, and what "
                    "pattern did the light flash?\nAnswer:"),
]


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def top_n(logits, n):
    """Indices of the n largest logits, largest first; ties: lowest id first."""
    order = np.argsort(-logits, kind="stable")
    return [int(i) for i in order[:n]]


def generate(llm, prompt_tokens):
    model = llm._model.model
    n_vocab = n_vocab_of(model)
    with fresh_context(model, N_CTX, N_BATCH, N_THREADS) as (ctx, batch):
        n_past = 0
        for i in range(0, len(prompt_tokens), N_BATCH):
            chunk = prompt_tokens[i:i + N_BATCH]
            decode(ctx, batch, chunk, n_past)
            n_past += len(chunk)
        logits = last_logits(ctx, n_vocab)
        top = [{"token": t, "logit": float(logits[t])} for t in top_n(logits, N_TOP)]
        tokens, margins = [], []
        for step in range(N_PREDICT):
            first, second = top_n(logits, 2)
            tokens.append(first)
            margins.append(float(logits[first]) - float(logits[second]))
            if step + 1 == N_PREDICT:
                break
            decode(ctx, batch, [first], n_past)
            n_past += 1
            logits = last_logits(ctx, n_vocab)
        return tokens, top, margins


def one_by_one_logits(llm, prompt_tokens, ids):
    """The logits of `ids` after the prompt when it is decoded one token per call.

    llama.cpp's batched and token-by-token prompt paths add in different orders; on this small
    quantized model that alone moves logits by up to a few tenths. The spread between the two
    is recorded so that tests can tell llama.cpp's own rounding noise from a real difference.
    """
    model = llm._model.model
    with fresh_context(model, N_CTX, N_BATCH, N_THREADS) as (ctx, batch):
        for i, t in enumerate(prompt_tokens):
            decode(ctx, batch, [t], i)
        logits = last_logits(ctx, n_vocab_of(model))
        return [float(logits[t]) for t in ids]


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default=os.path.join(here, "smollm2-135m-instruct-q4_1"),
                    help="output directory (default: %(default)s)")
    args = ap.parse_args()

    names = [c[0] for c in TOKENIZE_CASES] + [c[0] for c in GENERATE_CASES]
    assert len(set(c[0] for c in TOKENIZE_CASES)) == len(TOKENIZE_CASES)
    assert len(set(c[0] for c in GENERATE_CASES)) == len(GENERATE_CASES), names

    llm = Llama(args.model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH,
                n_threads=N_THREADS, n_threads_batch=N_THREADS, flash_attn=False,
                n_gpu_layers=0, verbose=False)
    header = {
        "model": os.path.basename(args.model),
        "model_sha256": sha256_of(args.model),
        "llama_cpp_python": llama_cpp.__version__,
    }
    os.makedirs(args.out, exist_ok=True)

    cases = []
    for name, text, special in TOKENIZE_CASES:
        tokens = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
        cases.append({"name": name, "text": text, "parse_special": special, "tokens": tokens})
    write_json(os.path.join(args.out, "tokenize.json"), {**header, "cases": cases})
    print(f"tokenize.json: {len(cases)} cases", file=sys.stderr)

    cases = []
    for name, prompt in GENERATE_CASES:
        prompt_tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        tokens, top, margins = generate(llm, prompt_tokens)
        text = llm.detokenize(tokens, special=True).decode("utf-8", errors="replace")
        serial = one_by_one_logits(llm, prompt_tokens, [t["token"] for t in top])
        spread = max(abs(a["logit"] - b) for a, b in zip(top, serial))
        cases.append({"name": name, "prompt": prompt, "prompt_tokens": prompt_tokens,
                      "tokens": tokens, "text": text, "top_logits": top,
                      "top_logits_one_by_one": serial, "self_spread": spread,
                      "margins": margins})
        print(f"  {name}: {len(prompt_tokens)} prompt tokens -> {text[:60]!r}",
              file=sys.stderr)
    write_json(os.path.join(args.out, "generate.json"),
               {**header, "n_predict": N_PREDICT,
                "settings": {"n_ctx": N_CTX, "n_batch": N_BATCH, "n_ubatch": N_BATCH,
                             "n_threads": N_THREADS, "flash_attn": False,
                             "type_k": "f16", "type_v": "f16", "add_bos": False,
                             "sampling": "argmax of raw logits, ties to the lowest id"},
                "cases": cases})
    print(f"generate.json: {len(cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
