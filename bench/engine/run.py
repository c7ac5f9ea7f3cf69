#!/usr/bin/env python3
"""Engine benchmark: batchlm's embedded engine against llama.cpp on the same GGUF model.

Both run on the CPU with the same thread count, in this one invocation, alternating
repetitions. For each engine two figures are measured on a single sequence:

  pp  prompt processing: a prompt of exactly --pp tokens (512) decoded as one batch
  tg  generation: --tg tokens (128) generated greedily after that prompt, one at a time

llama.cpp runs in this process through llama-cpp-python (C API, a fresh context per repetition,
n_batch = n_ubatch = 512, flash attention off, f16 KV cache); its figures come from
llama_perf_context(): pp = n_p_eval / t_p_eval, tg = n_eval / t_eval. batchlm runs as
  batchlm generate -m MODEL -f PROMPT_FILE --max-tokens TG --ignore-eos --temperature 0
          --threads N --timings
and its figures come from the JSON line --timings prints on stderr.

Usage (from the repository root, with the venv from tests/reference/setup.sh):
  .venv/bin/python bench/engine/run.py [--threads 2] [--reps 3] [--write]
"""

import argparse
import ctypes
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import llama_cpp

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
from llama_c import decode, fresh_context, last_logits  # noqa: E402  (the shared C-API helpers)
from machine import cpu_model, git_commit  # noqa: E402  (shared with the other benchmark)

# Written for this benchmark; repeated and cut to exactly --pp tokens.
PARAGRAPH = (
    "The river rose early that spring. By the first week of April the water had covered the "
    "lower meadow, and the miller, who had seen many floods, moved his sacks of grain to the "
    "loft above the wheel. His daughter kept a record of the height of the water on a post "
    "by the bridge, marking it each morning with a knife: on Monday it stood at four feet, "
    "on Tuesday at five, and on Wednesday it reached the mark her grandfather had cut forty "
    "years before. The neighbours came to look at the post and shook their heads. Some said "
    "the snow in the hills had melted too quickly; others blamed the new dam upstream, which "
    "had been finished the autumn before. On Thursday the rain stopped, the wind turned to "
    "the north, and by Sunday the meadow was green again, though a thin line of mud and "
    "broken reeds showed where the water had been. "
)


# ----------------------------------------------------------------------------------------------
# llama.cpp through the C API of llama-cpp-python


class LlamaCpp:
    def __init__(self, model_path, threads, n_ctx, n_batch):
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(model_path.encode(), mp)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {model_path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.threads, self.n_ctx, self.n_batch = threads, n_ctx, n_batch

    def tokenize(self, text):
        data = text.encode("utf-8")
        buf = (llama_cpp.llama_token * (len(data) + 16))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, False)
        if n < 0:
            raise RuntimeError("llama_tokenize failed")
        return list(buf[:n])

    def detokenize(self, tokens, special=False):
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        size = 16 * len(tokens) + 16
        out = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(self.vocab, arr, len(tokens), out, size, False, special)
        if n < 0:
            raise RuntimeError("llama_detokenize failed")
        return out.raw[:n].decode("utf-8", errors="replace")

    def run(self, prompt_tokens, n_gen):
        """One repetition in a fresh context: returns figures and the generated tokens."""
        with fresh_context(self.model, self.n_ctx, self.n_batch, self.threads, perf=True) as (ctx, batch):
            llama_cpp.llama_perf_context_reset(ctx)

            def decode_argmax(tokens, n_past):
                decode(ctx, batch, tokens, n_past)
                return int(np.argmax(last_logits(ctx, self.n_vocab)))

            t0 = time.perf_counter()
            n_past = 0
            for i in range(0, len(prompt_tokens), self.n_batch):
                chunk = prompt_tokens[i:i + self.n_batch]
                tok = decode_argmax(chunk, n_past)
                n_past += len(chunk)
            t1 = time.perf_counter()
            generated = []
            for _ in range(n_gen):   # every generated token is fed back, as llama-bench's tg
                generated.append(tok)
                tok = decode_argmax([tok], n_past)
                n_past += 1
            t2 = time.perf_counter()
            perf = llama_cpp.llama_perf_context(ctx)
        if perf.n_p_eval != len(prompt_tokens) or perf.n_eval != n_gen:
            raise RuntimeError(f"unexpected perf counters: n_p_eval {perf.n_p_eval}, "
                               f"n_eval {perf.n_eval}")
        return {
            "prompt_tokens": perf.n_p_eval,
            "prompt_ms": perf.t_p_eval_ms,
            "generated_tokens": perf.n_eval,
            "generate_ms": perf.t_eval_ms,
            "prompt_tok_s": 1000.0 * perf.n_p_eval / perf.t_p_eval_ms,
            "generate_tok_s": 1000.0 * perf.n_eval / perf.t_eval_ms,
            "wall_prompt_ms": 1000.0 * (t1 - t0),
            "wall_generate_ms": 1000.0 * (t2 - t1),
        }, generated


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet_log(level, text, user_data):
    if level == 4:   # GGML_LOG_LEVEL_ERROR
        sys.stderr.write(text.decode("utf-8", errors="replace"))


