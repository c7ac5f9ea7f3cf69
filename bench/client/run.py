#!/usr/bin/env python3
"""Client benchmark: batchlm against the official Python SDK on the same fake OpenAI server.

Starts build/release/bin/fake_openai_server on 127.0.0.1, then, for each concurrency, runs
both clients one after the other on the same N generated prompts, each as a child process:

  batchlm  build/release/bin/batchlm run bench/client/job.yaml --concurrency C --fresh -o ...
  python   bench/.venv/bin/python bench/client/peer_openai.py --concurrency C ...

and measures per client: wall time (requests/s), CPU seconds (user+sys of the child, from
os.wait4) per 1,000 requests, and the child's peak RSS (ru_maxrss). Every output file must
hold N successful records, else the run fails. Prints a markdown table and writes the figures
as JSON (default bench/client/results.json).

Python 3 standard library only. Build first (scripts/build.sh release) and create the venv
(bench/client/setup.sh).
"""

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BIN = ROOT / "build" / "release" / "bin"

WORDS = ("apple river stone cloud lantern harbor meadow copper violet engine orbit "
         "signal garden thunder ribbon falcon marble canyon ember willow").split()


def parse_args():
    p = argparse.ArgumentParser(description="batchlm vs. the openai SDK on a fake server")
    p.add_argument("--concurrency", type=int, nargs="+", default=[100, 2000],
                   help="concurrency levels (default: 100 2000)")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per run (default: max(2000, 2 x concurrency))")
    p.add_argument("--clients", nargs="+", default=["batchlm", "openai"],
                   choices=["batchlm", "openai"], help="clients to run (default: both)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                   help="server threads (default: number of CPUs)")
    p.add_argument("--tokens", type=int, default=64, help="words per answer (default: 64)")
    p.add_argument("--token-delay-ms", type=int, default=20,
                   help="delay between streamed words (default: 20)")
    p.add_argument("--ttft-ms", type=int, default=0, help="delay before the first word")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each request")
    p.add_argument("--peer-connect-timeout", type=float, default=None,
                   help="connect timeout of the Python peer in s (default: the SDK's, 5 s)")
    p.add_argument("--batchlm", default=str(BIN / "batchlm"))
    p.add_argument("--server", default=str(BIN / "fake_openai_server"))
    p.add_argument("--python", default=str(ROOT / "bench" / ".venv" / "bin" / "python"))
    p.add_argument("--timeout", type=float, default=900, help="seconds per client run")
    p.add_argument("--json", default=str(HERE / "results.json"),
                   help="where to write the results ('-': nowhere)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    return p.parse_args()


def raise_fd_limit():
    """2,000 streams need 2,000+ sockets in each client and in the server; children inherit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def write_prompts(path, n):
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            a, b, c = WORDS[i % 20], WORDS[(i * 7 + 3) % 20], WORDS[(i * 13 + 5) % 20]
            prompt = (f"Item {i + 1}: write a short paragraph that uses the words "
                      f"'{a}', '{b}' and '{c}', in that order.")
            f.write(json.dumps({"prompt": prompt}) + "\n")


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def describe_build(batchlm):
    """The batchlm version and the source tree's commit, so figures can be tied to a build."""
    def out(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10,
                                  cwd=ROOT).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None
    return {"batchlm_version": out([batchlm, "--version"]),
            "commit": out(["git", "describe", "--always", "--dirty", "--abbrev=12"]),
            "binary_mtime": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                          time.gmtime(os.stat(batchlm).st_mtime))
            if os.path.exists(batchlm) else None}


def proc_cpu_seconds(pid):
    """user+sys CPU of a running process (all its threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


class Server:
    def __init__(self, args, tmp):
        port_file = tmp / "server.port"
        self.log = open(tmp / "server.log", "w")
        cmd = [args.server, "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
               "--threads", str(args.threads), "--tokens", str(args.tokens),
               "--token-delay-ms", str(args.token_delay_ms), "--ttft-ms", str(args.ttft_ms)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit(f"run.py: the fake server did not start; see {tmp / 'server.log'}")
            time.sleep(0.05)
        self.port = int(port_file.read_text().strip())
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def cpu(self):
        return proc_cpu_seconds(self.proc.pid)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_child(cmd, env, log_path, timeout):
    """Runs cmd; returns (exit status, wall s, user s, sys s, peak RSS in MiB) of that child."""
    with open(log_path, "w") as log:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.01)
        wall = time.monotonic() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped: keep Popen from waiting
    return (os.waitstatus_to_exitcode(status), wall, usage.ru_utime, usage.ru_stime,
            usage.ru_maxrss / 1024.0)


def check_output(path, n, client):
    """Counts the records of an output file; a record succeeded when it has no error and text."""
    ids, ok, errors, busy_ms = set(), 0, {}, 0.0
    if path.exists():
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                ids.add(rec.get("id"))
                busy_ms += ((rec.get("timings") or {}).get("total_ms") or 0.0)
                err = rec.get("error")
                if err is None and rec.get("output") and rec.get("usage"):
                    ok += 1
                else:
                    kind = (err or {}).get("kind", "no text or usage")
                    if (err or {}).get("cause"):
                        kind += f" ({err['cause']})"
                    errors[kind] = errors.get(kind, 0) + 1
    return {"records": len(ids), "succeeded": ok, "errors": errors, "stream_s": busy_ms / 1000.0,
            "complete": len(ids) == n and ok == n}


def run_client(client, args, server, tmp, prompts, n, conc, tag):
    out = tmp / f"{tag}-{client}-c{conc}.jsonl"
    log = tmp / f"{tag}-{client}-c{conc}.log"
    env = dict(os.environ, OPENAI_API_KEY="sk-bench-dummy")
    env.pop("OPENAI_BASE_URL", None)
    stats_path = tmp / f"{tag}-{client}-c{conc}.stats.json"
    if client == "batchlm":
        env.update(BENCH_INPUT=str(prompts), BENCH_BASE_URL=server.base_url,
                   BENCH_MAX_TOKENS=str(args.max_tokens))
        cmd = [args.batchlm, "run", str(HERE / "job.yaml"), "--concurrency", str(conc),
               "--output", str(out), "--fresh"]
    else:
        cmd = [args.python, str(HERE / "peer_openai.py"), "--input", str(prompts),
               "--output", str(out), "--base-url", server.base_url, "--concurrency", str(conc),
               "--max-tokens", str(args.max_tokens), "--stats", str(stats_path)]
        if args.peer_connect_timeout is not None:
            cmd += ["--connect-timeout", str(args.peer_connect_timeout)]
    server_cpu0 = server.cpu()
    code, wall, user, sys_, rss = run_child(cmd, env, log, args.timeout)
    server_cpu = server.cpu() - server_cpu0
    check = check_output(out, n, client)
    cpu = user + sys_
    result = {"client": client, "concurrency": conc, "requests": n, "exit_code": code,
              "wall_s": round(wall, 3), "requests_per_s": round(n / wall, 1),
              "user_s": round(user, 3), "sys_s": round(sys_, 3), "cpu_s": round(cpu, 3),
              "cpu_s_per_1k": round(cpu * 1000 / n, 3), "peak_rss_mib": round(rss, 1),
              "server_cpu_s": round(server_cpu, 3), **check, "command": cmd, "log": str(log)}
    # Sum of every request's duration over the wall time: how many streams were open on average.
    result["mean_in_flight"] = round(check["stream_s"] / wall, 1)
    if stats_path.exists():
        stats = json.loads(stats_path.read_text())
        result["import_cpu_s"] = round(stats["import_cpu_s"], 3)
    return result


def fmt_ratio(x):
    return f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


def table(results, concs):
    by = {(r["client"], r["concurrency"]): r for r in results}
    lines = [
        "| concurrency | requests | client | requests/s | CPU s / 1k requests | peak RSS (MiB) "
        "| mean streams in flight | ok |",
        "|---:|---:|---|---:|---:|---:|---:|---|"]
    ratios = []
    for c in concs:
        for client in ("batchlm", "openai"):
            r = by.get((client, c))
            if r is None:
                continue
            name = "batchlm" if client == "batchlm" else "openai SDK (Python)"
            ok = "yes" if r["complete"] and r["exit_code"] == 0 else (
                f"NO: {r['succeeded']}/{r['requests']} ok, exit {r['exit_code']}, {r['errors']}")
            lines.append(f"| {c} | {r['requests']} | {name} | {r['requests_per_s']:.0f} | "
                         f"{r['cpu_s_per_1k']:.2f} | {r['peak_rss_mib']:.0f} | {r['mean_in_flight']:.0f} | {ok} |")
        b, o = by.get(("batchlm", c)), by.get(("openai", c))
        if b and o:
            ratios.append({
                "concurrency": c,
                "requests_per_s": o["requests_per_s"] and b["requests_per_s"] / o["requests_per_s"],
                "cpu_per_request": b["cpu_s_per_1k"] and o["cpu_s_per_1k"] / b["cpu_s_per_1k"],
                "peak_rss": b["peak_rss_mib"] and o["peak_rss_mib"] / b["peak_rss_mib"]})
    if ratios:
        lines += ["", "| concurrency | requests/s, batchlm / openai | CPU per request, openai / batchlm "
                  "| peak RSS, openai / batchlm |", "|---:|---:|---:|---:|"]
        for q in ratios:
            lines.append(f"| {q['concurrency']} | {fmt_ratio(q['requests_per_s'])} | "
                         f"{fmt_ratio(q['cpu_per_request'])} | {fmt_ratio(q['peak_rss'])} |")
    return "\n".join(lines), ratios


def main():
    args = parse_args()
    for path, what in ((args.batchlm, "batchlm"), (args.server, "fake_openai_server")):
        if "batchlm" in args.clients or what == "fake_openai_server":
            if not os.access(path, os.X_OK):
                sys.exit(f"run.py: {path} is missing; build it with scripts/build.sh release")
    if "openai" in args.clients and not os.access(args.python, os.X_OK):
        sys.exit(f"run.py: {args.python} is missing; create it with bench/client/setup.sh")
    nofile = raise_fd_limit()
    need = max(args.concurrency) + 100
    if nofile < need:
        print(f"run.py: warning: open-file limit {nofile} < {need}", file=sys.stderr)

    build = describe_build(args.batchlm)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    tmp = Path(tempfile.mkdtemp(prefix="batchlm-client-bench-"))
    server = Server(args, tmp)
    print(f"fake server on {server.base_url} (threads {args.threads}, {args.tokens} words, "
          f"{args.token_delay_ms} ms apart); work dir {tmp}", file=sys.stderr)
    results = []
    try:
        # Warm-up, not measured: page cache, the server's first connections, Python's bytecode.
        warm = tmp / "warmup.jsonl"
        write_prompts(warm, 50)
        for client in args.clients:
            w = run_client(client, args, server, tmp, warm, 50, 10, "warmup")
            if not (w["complete"] and w["exit_code"] == 0):
                print(f"run.py: warning: warm-up of {client} failed: exit {w['exit_code']}, "
                      f"{w['succeeded']}/50 ok, {w['errors']}; log {w['log']}", file=sys.stderr)
        for conc in args.concurrency:
            n = args.requests or max(2000, 2 * conc)
            prompts = tmp / f"prompts-{n}.jsonl"
            if not prompts.exists():
                write_prompts(prompts, n)
            for client in args.clients:
                r = run_client(client, args, server, tmp, prompts, n, conc, "run")
                results.append(r)
                print(f"  c={conc:<5} {client:<8} {r['wall_s']:7.2f} s wall  "
                      f"{r['requests_per_s']:7.1f} req/s  cpu {r['cpu_s']:6.2f} s  "
                      f"rss {r['peak_rss_mib']:6.1f} MiB  in flight {r['mean_in_flight']:6.1f}  "
                      f"server cpu {r['server_cpu_s']:5.2f} s  "
                      f"ok {r['succeeded']}/{n}", file=sys.stderr)
    finally:
        server.stop()

    text, ratios = table(results, args.concurrency)
    print(text)
    failed = [r for r in results if not (r["complete"] and r["exit_code"] == 0)]
    for r in failed:
        print(f"\nFAILED: {r['client']} at c={r['concurrency']}: exit {r['exit_code']}, "
              f"{r['succeeded']}/{r['requests']} succeeded, errors {r['errors']}; log {r['log']}",
              file=sys.stderr)
    if args.json != "-":
        doc = {
            "command": " ".join(["python3", "bench/client/run.py"] + sys.argv[1:]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "processor": cpu_model(),
                        "python": platform.python_version()},
            "server": {"threads": args.threads, "tokens": args.tokens,
                       "token_delay_ms": args.token_delay_ms, "ttft_ms": args.ttft_ms},
            "build": build, "date": started,
            "max_tokens": args.max_tokens, "open_file_limit": nofile,
            "peer_connect_timeout_s": args.peer_connect_timeout,
            "results": results, "ratios": ratios}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if not args.keep and not failed:
        shutil.rmtree(tmp, ignore_errors=True)
    elif failed:
        print(f"outputs and logs kept in {tmp}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
