#!/usr/bin/env python3
"""Serving benchmark: `batchlm serve` against llama.cpp's `llama-server` on GSM8K.

Both servers run on the CPU with the same model and thread count, in this one invocation, at
several concurrency levels. For each level and each server, the server is started with as many
sequence slots as the concurrency:

  batchlm serve --model MODEL --host 127.0.0.1 --port 0 --threads T --max-sequences N
  llama-server  -m MODEL --host 127.0.0.1 --port P -t T --parallel N -c N*CTX_PER_SLOT

and the same load generator, batchlm's own client, runs GSM8K (jobs/gsm8k.yaml: 8-shot chain of
thought, temperature 0, up to 512 output tokens) against it:

  batchlm run jobs/gsm8k.yaml --base-url http://127.0.0.1:P/v1 --model NAME --concurrency N
              --limit Q --fresh -o OUT/SERVER-cN.jsonl

Figures come from the summary that run writes next to its output (OUT/SERVER-cN.jsonl.summary.json):
output tokens/s (completion tokens as the server reports them / wall time of the run),
questions/min (succeeded items / wall time), GSM8K accuracy (strict "#### N" and flexible last
number). Decoding is greedy, so a server's outputs at concurrency N should equal its outputs at
concurrency 1; the number of identical outputs (by item id, over the questions both runs have)
is reported too. Levels run in increasing order, both servers at one level before the next.
The servers are stopped with SIGTERM (SIGKILL after 10 s) after each run, and on any exit.

Usage (from the repository root; stdlib only, any Python 3.11):
  bench/engine/setup-llama-server.sh      # bench/engine/.llama-server/bin/llama-server
  scripts/build.sh release                # build/release/bin/batchlm
  python3 bench/engine/serve.py [--concurrency 1,8,32,64] [--questions 200] [--write]
"""

import argparse
import ctypes
import hashlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import finish, git_commit, results_header, write_results  # noqa: E402  (shared with the other benchmark)
RESULTS = os.path.join(ROOT, "bench", "engine", "serve-results.json")
JOB = os.path.join(ROOT, "jobs", "gsm8k.yaml")
SERVERS = ("batchlm", "llama")
LABELS = {"batchlm": "batchlm serve", "llama": "llama-server"}
LISTENING = re.compile(r"batchlm serve: listening on http://[^\s/]*:(\d+)/v1")
STOP_GRACE_S = 10