# ----------------------------------------------------------------------------------------------
# batchlm as a child process


def run_batchlm(exe, model, prompt_file, n_gen, threads):
    cmd = [exe, "generate", "-m", model, "-f", prompt_file, "--max-tokens", str(n_gen),
           "--ignore-eos", "--temperature", "0", "--threads", str(threads), "--timings"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n"
                           f"{proc.stderr[-2000:]}")
    timings = None
    for line in proc.stderr.splitlines():
        if line.startswith("{"):
            try:
                timings = json.loads(line)
            except json.JSONDecodeError:
                pass
    if timings is None:
        raise RuntimeError(f"no JSON timings line on the stderr of {' '.join(cmd)}:\n"
                           f"{proc.stderr[-2000:]}")
    for key in ("prompt_tokens", "prompt_ms", "generated_tokens", "generate_ms",
                "prompt_tok_s", "generate_tok_s"):
        if key not in timings:
            raise RuntimeError(f"batchlm --timings line lacks {key!r}: {timings}")
    timings["wall_process_ms"] = 1000.0 * wall
    return timings, proc.stdout


# ----------------------------------------------------------------------------------------------


def make_prompt(llama, n_tokens):
    """A text that llama.cpp tokenizes (add_bos=False, special=False) to exactly n_tokens."""
    text = PARAGRAPH
    while len(llama.tokenize(text)) < n_tokens + 64:
        text += PARAGRAPH
    tokens = llama.tokenize(text)
    for extra in range(0, 32):   # cutting at a token boundary almost always round-trips
        cut = llama.detokenize(tokens[:n_tokens + extra])
        again = llama.tokenize(cut)
        if len(again) == n_tokens:
            return cut, again
    raise SystemExit(f"could not build a prompt of exactly {n_tokens} tokens")


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def batchlm_version(exe):
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None


def fmt(s):
    return f"{s['median']:8.1f} ({s['min']:.1f}-{s['max']:.1f})"


