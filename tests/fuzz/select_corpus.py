#!/usr/bin/env python3
"""Picks a small corpus that keeps the coverage of a large one.

libFuzzer's -merge=1 keeps every input that adds a feature, smallest first: thousands of files
after a long run. This reads the per-input coverage that the merge recorded in its control file
(-merge_control_file) and picks greedily the input that covers the most edges not yet covered
(the smaller on a tie) until every edge is covered or --max inputs are picked.

    HARNESS_fuzz -merge=1 -merge_control_file=/tmp/ctl /tmp/merged WORKING_CORPUS
    tests/fuzz/select_corpus.py /tmp/ctl tests/fuzz/corpus/HARNESS --max 40 --replace

The picked inputs are named by their SHA-1, as libFuzzer names them; --replace first removes
the inputs so named from the output folder, keeping the found-* and regress-* ones.
"""
import argparse
import hashlib
import os
import re
import shutil


def read_control(path):
    with open(path) as f:
        lines = f.read().splitlines()
    n_files = int(lines[0])
    files = lines[2:2 + n_files]
    coverage = {}
    for line in lines[2 + n_files:]:
        parts = line.split()
        if parts and parts[0] == "COV":
            coverage[int(parts[1])] = set(map(int, parts[2:]))
    return files, coverage


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("control_file")
    parser.add_argument("out_dir")
    parser.add_argument("--max", type=int, default=40, help="inputs to pick at most")
    parser.add_argument("--replace", action="store_true", help="remove the SHA-1-named inputs of out_dir first")
    args = parser.parse_args()
    if args.replace and os.path.isdir(args.out_dir):
        for name in os.listdir(args.out_dir):
            if re.fullmatch(r"[0-9a-f]{40}", name):
                os.remove(os.path.join(args.out_dir, name))

    files, coverage = read_control(args.control_file)
    sizes = {i: os.path.getsize(files[i]) for i in coverage}
    all_edges = set().union(*coverage.values()) if coverage else set()
    covered, picked = set(), []
    while len(picked) < args.max:
        best = max(coverage, key=lambda i: (len(coverage[i] - covered), -sizes[i]), default=None)
        if best is None or not coverage[best] - covered:
            break
        picked.append(best)
        covered |= coverage.pop(best)
    os.makedirs(args.out_dir, exist_ok=True)
    for i in picked:
        with open(files[i], "rb") as f:
            name = hashlib.sha1(f.read()).hexdigest()
        shutil.copyfile(files[i], os.path.join(args.out_dir, name))
    print(f"{len(picked)} inputs cover {len(covered)} of {len(all_edges)} edges")


if __name__ == "__main__":
    main()