class BenchError(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------
# child processes


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None


def _die_with_parent():
    """In the child, before exec: SIGTERM when this script dies (PR_SET_PDEATHSIG). Children
    also get their own session, so a Ctrl-C at the terminal reaches only this script, which
    then stops them itself."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM, 0, 0, 0)


class Child:
    """A child process with its stdout and stderr in one log file."""

    def __init__(self, name, cmd, log_path, env=None, on_line=None):
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self.term_sent = None
        self.log = open(log_path, "w", encoding="utf-8", errors="replace")
        self.log.write("$ " + shlex.join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        self.reader = threading.Thread(target=self._pump, args=(on_line,), daemon=True)
        self.reader.start()

    def _pump(self, on_line):
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", errors="replace")
            self.log.write(line)
            self.log.flush()
            if on_line:
                on_line(line)

    def running(self):
        return self.proc.poll() is None

    def wait(self, timeout=None):
        rc = self.proc.wait(timeout)
        self.reader.join(5)
        return rc

    def terminate(self):
        """Sends SIGTERM once (if it runs); stop() then waits for it."""
        if self.running() and self.term_sent is None:
            self.term_sent = time.monotonic()
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self):
        """SIGTERM, then SIGKILL STOP_GRACE_S after the SIGTERM; returns (exit status, seconds
        from SIGTERM to exit, whether it had to be killed)."""
        self.terminate()
        t0 = self.term_sent if self.term_sent is not None else time.monotonic()
        killed = False
        try:
            self.proc.wait(max(0.0, t0 + STOP_GRACE_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed = True
            self.proc.kill()
            self.proc.wait()
        self.reader.join(5)
        self.log.close()
        return self.proc.returncode, time.monotonic() - t0, killed

    def tail(self, n=30):
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=2.0):
    """(status, body) of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, b""


# ----------------------------------------------------------------------------------------------
# the servers


class Server:
    """One server process for one concurrency level: start(), then base_url / model_name."""

    def __init__(self, kind, args, slots, logdir):
        self.kind, self.args, self.slots = kind, args, slots
        self.log_path = os.path.join(logdir, f"{kind}-c{slots}.server.log")
        self.child = None
        self.port = None
        self.model_name = None
        self.start_seconds = None
        self.stop_info = None

    def command(self):
        a = self.args
        if self.kind == "batchlm":
            cmd = [a.batchlm, "serve", "--model", a.model, "--host", "127.0.0.1", "--port", "0",
                   "--threads", str(a.threads), "--max-sequences", str(self.slots)]
            return cmd + shlex.split(a.batchlm_args)
        self.port = free_port()
        cmd = [a.llama_server, "-m", a.model, "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(a.threads), "--parallel", str(self.slots),
               "-c", str(self.slots * a.ctx_per_slot), "-a", default_model_name(a.model)]
        return cmd + shlex.split(a.llama_args)

    def start(self):
        cmd = self.command()
        env = dict(os.environ)
        if self.kind == "llama":   # llama-server reads its settings from LLAMA_ARG_* too
            env = {k: v for k, v in env.items() if not k.startswith("LLAMA_ARG_")}
        port_seen = threading.Event()

        def on_line(line):
            m = LISTENING.search(line)
            if m and not port_seen.is_set():
                self.port = int(m.group(1))
                port_seen.set()

        t0 = time.monotonic()
        self.child = Child(self.kind, cmd, self.log_path, env=env,
                           on_line=on_line if self.kind == "batchlm" else None)
        deadline = t0 + self.args.start_timeout
        while True:
            if not self.child.running():
                raise BenchError(f"{LABELS[self.kind]} exited with {self.child.proc.returncode} "
                                 f"while starting; {self.log_path}:\n{self.child.tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{LABELS[self.kind]} not ready after {self.args.start_timeout} s;"
                                 f" {self.log_path}:\n{self.child.tail()}")
            if self.port is not None:
                status, _ = http_get(f"http://127.0.0.1:{self.port}/health")
                if status == 200:
                    break
            time.sleep(0.2)
        self.start_seconds = time.monotonic() - t0
        self.model_name = self._served_model() or default_model_name(self.args.model)
        return self

    def _served_model(self):
        status, body = http_get(f"{self.base_url}/models", timeout=5)
        if status != 200:
            return None
        try:
            data = json.loads(body).get("data") or []
            return data[0]["id"] if data else None
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self):
        if self.child is not None and self.stop_info is None:
            rc, seconds, killed = self.child.stop()
            self.stop_info = {"exit_status": rc, "stop_seconds": round(seconds, 2),
                              "killed": killed}
        return self.stop_info


def default_model_name(model_path):
    name = os.path.basename(model_path)
    return name[:-5] if name.endswith(".gguf") else name


# ----------------------------------------------------------------------------------------------
# one measured run


def run_load(args, server, concurrency, questions, outdir, live):
    """batchlm run jobs/gsm8k.yaml against the server; returns the figures of its summary."""
    out = os.path.join(outdir, f"{server.kind}-c{concurrency}.jsonl")
    t = f"{args.request_timeout}s"
    cmd = [args.batchlm, "run", JOB, "--base-url", server.base_url, "--model", server.model_name,
           "--concurrency", str(concurrency), "--limit", str(questions), "--fresh", "-o", out,
           "--set", f"backend.timeouts.first_byte={t}", "--set", f"backend.timeouts.idle={t}",
           "--set", f"backend.timeouts.total={t}"]
    if args.max_tokens is not None:
        cmd += ["--set", f"request.max_tokens={args.max_tokens}"]
    env = dict(os.environ, BATCHLM_DATA=args.data)
    for stale in (out, out + ".summary.json"):   # from an earlier run into the same --out
        if os.path.exists(stale):
            os.remove(stale)
    client = Child("client", cmd, out + ".log", env=env)
    live.append(client)
    rc = client.wait()
    live.remove(client)
    client.stop()
    if rc not in (0, 1):   # 1: finished, some items failed (counted below)
        raise BenchError(f"batchlm run exited with {rc}; {out}.log:\n{client.tail()}")
    try:
        with open(out + ".summary.json", encoding="utf-8") as f:
            s = json.load(f)
    except (OSError, ValueError) as e:
        raise BenchError(f"no summary from batchlm run ({e}); {out}.log:\n{client.tail()}")
    wall = s["wall_seconds"]
    counts = s["counts"]
    acc = s.get("accuracy", {})
    return {
        "server": server.kind,
        "concurrency": concurrency,
        "questions": questions,
        "succeeded": counts["succeeded"],
        "failed": counts["failed"],
        "failures": s.get("failures", {}),
        "wall_seconds": wall,
        "prompt_tokens": s["tokens"]["prompt"],
        "completion_tokens": s["tokens"]["completion"],
        "output_tok_s": s["throughput"]["output_tokens_per_second"],
        "questions_per_min": 60.0 * counts["succeeded"] / wall if wall > 0 else 0.0,
        "accuracy_strict": acc.get("strict", {}).get("accuracy"),
        "accuracy_flexible": acc.get("flexible", {}).get("accuracy"),
        "correct_strict": acc.get("strict", {}).get("correct"),
        "correct_flexible": acc.get("flexible", {}).get("correct"),
        "latency_ms": s.get("latency_ms"),
        "attempts": s.get("attempts"),
        "client_exit_status": rc,
        "server_start_seconds": round(server.start_seconds, 2),
        "served_model_name": server.model_name,
        "output": out,
    }


