#!/usr/bin/env python3
"""Per-kernel GPU time from an Nsight Compute CSV (bench/gpu/run.sh profile):

    ncu --csv --metrics gpu__time_duration.sum --launch-skip N --launch-count M PROGRAM ... >k.csv
    python3 bench/gpu/kernel_times.py k.csv

Prints, per kernel (name and template arguments), the launches, total and mean time and
share of the profiled total, largest first.
"""
import csv
import io
import re
import sys

UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
         "second": 1e6, "s": 1e6}


def short(name):
    """The kernel's own name with its template arguments: the first identifier followed by a
    parameter list (ncu prints anonymous namespaces as a lone 'unnamed>' or '<unnamed>')."""
    m = re.search(r"([A-Za-z_]\w*)(<[^()]*>)?\(", name)
    return (m.group(1) + (m.group(2) or "")) if m else name


def main():
    text = open(sys.argv[1], encoding="utf-8", errors="replace").read()
    start = text.find('"ID"')  # ncu prints its own lines before the table
    if start < 0:
        raise SystemExit(f"{sys.argv[1]}: no ncu CSV table in it")
    totals = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        us = float(row["Metric Value"].replace(",", "")) * UNITS[row["Metric Unit"]]
        n, t = totals.get(short(row["Kernel Name"]), (0, 0.0))
        totals[short(row["Kernel Name"])] = (n + 1, t + us)
    whole = sum(t for _, t in totals.values())
    launches = sum(n for n, _ in totals.values())
    print(f"{launches} kernels, {whole:.1f} us of GPU time")
    print(f"{'kernel':<40} {'launches':>9} {'total us':>10} {'mean us':>9} {'share':>7}")
    for name, (n, t) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:<40} {n:>9} {t:>10.1f} {t / n:>9.2f} {100 * t / whole:>6.1f}%")


if __name__ == "__main__":
    main()
