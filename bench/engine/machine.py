"""What a benchmark records about the machine and the checkout, and how it writes its results
(stdlib only)."""

import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def cpu_model():
    """The CPU's model name: lscpu's, else /proc/cpuinfo's, else platform's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit():
    """(HEAD, whether tracked files differ from it), or (None, None) outside a checkout."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip() != ""
        return head, dirty
    except (OSError, subprocess.CalledProcessError):
        return None, None


def nproc():
    """The processors this process may use, as nproc counts them."""
    try:
        return int(subprocess.run(["nproc"], capture_output=True, text=True,
                                  timeout=10).stdout.strip())
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return os.cpu_count()


def results_header(interrupted, load_start, load_end, versions, checkout=None):
    """The opening fields of every results document: when, the command line, the machine, the
    checkout and the versions; the benchmark adds its own after them. checkout: git_commit()
    as it was when the run started (what was built and measured); taken now when not given."""
    commit, dirty = checkout if checkout is not None else git_commit()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python3", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)]
                              + sys.argv[1:]),
        "interrupted": interrupted,
        "machine": {
            "cpu": cpu_model(),
            "nproc": nproc(),
            "system": f"{platform.system()} {platform.release()}",
            "load_average_start": load_start,
            "load_average_end": load_end,
        },
        "git_commit": commit,
        "git_dirty": dirty,
        "versions": {"python": platform.python_version(), **versions},
    }


def write_results(path, root, doc, started, results, errors):
    """Closes a results document (the run's length from `started`, a time.monotonic() reading;
    each result without its outputs; the errors), writes it as indented JSON and says where."""
    doc["total_seconds"] = round(time.monotonic() - started, 1)
    doc["results"] = [{k: v for k, v in r.items() if k != "output"} for r in results]
    doc["errors"] = errors
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(path, root)}", file=sys.stderr)


def finish(script, outdir, temp, keep, errors, interrupted):
    """Removes a run's temporary outputs unless kept or the run failed; the exit status."""
    failed = bool(errors) or interrupted
    if temp and not keep and not failed:
        shutil.rmtree(outdir, ignore_errors=True)
    elif temp:
        print(f"{script}: outputs and logs kept in {outdir}", file=sys.stderr)
    if interrupted:
        return 130
    return 1 if errors else 0