def read_outputs(path):
    """id -> output text (None for a failed item) of a batchlm run output file."""
    outputs = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                record = json.loads(line)
                outputs[str(record["id"])] = record.get("output")
    return outputs


def identical_to_c1(results):
    """For every run above c=1: how many outputs equal the same server's at c=1."""
    base = {r["server"]: r for r in results if r["concurrency"] == 1 and "output" in r}
    for r in results:
        b = base.get(r["server"])
        if b is None or r["concurrency"] == 1 or "output" not in r:
            continue
        mine, ref = read_outputs(r["output"]), read_outputs(b["output"])
        common = [i for i in ref if i in mine and ref[i] is not None and mine[i] is not None]
        same = sum(1 for i in common if mine[i] == ref[i])
        r["identical_to_c1"] = {"same": same, "compared": len(common),
                                "differing_ids": [i for i in common if mine[i] != ref[i]][:20]}


# ----------------------------------------------------------------------------------------------
# report


def add_ratios(results):
    by = {(r["server"], r["concurrency"]): r for r in results}
    for r in results:
        c1 = by.get((r["server"], 1))
        if c1 and c1["output_tok_s"] > 0:
            r["ratio_vs_c1"] = r["output_tok_s"] / c1["output_tok_s"]
        if r["server"] == "batchlm":
            peer = by.get(("llama", r["concurrency"]))
            if peer and peer["output_tok_s"] > 0:
                r["ratio_batchlm_over_llama"] = r["output_tok_s"] / peer["output_tok_s"]


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def ratio(x):
    return "-" if x is None else f"{x:.2f}x"


def print_table(results):
    head = ["server", "conc.", "questions", "wall s", "out tok/s", "questions/min",
            "accuracy strict/flex", "vs c=1", "batchlm/llama", "same as c=1", "retries"]
    rows = []
    for r in results:
        same = r.get("identical_to_c1")
        failed = f" ({r['failed']} failed)" if r.get("failed") else ""
        rows.append([LABELS[r["server"]], str(r["concurrency"]), f"{r['questions']}{failed}",
                     f"{r['wall_seconds']:.1f}", f"{r['output_tok_s']:.1f}",
                     f"{r['questions_per_min']:.1f}",
                     f"{pct(r['accuracy_strict'])} / {pct(r['accuracy_flexible'])}",
                     ratio(r.get("ratio_vs_c1")), ratio(r.get("ratio_batchlm_over_llama")),
                     f"{same['same']}/{same['compared']}" if same else "-",
                     str((r.get("attempts") or {}).get("retries", "-"))])
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("(output tok/s: completion tokens reported by the server / wall time of the client run; "
          "vs c=1 and batchlm/llama: ratios of output tok/s; same as c=1: outputs equal to the "
          "same server's at c=1; retries: requests the client sent again)")


def version_of(exe, flag="--version"):
    try:
        p = subprocess.run([exe, flag], capture_output=True, text=True, timeout=20)
        text = (p.stdout + p.stderr).strip()
        return " / ".join(l.strip() for l in text.splitlines() if l.strip())[:300] or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def sha256_file(path, n=1 << 20):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(n), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------


