#!/usr/bin/env python3
"""Decode throughput of Hugging Face transformers on the same GGUF model and GPU, as the peer of
bench/gpu/engine_bench (same prompts' length, greedy, a fixed number of new tokens).

    python3 bench/gpu/peer_transformers.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --sequences 1,8,64,256 --tokens 128

transformers reads GGUF through the `gguf` package and dequantizes the weights to the dtype
asked for (float16 here): it runs the same network, not the same quantized arithmetic.
"""
import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--sequences", default="1,8,64,256")
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()

    path = os.path.abspath(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float16
    ).to("cuda")
    model.eval()
    vocab = model.config.vocab_size
    print(f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'sequences':>10} {'decode tok/s':>14} {'total s':>10}")
    for n in [int(s) for s in args.sequences.split(",")]:
        # 16-token prompts, distinct per sequence, as engine_bench makes them.
        ids = torch.tensor([[(s * 7919 + i * 104729) % vocab for i in range(16)] for s in range(n)],
                           device="cuda")
        mask = torch.ones_like(ids)
        kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, **kwargs)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
        new = (out.shape[1] - ids.shape[1]) * n
        # Decode rate: the run minus a prefill-and-first-token run, over the tokens after the first.
        decode = (new - n) / max((t2 - t1) - (t1 - t0), 1e-9)
        print(f"{n:>10} {decode:>14.0f} {t2 - t1:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