def main():
    ap = argparse.ArgumentParser(
        description="batchlm's engine against llama.cpp: prompt processing and generation "
                    "tokens/s on one GGUF model, same threads, one run.")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    ap.add_argument("--reps", type=int, default=3, help="measured repetitions (default 3)")
    ap.add_argument("--batchlm", default="build/release/bin/batchlm",
                    help="batchlm executable (default %(default)s)")
    ap.add_argument("--only", choices=["llama", "batchlm"], help="run one engine only")
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--tg", type=int, default=128, help="generated tokens (default 128)")
    ap.add_argument("--ctx", type=int, default=2048, help="llama.cpp n_ctx (default 2048)")
    ap.add_argument("--write", action="store_true",
                    help="write bench/engine/results.json")
    args = ap.parse_args()
    if args.pp > 512:
        ap.error("--pp above 512 would not be one batch")
    if not os.path.exists(args.model):
        ap.error(f"no model at {args.model}")
    engines = [args.only] if args.only else ["llama", "batchlm"]
    if "batchlm" in engines and not os.access(args.batchlm, os.X_OK):
        ap.error(f"no batchlm executable at {args.batchlm} (scripts/build.sh release), "
                 f"or use --only llama")

    llama = LlamaCpp(args.model, args.threads, args.ctx, 512)
    prompt, prompt_tokens = make_prompt(llama, args.pp)
    tmp = tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", prefix="pp",
                                      delete=False)
    with tmp:
        tmp.write(prompt)
    load_start = os.getloadavg()
    print(f"model {os.path.basename(args.model)}, {args.threads} threads, prompt "
          f"{len(prompt_tokens)} tokens ({len(prompt)} chars), {args.tg} generated, "
          f"{args.reps} reps + 1 warm-up, load average {load_start[0]:.2f}", file=sys.stderr)

    runs = {e: [] for e in engines}
    texts = {}
    try:
        for rep in range(args.reps + 1):   # rep 0 is the warm-up
            for engine in engines:
                if engine == "llama":
                    r, generated = llama.run(prompt_tokens, args.tg)
                    texts["llama"] = llama.detokenize(generated)
                else:
                    r, texts["batchlm"] = run_batchlm(args.batchlm, args.model, tmp.name,
                                                      args.tg, args.threads)
                label = "warm-up" if rep == 0 else f"rep {rep}"
                print(f"  {label:7} {engine:8} pp {r['prompt_tok_s']:8.1f} tok/s "
                      f"({r['prompt_tokens']} tokens), tg {r['generate_tok_s']:7.1f} tok/s "
                      f"({r['generated_tokens']} tokens)", file=sys.stderr)
                if rep > 0:
                    runs[engine].append(r)
    finally:
        os.unlink(tmp.name)
    load_end = os.getloadavg()

    results = {}
    for engine, rs in runs.items():
        results[engine] = {
            "prompt_tokens": rs[0]["prompt_tokens"],
            "generated_tokens": rs[0]["generated_tokens"],
            "pp_tok_s": summary([r["prompt_tok_s"] for r in rs]),
            "tg_tok_s": summary([r["generate_tok_s"] for r in rs]),
            "runs": rs,
        }

    names = {"llama": "llama.cpp", "batchlm": "batchlm"}
    head = f"| {'test':10} |" + "".join(f" {names[e] + ' tok/s':>26} |" for e in engines)
    if len(engines) == 2:
        head += " batchlm / llama.cpp |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for key, label in (("pp_tok_s", f"pp{args.pp}"), ("tg_tok_s", f"tg{args.tg}")):
        row = f"| {label:10} |" + "".join(f" {fmt(results[e][key]):>26} |" for e in engines)
        if len(engines) == 2:
            ratio = results["batchlm"][key]["median"] / results["llama"][key]["median"]
            row += f" {ratio:18.2f}x |"
            results.setdefault("ratio_batchlm_over_llama", {})[key] = ratio
        print(row)
    print("(median of the repetitions, min-max in brackets)")
    if len(engines) == 2:
        same = texts["batchlm"].rstrip("\n") == texts["llama"].rstrip("\n")
        results["same_completion"] = same
        print(f"batchlm's completion {'equals' if same else 'differs from'} llama.cpp's "
              f"greedy continuation")
        if results["batchlm"]["prompt_tokens"] != len(prompt_tokens):
            print(f"note: batchlm counted {results['batchlm']['prompt_tokens']} prompt tokens, "
                  f"llama.cpp {len(prompt_tokens)}")

    if args.write:
        commit, dirty = git_commit()
        out = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {
                "cpu": cpu_model(),
                "cpus": os.cpu_count(),
                "system": f"{platform.system()} {platform.release()}",
                "load_average_start": load_start[0],
                "load_average_end": load_end[0],
                "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
            },
            "git_commit": commit,
            "git_dirty": dirty,
            "versions": {
                "python": platform.python_version(),
                "llama_cpp_python": llama_cpp.__version__,
                "batchlm": batchlm_version(args.batchlm) if "batchlm" in engines else None,
            },
            "model": os.path.basename(args.model),
            "threads": args.threads,
            "reps": args.reps,
            "pp": args.pp,
            "tg": args.tg,
            "llama_cpp_settings": {"n_ctx": args.ctx, "n_batch": 512, "n_ubatch": 512,
                                   "flash_attn": False, "type_k": "f16", "type_v": "f16"},
            "results": results,
        }
        path = os.path.join(ROOT, "bench", "engine", "results.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(f"wrote {os.path.relpath(path)}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:
        sys.exit(f"run.py: {e}")