def parse_args():
    ap = argparse.ArgumentParser(
        description="batchlm serve against llama-server on GSM8K: aggregate throughput and "
                    "accuracy at several concurrency levels, same model and threads, one run.")
    ap.add_argument("--batchlm", default=os.path.join(ROOT, "build/release/bin/batchlm"),
                    help="batchlm executable: the server (serve) and the load generator (run); "
                         "default build/release/bin/batchlm")
    ap.add_argument("--llama-server",
                    default=os.path.join(ROOT, "bench/engine/.llama-server/bin/llama-server"),
                    help="llama-server executable (default: the one "
                         "bench/engine/setup-llama-server.sh builds)")
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"),
                    help="GGUF model for both servers (default models/SmolLM2-135M-Instruct.Q4_1.gguf)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both servers (default 2)")
    ap.add_argument("--concurrency", default="1,8,32,64",
                    help="comma-separated concurrency levels = server slots (default 1,8,32,64)")
    ap.add_argument("--questions", type=int, default=200,
                    help="GSM8K questions per run (the first N of the test set; default 200)")
    ap.add_argument("--questions-c1", type=int,
                    help="questions at concurrency 1 (default: --questions)")
    ap.add_argument("--max-tokens", type=int,
                    help="override the job's max_tokens (512): --set request.max_tokens=M")
    ap.add_argument("--servers", default="batchlm,llama",
                    help="comma-separated: batchlm, llama (default both)")
    ap.add_argument("--ctx-per-slot", type=int, default=4096,
                    help="llama-server context per slot: -c is slots x this (default 4096)")
    ap.add_argument("--llama-args", default="",
                    help="extra arguments for llama-server (one string, shell-quoted)")
    ap.add_argument("--batchlm-args", default="",
                    help="extra arguments for batchlm serve (one string, shell-quoted)")
    ap.add_argument("--data", default=os.environ.get("BATCHLM_DATA") or
                    os.path.normpath(os.path.join(ROOT, "..", "shared", "data")),
                    help="data directory with gsm8k/test.jsonl and train.jsonl (BATCHLM_DATA; "
                         "default ../shared/data)")
    ap.add_argument("--request-timeout", type=int, default=3600,
                    help="client timeouts (first byte, idle, total) per request, in seconds "
                         "(default 3600: at high concurrency a request can wait long)")
    ap.add_argument("--start-timeout", type=int, default=300,
                    help="seconds a server may take to answer GET /health with 200 (default 300)")
    ap.add_argument("--out", help="directory for the outputs and logs (default: a temporary "
                                  "directory, removed at the end unless --keep or a run failed)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--write", action="store_true", help="write bench/engine/serve-results.json")
    args = ap.parse_args()

    try:
        args.levels = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}")
    if not args.levels or args.levels[0] < 1:
        ap.error("--concurrency: levels must be 1 or more")
    args.server_list = [s.strip() for s in args.servers.split(",") if s.strip()]
    for s in args.server_list:
        if s not in SERVERS:
            ap.error(f"--servers: unknown server {s!r} (batchlm, llama)")
    args.server_list = [s for s in SERVERS if s in args.server_list]   # batchlm first, no repeats
    if not args.server_list:
        ap.error("--servers: none given")
    if args.questions < 1:
        ap.error("--questions must be 1 or more")
    if args.questions_c1 is None:
        args.questions_c1 = args.questions
    if args.questions_c1 < 1:
        ap.error("--questions-c1 must be 1 or more")
    if args.max_tokens is not None and args.max_tokens < 1:
        ap.error("--max-tokens must be 1 or more")
    for name in ("batchlm", "llama_server", "model", "data"):
        setattr(args, name, os.path.abspath(getattr(args, name)))
    if not (os.path.isfile(args.batchlm) and os.access(args.batchlm, os.X_OK)):
        ap.error(f"no batchlm executable at {args.batchlm} (scripts/build.sh release, or "
                 f"--batchlm PATH); it is the load generator for both servers")
    if "llama" in args.server_list and not (os.path.isfile(args.llama_server) and
                                            os.access(args.llama_server, os.X_OK)):
        ap.error(f"no llama-server at {args.llama_server} "
                 f"(bench/engine/setup-llama-server.sh, or --llama-server PATH)")
    if not os.path.isfile(args.model):
        ap.error(f"no model at {args.model} (scripts/fetch-model.sh)")
    for f in ("test.jsonl", "train.jsonl"):
        if not os.path.isfile(os.path.join(args.data, "gsm8k", f)):
            ap.error(f"no {os.path.join(args.data, 'gsm8k', f)} (--data or BATCHLM_DATA)")
    return args


def _sigterm(signum, frame):
    """SIGTERM to this script ends it like Ctrl-C: the finally blocks stop every child."""
    raise KeyboardInterrupt


