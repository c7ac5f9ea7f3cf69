#!/usr/bin/env python3
"""Speculative decoding benchmark: the embedded engine with and without drafting, one run.

Each configuration runs against the same engine without speculation (method none), on the same
machine, in this one invocation, with the same items, concurrency and max_tokens:

  proofread  jobs/proofread.yaml (input-grounded: the output copies the input), method ngram
  gsm8k      jobs/gsm8k.yaml (8-shot chain of thought), methods self (early-exit self-draft
             from the model's first backend.speculative.layers layers) and draft (the model
             as its own draft: every draft is accepted, the ceiling for acceptance)

For every job and concurrency level the baseline runs first, then each method:

  batchlm run JOB --limit Q -c C --fresh --output OUT/JOB-METHOD-cC.jsonl
              --set backend.speculative.method=METHOD
              [--set backend.speculative.model=DRAFT k_min=k_max=4]  (method draft)
              [--set request.max_tokens=M] [--set backend.threads=T] [--set KEY=VALUE ...]

Figures come from the summary each run writes next to its output (OUT/...jsonl.summary.json):
wall seconds and output tokens/s (completion tokens / wall time; model loading is not in the
wall time), and from its engine.speculative object: acceptance rate (accepted / drafted
tokens), tokens per target pass (tokens the target model produced per verification pass; 1.0
without speculation) and draft time share (the part of engine time spent drafting). Speedup is
a method's output tokens/s over the baseline's at the same job and concurrency. Decoding is
greedy and speculation verifies every token against the target model, so each output must equal
the baseline's; the script counts the identical ones by item id. Only one batchlm process runs
at a time.

Usage (from the repository root; stdlib only, any Python 3.11):
  scripts/build.sh release                # build/release/bin/batchlm
  python3 bench/engine/spec.py [--questions 32] [--concurrency 1,8] [--jobs proofread,gsm8k]
                               [--max-tokens M] [--write]
"""

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import finish, git_commit, results_header, write_results  # noqa: E402  (shared with the other benchmarks)
from serve import Child, read_outputs, sha256_file, version_of  # noqa: E402  (same helpers)

RESULTS = os.path.join(ROOT, "bench", "engine", "spec-results.json")
JOBS = {
    "proofread": os.path.join(ROOT, "jobs", "proofread.yaml"),
    "gsm8k": os.path.join(ROOT, "jobs", "gsm8k.yaml"),
}
JOB_MAX_TOKENS = {"proofread": 256, "gsm8k": 512}   # the jobs' own request.max_tokens
DEFAULT_METHODS = {"proofread": ("ngram",), "gsm8k": ("self", "draft")}
METHODS = ("ngram", "self", "draft")
BASELINE = "none"


