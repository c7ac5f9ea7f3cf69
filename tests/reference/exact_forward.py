#!/usr/bin/env python3
"""The default model's forward pass with exact products: a reference for engines that round
differently.

llama.cpp and batchlm's CPU path round every activation to 8 bits (Q8_0 / Q8_1 blocks) before
each quantized matrix product; batchlm's GPU path does not. On this 30-layer model the two
roundings move the logits by tenths, so neither engine is a fair yardstick for the other. This
script runs the same network in float64 from the dequantized GGUF weights, keeping only the
rounding every engine shares (keys and values stored as float16), and writes, for each prompt
of generate.json, the greedy continuation and the largest logits after the prompt:

    tests/reference/setup.sh        # .venv with numpy and gguf (and llama.cpp, not needed here)
    .venv/bin/python tests/reference/exact_forward.py     # about a minute

Output: tests/reference/smollm2-135m-instruct-q4_1/exact.json, read by the engine tests:
  cases[i].tokens      64 greedy tokens (argmax, ties to the lowest id), each fed back
  cases[i].margins     at each step, the top logit minus the second
  cases[i].top_logits  the 64 largest logits after the prompt, as (token, logit)
"""
import argparse
import hashlib
import json
import os

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

here = os.path.dirname(os.path.abspath(__file__))
N_PREDICT = 64
N_TOP = 64


def field(reader, key):
    f = reader.fields[key]
    return f.parts[f.data[0]][0]


class Model:
    def __init__(self, path):
        r = GGUFReader(path)
        arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
        if arch != "llama":
            raise SystemExit(f"{path}: architecture {arch!r}, this reference is for llama")
        self.n_layer = int(field(r, "llama.block_count"))
        self.n_embd = int(field(r, "llama.embedding_length"))
        self.n_head = int(field(r, "llama.attention.head_count"))
        self.n_kv = int(field(r, "llama.attention.head_count_kv"))
        self.eps = float(field(r, "llama.attention.layer_norm_rms_epsilon"))
        self.base = float(field(r, "llama.rope.freq_base"))
        self.head_dim = self.n_embd // self.n_head
        self.w = {}
        for t in r.tensors:
            a = dequantize(t.data, t.tensor_type).astype(np.float64)
            # GGUF lists dimensions innermost first: a matrix [cols, rows] is rows x cols here.
            self.w[t.name] = a.reshape([int(d) for d in reversed(t.shape)])
        self.out = self.w.get("output.weight", self.w["token_embd.weight"])

    def rms(self, x, w):
        return x / np.sqrt(np.mean(x * x) + self.eps) * w

    def rope(self, x, pos):
        # Adjacent pairs (x[2i], x[2i + 1]) rotate by pos * base^(-2i / head_dim): GGUF's llama
        # weights are stored for this layout.
        d = self.head_dim
        theta = pos * self.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        c, s = np.cos(theta), np.sin(theta)
        x = x.reshape(-1, d // 2, 2)
        a, b = x[..., 0], x[..., 1]
        return np.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(-1, d)

    def new_cache(self):
        return [([], []) for _ in range(self.n_layer)]

    def step(self, token, pos, cache):
        """Logits after token at position pos; appends its keys and values to cache."""
        d, g = self.head_dim, self.n_head // self.n_kv
        x = self.w["token_embd.weight"][token].copy()
        for i in range(self.n_layer):
            p = f"blk.{i}."
            h = self.rms(x, self.w[p + "attn_norm.weight"])
            q = self.rope((self.w[p + "attn_q.weight"] @ h).reshape(self.n_head, d), pos)
            k = self.rope((self.w[p + "attn_k.weight"] @ h).reshape(self.n_kv, d), pos)
            v = (self.w[p + "attn_v.weight"] @ h).reshape(self.n_kv, d)
            ks, vs = cache[i]
            ks.append(k.astype(np.float16).astype(np.float64))
            vs.append(v.astype(np.float16).astype(np.float64))
            K, V = np.stack(ks), np.stack(vs)  # [positions, kv heads, d]
            out = np.empty((self.n_head, d))
            for hd in range(self.n_head):
                s = K[:, hd // g, :] @ q[hd] / np.sqrt(d)
                e = np.exp(s - s.max())
                out[hd] = (e / e.sum()) @ V[:, hd // g, :]
            x = x + self.w[p + "attn_output.weight"] @ out.reshape(-1)
            h = self.rms(x, self.w[p + "ffn_norm.weight"])
            gate = self.w[p + "ffn_gate.weight"] @ h
            up = self.w[p + "ffn_up.weight"] @ h
            x = x + self.w[p + "ffn_down.weight"] @ (gate / (1.0 + np.exp(-gate)) * up)
        return self.out @ self.rms(x, self.w["output_norm.weight"])


def top_n(logits, n):
    order = np.argsort(-logits, kind="stable")  # ties: lowest id first
    return [int(i) for i in order[:n]]


def generate(model, prompt_tokens):
    cache = model.new_cache()
    for pos, t in enumerate(prompt_tokens):
        logits = model.step(t, pos, cache)
    top = [{"token": t, "logit": float(logits[t])} for t in top_n(logits, N_TOP)]
    tokens, margins = [], []
    pos = len(prompt_tokens)
    for step in range(N_PREDICT):
        first, second = top_n(logits, 2)
        tokens.append(first)
        margins.append(float(logits[first] - logits[second]))
        if step + 1 == N_PREDICT:
            break
        logits = model.step(first, pos, cache)
        pos += 1
    return tokens, top, margins


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--goldens", default=os.path.join(here, "smollm2-135m-instruct-q4_1"))
    args = ap.parse_args()
    with open(os.path.join(args.goldens, "generate.json"), encoding="utf-8") as f:
        golden = json.load(f)
    h = hashlib.sha256()
    with open(args.model, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != golden["model_sha256"]:
        raise SystemExit(f"{args.model} is not the model generate.json was made with")
    model = Model(args.model)
    cases = []
    for case in golden["cases"]:
        tokens, top, margins = generate(model, case["prompt_tokens"])
        same = next((i for i, (a, b) in enumerate(zip(tokens, case["tokens"])) if a != b), len(tokens))
        print(f"{case['name']}: {len(case['prompt_tokens'])} prompt tokens; greedy tokens equal "
              f"llama.cpp's for {same} of {len(tokens)} steps")
        cases.append({"name": case["name"], "prompt_tokens": case["prompt_tokens"], "tokens": tokens,
                      "margins": margins, "top_logits": top})
    out = {"model": os.path.basename(args.model), "model_sha256": golden["model_sha256"],
           "arithmetic": "float64 from the dequantized weights; keys and values rounded to float16",
           "n_predict": N_PREDICT, "cases": cases}
    path = os.path.join(args.goldens, "exact.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