def stop_all(live, server):
    """SIGTERM to the clients and the server at once, then wait for each (SIGKILL 10 s after)."""
    if server is not None and server.child is not None:
        server.child.terminate()
    for child in list(live):
        child.terminate()
    for child in list(live):
        child.stop()
        live.remove(child)
    if server is not None:
        server.stop()


def main():
    args = parse_args()
    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)   # even where started with it ignored

    temp = args.out is None
    outdir = tempfile.mkdtemp(prefix="batchlm-serve-bench-") if temp else os.path.abspath(args.out)
    os.makedirs(outdir, exist_ok=True)
    load_start = os.getloadavg()
    checkout = git_commit()  # what is built and measured; edits made during the run do not count
    print(f"model {os.path.basename(args.model)}, {args.threads} threads, servers "
          f"{', '.join(LABELS[s] for s in args.server_list)}, concurrency "
          f"{','.join(map(str, args.levels))}, {args.questions} questions "
          f"({args.questions_c1} at c=1), max_tokens "
          f"{args.max_tokens if args.max_tokens is not None else 'from the job (512)'}, "
          f"outputs in {outdir}, load average {load_start[0]:.2f}", file=sys.stderr)

    results, errors = [], []
    live = []            # client processes running now
    server = None
    interrupted = False
    started = time.monotonic()
    try:
        for c in args.levels:
            questions = args.questions_c1 if c == 1 else args.questions
            for kind in args.server_list:
                print(f"  {LABELS[kind]:13} c={c:<3} starting ...", end="", file=sys.stderr,
                      flush=True)
                try:
                    server = Server(kind, args, c, outdir)
                    server.start()
                    print(f" ready in {server.start_seconds:.1f} s, {questions} questions ...",
                          end="", file=sys.stderr, flush=True)
                    r = run_load(args, server, c, questions, outdir, live)
                    r["server_stop"] = server.stop()
                    results.append(r)
                    print(f" {r['wall_seconds']:.1f} s, {r['output_tok_s']:.1f} out tok/s, "
                          f"{r['questions_per_min']:.1f} questions/min, strict "
                          f"{pct(r['accuracy_strict'])}"
                          + (f", {r['failed']} failed" if r["failed"] else ""),
                          file=sys.stderr)
                except BenchError as e:
                    print(" failed", file=sys.stderr)
                    print(f"serve.py: {LABELS[kind]} at c={c}: {e}", file=sys.stderr)
                    errors.append({"server": kind, "concurrency": c, "error": str(e)[:2000]})
                finally:
                    stop_all(live, server)
                    server = None
    except KeyboardInterrupt:
        interrupted = True
        print("\nserve.py: interrupted; stopping the servers", file=sys.stderr)
    finally:
        stop_all(live, server)
    load_end = os.getloadavg()

    if results:
        identical_to_c1(results)
        add_ratios(results)
        print_table(results)
    retried = [r for r in results if (r.get("attempts") or {}).get("retries") or r["failed"]]
    if retried:
        print("serve.py: warning: requests were retried or failed in " +
              ", ".join(f"{LABELS[r['server']]} c={r['concurrency']}" for r in retried) +
              "; retries add back-off time to the wall time (the client logs *.jsonl.log and "
              "the records' error fields say why)", file=sys.stderr)
    if errors:
        print(f"serve.py: {len(errors)} run(s) failed: " +
              ", ".join(f"{LABELS[e['server']]} c={e['concurrency']}" for e in errors),
              file=sys.stderr)

    if args.write and results:
        doc = results_header(interrupted, load_start[0], load_end[0], {
            "batchlm": version_of(args.batchlm),
            "llama_server": version_of(args.llama_server) if "llama" in args.server_list else None,
        }, checkout)
        doc.update({
            "model": os.path.basename(args.model),
            "model_sha256": sha256_file(args.model),
            "settings": {
                "servers": args.server_list,
                "threads": args.threads,
                "concurrency": args.levels,
                "questions": args.questions,
                "questions_c1": args.questions_c1,
                "max_tokens": args.max_tokens if args.max_tokens is not None else "job (512)",
                "job": os.path.relpath(JOB, ROOT),
                "llama_ctx_per_slot": args.ctx_per_slot,
                "llama_args": args.llama_args,
                "batchlm_args": args.batchlm_args,
                "request_timeout_s": args.request_timeout,
            },
        })
        write_results(RESULTS, ROOT, doc, started, results, errors)

    return finish("serve.py", outdir, temp, args.keep, errors, interrupted)


if __name__ == "__main__":
    sys.exit(main())