class BenchError(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------
# one run


def rel(path):
    """path relative to the repository root where it lies inside it (runs start there)."""
    r = os.path.relpath(path, ROOT)
    return path if r.startswith("..") else r


def command(args, job, method, concurrency, out):
    cmd = [args.batchlm, "run", rel(JOBS[job]), "--limit", str(args.questions),
           "-c", str(concurrency), "--fresh", "--output", out,
           "--set", f"backend.speculative.method={method}"]
    if method == "draft":
        # The model as its own draft is the ceiling for acceptance: it drafts every step
        # (k_min = k_max), where the adaptive length would stop it for costing a target pass.
        cmd += ["--set", f"backend.speculative.model={rel(args.draft_model)}",
                "--set", "backend.speculative.k_min=4", "--set", "backend.speculative.k_max=4"]
    if args.max_tokens is not None:
        cmd += ["--set", f"request.max_tokens={args.max_tokens}"]
    if args.threads is not None:
        cmd += ["--set", f"backend.threads={args.threads}"]
    for kv in args.set:
        cmd += ["--set", kv]
    return cmd


def run_one(args, job, method, concurrency, outdir, live):
    """One batchlm run; returns the figures of its summary."""
    out = os.path.join(outdir, f"{job}-{method}-c{concurrency}.jsonl")
    for stale in (out, out + ".summary.json"):   # from an earlier run into the same --out
        if os.path.exists(stale):
            os.remove(stale)
    cmd = command(args, job, method, concurrency, out)
    env = dict(os.environ, BATCHLM_DATA=args.data)
    t0 = time.monotonic()
    child = Child(f"{job}-{method}-c{concurrency}", cmd, out + ".log", env=env)
    live.append(child)
    try:
        rc = child.wait()
    finally:
        live.remove(child)
        child.stop()
    process_seconds = time.monotonic() - t0
    if rc not in (0, 1):   # 1: finished, some items failed (counted below)
        raise BenchError(f"batchlm run exited with {rc}; {out}.log:\n{child.tail()}")
    try:
        with open(out + ".summary.json", encoding="utf-8") as f:
            s = json.load(f)
    except (OSError, ValueError) as e:
        raise BenchError(f"no summary from batchlm run ({e}); {out}.log:\n{child.tail()}")
    engine = s.get("engine") or {}
    spec = engine.get("speculative")
    if method != BASELINE and not spec:
        raise BenchError(f"the summary has no engine.speculative object for method {method}; "
                         f"{out}.summary.json (backend: {s.get('backend')})")
    acc = s.get("accuracy") or {}
    return {
        "job": job,
        "method": method,
        "concurrency": concurrency,
        "questions": args.questions,
        "succeeded": s["counts"]["succeeded"],
        "failed": s["counts"]["failed"],
        "failures": s.get("failures", {}),
        "wall_seconds": s["wall_seconds"],
        "process_seconds": round(process_seconds, 3),
        "prompt_tokens": s["tokens"]["prompt"],
        "completion_tokens": s["tokens"]["completion"],
        "output_tok_s": s["throughput"]["output_tokens_per_second"],
        "speculative": spec,
        "engine": {k: v for k, v in engine.items() if k != "speculative"},
        "accuracy_strict": (acc.get("strict") or {}).get("accuracy"),
        "accuracy_flexible": (acc.get("flexible") or {}).get("accuracy"),
        "latency_ms": s.get("latency_ms"),
        "attempts": s.get("attempts"),
        "backend": s.get("backend"),
        "exit_status": rc,
        "command": shlex.join(cmd),
        "output": out,
    }


def compare_to_baseline(results):
    """Speedup and identical outputs of every run against the none run of its job and level."""
    base = {(r["job"], r["concurrency"]): r for r in results if r["method"] == BASELINE}
    for r in results:
        b = base.get((r["job"], r["concurrency"]))
        if b is None or r["method"] == BASELINE:
            continue
        if b["output_tok_s"] > 0:
            r["speedup"] = r["output_tok_s"] / b["output_tok_s"]
        if r["wall_seconds"] > 0:
            r["wall_ratio"] = b["wall_seconds"] / r["wall_seconds"]
        mine, ref = read_outputs(r["output"]), read_outputs(b["output"])
        common = [i for i in ref if i in mine and ref[i] is not None and mine[i] is not None]
        differing = [i for i in common if mine[i] != ref[i]]
        r["identical_to_none"] = {"same": len(common) - len(differing), "compared": len(common),
                                  "differing_ids": differing[:20]}


# ----------------------------------------------------------------------------------------------
# report


def fmt(x, spec="{:.2f}", none="-"):
    return none if x is None else spec.format(x)


def print_table(results):
    head = ["job", "method", "conc.", "items", "wall s", "out tok/s", "speedup", "acceptance",
            "tokens/pass", "draft share", "same as none"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|")
    for r in results:
        spec = r.get("speculative") or {}
        same = r.get("identical_to_none")
        failed = f" ({r['failed']} failed)" if r.get("failed") else ""
        print("| " + " | ".join([
            r["job"], r["method"], str(r["concurrency"]), f"{r['succeeded']}{failed}",
            f"{r['wall_seconds']:.1f}", f"{r['output_tok_s']:.1f}",
            "1.00x" if r["method"] == BASELINE else fmt(r.get("speedup"), "{:.2f}x"),
            fmt(spec.get("acceptance_rate"), "{:.1%}"),
            fmt(spec.get("tokens_per_pass")) if spec else "1.00",
            fmt(spec.get("draft_time_share"), "{:.1%}"),
            f"{same['same']}/{same['compared']}" if same else "-",
        ]) + " |")
    print("(out tok/s: completion tokens / wall time of the run, model loading excluded; speedup: "
          "out tok/s over the none run of the same job and concurrency; acceptance: accepted / "
          "drafted tokens; tokens/pass: tokens produced per target-model pass; draft share: part "
          "of engine time spent drafting; same as none: outputs identical to the none run's)")


# ----------------------------------------------------------------------------------------------


def parse_args():
    ap = argparse.ArgumentParser(
        description="Speculative decoding on the embedded engine: ngram on the proofread job, "
                    "self-draft and the model as its own draft on GSM8K, each against the same "
                    "engine without speculation, one run.")
    ap.add_argument("--batchlm", default=os.path.join(ROOT, "build/release/bin/batchlm"),
                    help="batchlm executable (default build/release/bin/batchlm)")
    ap.add_argument("--jobs", default="proofread,gsm8k",
                    help="comma-separated: proofread, gsm8k (default both)")
    ap.add_argument("--methods",
                    help="comma-separated methods to run against none for every job (ngram, "
                         "self, draft; default: ngram for proofread, self,draft for gsm8k)")
    ap.add_argument("--concurrency", default="1,8",
                    help="comma-separated concurrency levels (default 1,8)")
    ap.add_argument("--questions", type=int, default=32,
                    help="items per run (the first N of the job's input; default 32)")
    ap.add_argument("--max-tokens", type=int,
                    help="override the jobs' max_tokens (proofread 256, gsm8k 512): "
                         "--set request.max_tokens=M")
    ap.add_argument("--threads", type=int,
                    help="engine threads: --set backend.threads=T (default: the engine's)")
    ap.add_argument("--draft-model",
                    default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"),
                    help="GGUF for method draft (default models/SmolLM2-135M-Instruct.Q4_1.gguf,"
                         " the default model itself)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra job override for every run, as batchlm run --set (repeatable)")
    ap.add_argument("--data", default=os.environ.get("BATCHLM_DATA") or
                    os.path.normpath(os.path.join(ROOT, "..", "shared", "data")),
                    help="data directory with gsm8k/test.jsonl and train.jsonl (BATCHLM_DATA; "
                         "default ../shared/data)")
    ap.add_argument("--out", help="directory for the outputs and logs (default: a temporary "
                                  "directory, removed at the end unless --keep or a run failed)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--write", action="store_true", help="write bench/engine/spec-results.json")
    args = ap.parse_args()

    try:
        args.levels = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}")
    if not args.levels or args.levels[0] < 1:
        ap.error("--concurrency: levels must be 1 or more")
    names = [j.strip() for j in args.jobs.split(",") if j.strip()]
    for j in names:
        if j not in JOBS:
            ap.error(f"--jobs: unknown job {j!r} ({', '.join(JOBS)})")
    args.job_list = [j for j in JOBS if j in names]   # proofread first, no repeats
    if not args.job_list:
        ap.error("--jobs: none given")
    if args.methods is None:
        args.plan = {j: list(DEFAULT_METHODS[j]) for j in args.job_list}
    else:
        names = [m.strip() for m in args.methods.split(",") if m.strip()]
        for m in names:
            if m not in METHODS:
                ap.error(f"--methods: unknown method {m!r} ({', '.join(METHODS)}; none always "
                         f"runs as the baseline)")
        args.plan = {j: [m for m in METHODS if m in names] for j in args.job_list}
    if args.questions < 1:
        ap.error("--questions must be 1 or more")
    if args.max_tokens is not None and args.max_tokens < 1:
        ap.error("--max-tokens must be 1 or more")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be 1 or more")
    for kv in args.set:
        if "=" not in kv:
            ap.error(f"--set: expected KEY=VALUE, got {kv!r}")
    for name in ("batchlm", "draft_model", "data"):
        setattr(args, name, os.path.abspath(getattr(args, name)))
    if not (os.path.isfile(args.batchlm) and os.access(args.batchlm, os.X_OK)):
        ap.error(f"no batchlm executable at {args.batchlm} (scripts/build.sh release, or "
                 f"--batchlm PATH)")
    if any("draft" in ms for ms in args.plan.values()) and not os.path.isfile(args.draft_model):
        ap.error(f"no draft model at {args.draft_model} (scripts/fetch-model.sh, or "
                 f"--draft-model PATH)")
    for j in args.job_list:
        if not os.path.isfile(JOBS[j]):
            ap.error(f"no job file {rel(JOBS[j])}")
    for f in ("test.jsonl", "train.jsonl"):
        if not os.path.isfile(os.path.join(args.data, "gsm8k", f)):
            ap.error(f"no {os.path.join(args.data, 'gsm8k', f)} (--data or BATCHLM_DATA)")
    return args


def _sigterm(signum, frame):
    """SIGTERM to this script ends it like Ctrl-C: the finally blocks stop the child."""
    raise KeyboardInterrupt


def main():
    args = parse_args()
    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)   # even where started with it ignored

    temp = args.out is None
    outdir = tempfile.mkdtemp(prefix="batchlm-spec-bench-") if temp else os.path.abspath(args.out)
    os.makedirs(outdir, exist_ok=True)
    load_start = os.getloadavg()
    checkout = git_commit()  # what is built and measured; edits made during the run do not count
    plan = "; ".join(f"{j}: none, {', '.join(ms) or '(no method)'}" for j, ms in args.plan.items())
    print(f"{plan}; concurrency {','.join(map(str, args.levels))}, {args.questions} items per run,"
          f" max_tokens {args.max_tokens if args.max_tokens is not None else 'from the job'}, "
          f"outputs in {outdir}, load average {load_start[0]:.2f}", file=sys.stderr)

    results, errors = [], []
    live = []            # the batchlm process running now (one at most)
    interrupted = False
    started = time.monotonic()
    try:
        for job in args.job_list:
            for c in args.levels:
                for method in [BASELINE] + args.plan[job]:
                    print(f"  {job:9} {method:5} c={c:<3} ...", end="", file=sys.stderr,
                          flush=True)
                    try:
                        r = run_one(args, job, method, c, outdir, live)
                    except BenchError as e:
                        print(" failed", file=sys.stderr)
                        print(f"spec.py: {job} {method} c={c}: {e}", file=sys.stderr)
                        errors.append({"job": job, "method": method, "concurrency": c,
                                       "error": str(e)[:2000]})
                        continue
                    results.append(r)
                    spec = r["speculative"] or {}
                    print(f" {r['wall_seconds']:.1f} s, {r['output_tok_s']:.1f} out tok/s"
                          + (f", acceptance {fmt(spec.get('acceptance_rate'), '{:.1%}')}, "
                             f"{fmt(spec.get('tokens_per_pass'))} tokens/pass" if spec else "")
                          + (f", {r['failed']} failed" if r["failed"] else ""),
                          file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
        print("\nspec.py: interrupted; stopping batchlm", file=sys.stderr)
    finally:
        for child in list(live):
            child.stop()
            live.remove(child)
    load_end = os.getloadavg()

    if results:
        compare_to_baseline(results)
        print_table(results)
    differing = [r for r in results
                 if r.get("identical_to_none")
                 and r["identical_to_none"]["same"] != r["identical_to_none"]["compared"]]
    if differing:
        print("spec.py: warning: outputs differ from the none run's in " +
              ", ".join(f"{r['job']} {r['method']} c={r['concurrency']} "
                        f"(ids {', '.join(r['identical_to_none']['differing_ids'])})"
                        for r in differing) +
              "; greedy decoding with speculation should reproduce them exactly", file=sys.stderr)
    incomplete = [r for r in results if r["failed"] or r["succeeded"] != r["questions"]]
    if incomplete:
        print("spec.py: warning: not every item succeeded in " +
              ", ".join(f"{r['job']} {r['method']} c={r['concurrency']}" for r in incomplete) +
              " (the *.jsonl.log files and the records' error fields say why)", file=sys.stderr)
    if errors:
        print(f"spec.py: {len(errors)} run(s) failed: " +
              ", ".join(f"{e['job']} {e['method']} c={e['concurrency']}" for e in errors),
              file=sys.stderr)

    if args.write and results:
        uses_draft = any(r["method"] == "draft" for r in results)
        doc = results_header(interrupted, load_start[0], load_end[0],
                             {"batchlm": version_of(args.batchlm)}, checkout)
        doc.update({
            "batchlm_model_env": os.environ.get("BATCHLM_MODEL"),
            "draft_model": rel(args.draft_model) if uses_draft else None,
            "draft_model_sha256": sha256_file(args.draft_model) if uses_draft else None,
            "settings": {
                "jobs": {j: rel(JOBS[j]) for j in args.job_list},
                "methods": args.plan,
                "concurrency": args.levels,
                "questions": args.questions,
                "max_tokens": args.max_tokens if args.max_tokens is not None else
                {j: f"job ({JOB_MAX_TOKENS[j]})" for j in args.job_list},
                "threads": args.threads if args.threads is not None else "engine default",
                "extra_sets": args.set,
            },
        })
        write_results(RESULTS, ROOT, doc, started, results, errors)

    return finish("spec.py", outdir, temp, args.keep, errors, interrupted)


if __name__ == "__main__":
    sys.exit(main())
